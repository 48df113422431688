# parallel-llm-course: `make lab` opens the course, `make test` runs everything CI runs.
# Both create ./.venv with the Python given by PYTHON (3.10 or newer).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test test-unit test-notebooks figures bench clean

# --allow-root only for root (containers, lab VMs): JupyterLab refuses root otherwise
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)

test: test-unit test-notebooks

test-unit: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pytest tests -q --durations=10

# --nbval-lax: every cell must run; only cells marked "# NBVAL_CHECK_OUTPUT" compare outputs.
# peak_memory.py holds the course to its promise: every notebook within 4 GiB of RAM.
test-notebooks: $(STAMP)
	$(BIN)/python tools/store_notebook.py --check notebooks/*.ipynb
	$(BIN)/python tools/peak_memory.py --limit-gib 4 -- $(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=600 -p no:cacheprovider notebooks -q --durations=6

figures: $(STAMP)
	$(BIN)/python -m parallel_lib.figures

bench: $(STAMP)
	$(BIN)/python -m parallel_lib.bench dp
	$(BIN)/python -m parallel_lib.bench allreduce
	$(BIN)/python -m parallel_lib.bench pp
	$(BIN)/python -m parallel_lib.bench tp

# The torch step first tries a torch wheel that pip can find locally (a classroom's
# wheel folder set as pip's find-links) so no multi-GB CUDA build is downloaded on a
# CPU-only lab machine; with none there it does nothing and pip fetches torch below.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed, got " + sys.version)'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q --no-index --no-deps 'torch>=2.4' 2>/dev/null || true
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache

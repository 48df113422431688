# parallel-llm-course: `make lab` opens the course, `make test` runs everything CI runs.
# Both create ./.venv with the Python given by PYTHON (3.10 or newer).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Test files (and notebooks) run on this many pytest-xdist workers, whole files per worker
# (--dist loadfile) so a file's fixtures and a notebook's kernel stay in one process. Two fit
# a 2-core lab machine: much of a run is spent starting ranks and importing torch, not computing.
TEST_WORKERS ?= 2

.PHONY: lab reset test test-unit test-notebooks figures book bench clean

# The lab opens working copies in lab/ (ignored by git), so JupyterLab's autosave never writes
# outputs into the tracked notebooks that `make test` checks. A chapter added later is copied
# in on the next `make lab`; copies already there are kept with the student's work.
# --allow-root only for root (containers, lab VMs): JupyterLab refuses root otherwise.
# jupyterlab-settings/overrides.json changes JupyterLab's defaults for this course only: no
# "get notified about news?" prompt (a reader's own settings still win).
lab: $(STAMP)
	@mkdir -p lab
	@for nb in notebooks/*.ipynb; do [ -e "lab/$${nb#notebooks/}" ] || cp "$$nb" lab/; done
	$(BIN)/jupyter lab --notebook-dir=lab "--LabApp.app_settings_dir=$(CURDIR)/jupyterlab-settings" $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# `make reset NB=03` puts lab/03_*.ipynb back as shipped (the student's copy is overwritten);
# `make reset NB=08` resets both halves of chapter 08 (08a_*, 08b_*), `NB=08b` one of them;
# `make reset` with no NB resets every chapter.
reset:
	@mkdir -p lab
	@for nb in notebooks/$(if $(NB),$(NB)[_ab]*,*).ipynb; do cp -v "$$nb" lab/; done

test: test-unit test-notebooks

test-unit: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --durations=10

# --nbval-lax: every cell must run; only cells marked "# NBVAL_CHECK_OUTPUT" compare outputs.
# peak_memory.py holds the course to its promise: every notebook within 4 GiB of RAM.
test-notebooks: $(STAMP)
	$(BIN)/python tools/store_notebook.py --check notebooks/*.ipynb
	$(BIN)/python tools/peak_memory.py --limit-gib 4 -- $(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=600 -p no:cacheprovider notebooks -q -n $(TEST_WORKERS) --dist loadfile --durations=6

# Images go to build/figures/ so a reader's run leaves the repository unchanged; maintainers
# update the course's images with `make figures FIGURES_OUT=figures`.
FIGURES_OUT ?= build/figures
figures: $(STAMP)
	$(BIN)/python -m parallel_lib.figures --out $(FIGURES_OUT)

# `make book`: every notebook executed on this machine, rendered as a static site under build/book/
# (index.html in course order, each page labelled with the machine), with the measured tables of
# docs/measurements.md; publish the folder as it is (README: "A course readable without running it").
book: $(STAMP)
	$(BIN)/python tools/build_book.py notebooks/*.ipynb --page docs/measurements.md --out build/book

# `make bench QUICK=1`: every benchmark as a smoke run of a few seconds
BENCH = $(BIN)/python -m parallel_lib.bench
BENCH_FLAGS = $(if $(QUICK),--quick,)
bench: $(STAMP)
	$(BENCH) dp $(BENCH_FLAGS)
	$(BENCH) allreduce $(BENCH_FLAGS)
	$(BENCH) pp $(BENCH_FLAGS)
	$(BENCH) sharding $(BENCH_FLAGS)
	$(BENCH) tp $(BENCH_FLAGS)
	$(BENCH) schedules $(BENCH_FLAGS)
	$(BENCH) split_backward $(BENCH_FLAGS)
	$(BENCH) inference $(BENCH_FLAGS)
	$(BENCH) planner $(BENCH_FLAGS)
	$(BENCH) context $(BENCH_FLAGS)
	$(BENCH) moe $(BENCH_FLAGS)
	$(BENCH) serving $(BENCH_FLAGS)

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

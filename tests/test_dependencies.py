"""The dependency floors match the code, and pip and conda users get the same packages.

A floor below what the code imports installs fine and then fails at the first notebook
cell that needs the newer API; a package listed for pip but not for conda fails only
for conda users. Both are read from the files as text (no TOML or YAML parser needed).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text()
ENVIRONMENT = (ROOT / "environment.yml").read_text()
SOURCE = "\n".join(p.read_text() for p in sorted((ROOT / "parallel_lib").rglob("*.py")))
CONDA_NAMES = {"torch": "pytorch"}  # where conda-forge names a package differently


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _pip_floors() -> dict[str, str]:
    """``name -> floor`` of the dependencies and the dev extras in pyproject.toml."""
    sections = re.findall(r"^(?:dependencies|dev) = \[(.*?)^\]", PYPROJECT, flags=re.S | re.M)
    assert len(sections) == 2, "pyproject.toml: dependencies and the dev extras not found"
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', "".join(sections)))


def _conda_floors() -> dict[str, str]:
    """``name -> floor`` of every package environment.yml installs, by conda or by its pip section."""
    return dict(re.findall(r"^\s*- ([A-Za-z0-9_.-]+)>=([0-9.]+)", ENVIRONMENT, flags=re.M))


def test_conda_installs_what_pip_installs_with_the_same_floors():
    pip, conda = _pip_floors(), _conda_floors()
    assert {"torch", "transformers", "psutil", "playwright"} <= set(pip)
    for name, floor in pip.items():
        conda_name = CONDA_NAMES.get(name, name)
        assert conda_name in conda, f"environment.yml lacks {conda_name} (pyproject.toml: {name}>={floor})"
        assert conda[conda_name] == floor, f"{conda_name}: environment.yml >={conda[conda_name]}, pyproject >={floor}"


def test_floors_cover_the_apis_the_code_imports():
    floors = _pip_floors()
    if "transformers.masking_utils" in SOURCE:  # the GPT-2 pipeline stages' causal mask
        assert _version(floors["transformers"]) >= (4, 53), "transformers.masking_utils first shipped in 4.53"
    if re.search(r"create_causal_mask\([^)]*\bcache=", SOURCE):
        assert _version(floors["transformers"]) >= (5, 24), "create_causal_mask's cache= (was past_key_values=) is 5.24's"
    if "torch.distributed.pipelining" in SOURCE:  # bench pp's comparison with PyTorch's schedules
        assert _version(floors["torch"]) >= (2, 4), "torch.distributed.pipelining first shipped in torch 2.4"


def test_environment_yml_tells_conda_users_how_to_test():
    assert "conda env create -f environment.yml" in ENVIRONMENT
    assert "python -m pytest tests" in ENVIRONMENT and "--nbval-lax" in ENVIRONMENT


def test_readme_states_the_tested_versions_and_the_floor_agrees():
    readme = (ROOT / "README.md").read_text()
    tested = re.search(r"tested with torch ([0-9.]+)\s+and with transformers ([0-9.]+), the floor", readme)
    assert tested, "README.md: the sentence 'The course is tested with torch X and with transformers Y, the floor ...'"
    floors = _pip_floors()
    assert tested.group(2) == floors["transformers"], "the tested transformers version is pyproject.toml's floor"
    assert _version(tested.group(1)) >= _version(floors["torch"])

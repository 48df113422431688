"""The figure registry: every computed figure draws, names are unique, selections are checked."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parallel_lib import figures  # noqa: E402


def test_stems_are_unique_and_each_has_a_committed_image():
    stems = [f.stem for f in figures.FIGURES]
    assert len(stems) == len(set(stems))
    missing = [s for s in stems if not (figures.DEFAULT_OUT / f"{s}.png").exists()]
    assert not missing, f"run `make figures` to create {missing}"


def test_static_figures_draw_without_launching_anything(tmp_path):
    assert figures.main(["--static", "--out", str(tmp_path), "--only", "ch03", "ch04", "ch05"]) == 0
    made = sorted(p.stem for p in tmp_path.glob("*.png"))
    expected = sorted(f.stem for f in figures.FIGURES if f.chapter in ("ch03", "ch04", "ch05") and not f.measured)
    assert made == expected and made


def test_unknown_selection_names_the_known_ones():
    with pytest.raises(ValueError, match="only must name figure stems or chapters.*ch04"):
        figures.select(["ch99"])
    plt.close("all")


def test_a_calculator_panel_redraws_when_a_control_changes():
    widgets = pytest.importorskip("ipywidgets")
    from parallel_lib.viz.widgets import figure_panel

    drawn = []

    def draw(size: int, name: str):
        drawn.append((size, name))
        return plt.figure()

    controls = dict(size=widgets.IntSlider(value=2, min=1, max=9), name=widgets.Dropdown(options=["a", "b"]))
    panel = figure_panel(draw, controls, per_row=1)
    assert len(panel.children) == 3 and drawn == [(2, "a")]  # one row per control, then the output
    controls["size"].value = 5
    controls["name"].value = "b"
    assert drawn == [(2, "a"), (5, "a"), (5, "b")]
    with pytest.raises(ValueError, match="per_row"):
        figure_panel(draw, controls, per_row=0)

"""One calculator panel for every chapter: controls that redraw a figure when they change.

A chapter's calculator (ZeRO memory, serving memory, the planner) is a pure function from
a few values to a figure; this turns it into an ipywidgets panel, so each chapter writes
only its figure and its controls. The figure is closed after display: a notebook that
redraws on every slider move would otherwise keep every old figure in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from matplotlib.figure import Figure

from parallel_lib.common.checks import positive_int

__all__ = ["figure_panel"]


def figure_panel(draw: Callable[..., Figure], controls: Mapping[str, Any], per_row: int = 3) -> Any:
    """An ``ipywidgets.VBox``: ``controls`` in rows of ``per_row``, then ``draw(**values)``, redrawn on change.

    Args:
        draw: makes the figure from the controls' values, passed by the controls' names.
        controls: ``{argument name: ipywidgets control}``.
        per_row: controls per row.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    positive_int("per_row", per_row)
    out = widgets.Output()

    def redraw(_: Any = None) -> None:
        with out:
            out.clear_output(wait=True)
            fig = draw(**{name: control.value for name, control in controls.items()})
            display(fig)
            plt.close(fig)

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    values = list(controls.values())
    rows = [widgets.HBox(values[i:i + per_row]) for i in range(0, len(values), per_row)]
    return widgets.VBox(rows + [out])

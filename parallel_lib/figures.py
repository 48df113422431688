"""Regenerate every image under ``figures/``: ``python -m parallel_lib.figures``.

Each module in :mod:`parallel_lib.viz` may define ``figures() -> dict[str, Figure]``
(file stem -> figure). Collecting them here, instead of keeping a list, means a
chapter adds a figure by adding it to its own viz module, and the README and the
notebooks' Markdown cells show exactly what the library draws.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede pyplot's import by the viz modules
import matplotlib.pyplot as plt  # noqa: E402

import parallel_lib.viz as viz_package  # noqa: E402

__all__ = ["collect", "main"]

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "figures"


def collect(only: list[str] | None = None) -> dict[str, object]:
    """``{stem: figure}`` from every viz module that defines ``figures()``."""
    found: dict[str, object] = {}
    for info in pkgutil.iter_modules(viz_package.__path__):
        if only and info.name not in only:
            continue
        module = importlib.import_module(f"parallel_lib.viz.{info.name}")
        make = getattr(module, "figures", None)
        if make is None:
            continue
        for stem, fig in make().items():
            if stem in found:
                raise ValueError(f"figure name {stem!r} is defined twice (second time in viz.{info.name})")
            found[stem] = fig
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNG files")
    parser.add_argument("--only", nargs="*", help="viz module names to run (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, fig in collect(args.only).items():
        path = args.out / f"{stem}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

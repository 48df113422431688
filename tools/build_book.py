"""Build the course as a static site a teacher can read without running it: ``make book``.

    python tools/build_book.py notebooks/*.ipynb --page docs/measurements.md --out build/book

The notebooks are stored with only their checked outputs (``tools/store_notebook.py``), so the
repository shows no plot and no timing. This executes every notebook on the reader's machine (a
copy: the tracked files are never written), renders it with nbconvert's HTML exporter, and writes
an index in course order. Every number on an executed page is measured here, so each page carries a
header naming the machine (CPU model, cores, GPUs, torch, date), gathered once for the whole book.
A widget cannot run without a kernel: its output is replaced by the static image of the same
picture that ``make figures`` saves under ``figures/`` (the folder is copied beside the pages, so
the notebooks' own ``../figures/`` links work too). Markdown pages (the measured tables) are
rendered by the same exporter; they keep the machine labels written beside their tables.

Layout of the output: ``index.html``, ``notebooks/<name>.html``, ``pages/<name>.html``,
``figures/*.png``.
"""

from __future__ import annotations

import argparse
import datetime
import html
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbconvert import HTMLExporter
from traitlets.config import Config

ROOT = Path(__file__).resolve().parent.parent
BACK = '<p><a href="../index.html">&larr; the course\'s contents</a></p>'  # atop every page, one folder down
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

# The function a cell calls to show a widget -> the stem of its static image under figures/.
# A notebook can name another image for the same function (chapter 08's schedule widget opens on
# the interleaved schedules, chapter 04's on GPipe and 1F1B): "NN:function" keys win over "function".
WIDGET_FIGURES: dict[str, str] = {
    "ring_widget": "ring_allreduce_steps",
    "memory_calculator": "memory_llama2_7b_v100",
    "schedule_widget": "pipeline_animation",
    "08:schedule_widget": "pipeline_schedules_ch08",
    "strategy_widget": "strategy_options_llama2_7b",
    "zero_calculator": "zero_calculator_7b",
    "layer_widget": "tp_layer_steps",
    "serving_calculator": "inference_calculator",
    "planner_widget": "planner_widget_ch10",
    "ring_attention_widget": "ring_attention",
    "dispatch_widget": "moe_all_to_all",
    "serving_steps_widget": "serving_steps",
}


def cpu_model() -> str:
    """The processor's marketing name, or the architecture where the system does not say.

    Returns:
        e.g. ``"AMD EPYC 7B13"``; ``platform.machine()`` (``"x86_64"``) as a last resort.
    """
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the book's pages ran on, gathered once for the whole build.

    Returns:
        ``{"cpu", "cores", "system", "gpus", "torch", "date"}``; ``gpus`` lists ``"name (N GiB)"``,
        empty without a GPU.
    """
    from parallel_lib.runtime.environment import environment_info  # the library's own report

    info = environment_info()
    return {"cpu": cpu_model(), "cores": info["cpu_count"], "system": info["system"],
            "gpus": [f"{name} ({memory:.0f} GiB)" for name, memory in info["gpus"]],
            "torch": info["torch"], "date": datetime.date.today().isoformat()}


def machine_header(machine: Mapping[str, Any]) -> str:
    """The small HTML block at the top of every executed page.

    Args:
        machine: as :func:`machine_info` returns it.

    Returns:
        One ``<div class="book-machine">`` naming CPU, cores, GPUs, torch and the date.
    """
    gpus = ", ".join(machine["gpus"]) or "no GPU"
    text = (f"Ran on {machine['cpu']}, {machine['cores']} cores ({machine['system']}), {gpus}; "
            f"torch {machine['torch']}; {machine['date']}. Every number the chapters measure was measured there.")
    return (f'<div class="book-machine" style="font-size:0.85em;border:1px solid #ccc;'
            f'padding:0.4em 0.8em;margin-bottom:1em">{html.escape(text)}</div>')


def chapter_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The notebook's first markdown heading, e.g. ``"00 · Set-up and devices"``.

    Args:
        nb: the notebook.
        fallback: returned when no markdown cell has a heading (the file's stem, say).

    Returns:
        The heading's text without its ``#`` marks.
    """
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^#+\s+(.+?)\s*$", cell.source, re.MULTILINE)
            if match:
                return match.group(1)
    return fallback


def chapter_number(path: Path) -> str:
    """The chapter a notebook belongs to: the leading digits of its name.

    Args:
        path: e.g. ``notebooks/08a_interleaving.ipynb``.

    Returns:
        ``"08"`` for that path (a chapter split in two keeps its number); ``""`` without digits.
    """
    match = re.match(r"\d+", path.name)
    return match.group(0) if match else ""


def widget_figure(source: str, chapter: str, widget_figures: Mapping[str, str]) -> Optional[str]:
    """The static image's stem for a cell that shows a widget, or None when none is known.

    Args:
        source: the code cell's source.
        chapter: the notebook's chapter (:func:`chapter_number`), for ``"NN:function"`` keys.
        widget_figures: ``{"function" or "NN:function": figure stem}``, as :data:`WIDGET_FIGURES`.

    Returns:
        The stem of the last widget function the cell calls that the table knows.
    """
    found = None
    for match in re.finditer(r"\b(\w+)\s*\(", source):
        name = match.group(1)
        found = widget_figures.get(f"{chapter}:{name}", widget_figures.get(name, found))
    return found


def replace_widgets(nb: nbformat.NotebookNode, chapter: str, figures_url: str, figures: Path,
                    widget_figures: Mapping[str, str]) -> int:
    """Swap every widget output for its static image (or a note where there is none), in place.

    Args:
        nb: an executed notebook.
        chapter: the notebook's number, see :func:`widget_figure`.
        figures_url: how a page links the copied ``figures/`` folder (``"../figures"``).
        figures: the folder the images come from (an image not there gets the note instead).
        widget_figures: see :func:`widget_figure`.

    Returns:
        How many widget outputs were replaced.
    """
    replaced = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            if WIDGET_MIME not in out.get("data", {}):
                outputs.append(out)
                continue
            replaced += 1
            stem = widget_figure(cell.source, chapter, widget_figures)
            if stem and (figures / f"{stem}.png").exists():
                body = (f'<figure><img src="{figures_url}/{stem}.png" alt="{html.escape(stem)}" '
                        f'style="max-width:100%"><figcaption><em>An interactive widget in JupyterLab; here its '
                        f'static image from <code>figures/{html.escape(stem)}.png</code>.</em></figcaption></figure>')
            else:
                body = ("<p><em>An interactive widget: run this notebook in JupyterLab (<code>make lab</code>) "
                        "to use it.</em></p>")
            outputs.append(nbformat.v4.new_output("display_data", data={"text/html": body}))
        cell.outputs = outputs
    return replaced


def execute(path: Path, timeout: int) -> nbformat.NotebookNode:
    """Run a copy of the notebook in its own folder, with inline plots.

    Args:
        path: the notebook file (left unchanged).
        timeout: seconds allowed per cell.

    Returns:
        The executed notebook.

    Raises:
        RuntimeError: a cell failed; the message names the notebook and carries the cell's error.
    """
    nb = nbformat.read(path, as_version=4)
    # MPLBACKEND=Agg (as `make test` sets it) would stop the kernel from showing plots inline
    env = {key: value for key, value in os.environ.items() if key != "MPLBACKEND"}
    # widget state is stored (nbclient's Output-widget capture fails without it) and dropped by render()
    # the kernel talks over Unix sockets in a private folder, not TCP ports: a port taken between
    # jupyter_client choosing it and the kernel binding it ("Address already in use") cannot happen.
    # The client makes (and so shuts down) the kernel itself; only its manager's settings are ours.
    with tempfile.TemporaryDirectory(prefix="book-kernel-") as sockets:
        config = Config()
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(sockets, "k")
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", config=config,
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        try:
            client.execute(env=env)
        except CellExecutionError as error:
            raise RuntimeError(f"{path}: a cell failed while building the book:\n{error}") from error
    return nb


def render(nb: nbformat.NotebookNode, title: str, header: str) -> str:
    """The notebook as one HTML page (nbconvert's lab template), ``header`` first.

    Args:
        nb: the notebook to render (a copy is changed, not ``nb``).
        title: the page's ``<title>``.
        header: HTML put in a markdown cell before the first cell (empty: none).

    Returns:
        The page's HTML.
    """
    nb = nbformat.from_dict(nb)
    nb.metadata.pop("widgets", None)
    if header:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(header))
    nb.metadata["title"] = title
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return body


def markdown_page(path: Path) -> tuple[str, str]:
    """A markdown file rendered like the notebooks: one markdown cell through the same exporter.

    Args:
        path: the ``.md`` file.

    Returns:
        ``(title, html)``; the title is the file's first heading.
    """
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(path.read_text())]
    title = chapter_title(nb, path.stem)
    return title, render(nb, title, BACK)


def index_page(chapters: Sequence[tuple[str, str]], pages: Sequence[tuple[str, str]], header: str) -> str:
    """The book's front page: the chapters in course order, then the other pages.

    Args:
        chapters: ``(link, title)`` per notebook, in course order.
        pages: ``(link, title)`` per markdown page.
        header: the machine header (see :func:`machine_header`).

    Returns:
        The page's HTML.
    """
    def items(links: Sequence[tuple[str, str]]) -> str:
        return "\n".join(f'  <li><a href="{html.escape(link)}">{html.escape(title)}</a></li>' for link, title in links)

    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>parallel-llm-course</title>
<style>body{{font-family:system-ui,sans-serif;max-width:50em;margin:2em auto;line-height:1.5;padding:0 1em}}</style>
</head><body>
<h1>parallel-llm-course</h1>
<p>Distributed training of language models, run for real: each chapter below was executed top to
bottom by <code>make book</code> on the machine named here, and its outputs are this machine's.
Run the notebooks yourself with <code>make lab</code>.</p>
{header}
<h2>Chapters</h2>
<ul>
{items(chapters)}
</ul>
<h2>More</h2>
<ul>
{items(pages)}
</ul>
</body></html>
"""


def build_book(notebooks: Sequence[Path], out: Path, pages: Sequence[Path] = (), figures: Path = ROOT / "figures",
               machine: Optional[Mapping[str, Any]] = None, timeout: int = 600,
               widget_figures: Mapping[str, str] = WIDGET_FIGURES) -> Path:
    """Execute the notebooks and write the site under ``out`` (emptied first).

    Args:
        notebooks: the chapters, in course order (sorted by name when given as a glob).
        out: the output folder, e.g. ``build/book``.
        pages: markdown files rendered as further pages (the measured tables).
        figures: the folder of static images copied to ``out/figures``.
        machine: what the pages ran on; gathered by :func:`machine_info` when None.
        timeout: seconds allowed per cell.
        widget_figures: widget function -> image stem, see :func:`widget_figure`.

    Returns:
        The index page's path.

    Raises:
        FileNotFoundError: a notebook, a page or the figures folder does not exist.
        RuntimeError: a notebook's cell failed (see :func:`execute`).
    """
    for path in [*notebooks, *pages, figures]:
        if not Path(path).exists():
            raise FileNotFoundError(f"build_book: {path} does not exist; give existing notebooks, pages and figures")
    header = machine_header(machine if machine is not None else machine_info())
    if out.exists():
        shutil.rmtree(out)
    (out / "notebooks").mkdir(parents=True)
    (out / "pages").mkdir()
    shutil.copytree(figures, out / "figures")
    chapters = []
    for path in sorted(map(Path, notebooks), key=lambda p: p.name):
        start = time.perf_counter()
        nb = execute(path, timeout)
        replace_widgets(nb, chapter_number(path), "../figures", figures, widget_figures)
        title = chapter_title(nb, path.stem)
        (out / "notebooks" / f"{path.stem}.html").write_text(render(nb, title, BACK + header), encoding="utf-8")
        chapters.append((f"notebooks/{path.stem}.html", title))
        print(f"{path}: executed and rendered in {time.perf_counter() - start:.1f} s", flush=True)
    links = []
    for path in map(Path, pages):
        title, body = markdown_page(path)
        (out / "pages" / f"{path.stem}.html").write_text(body, encoding="utf-8")
        links.append((f"pages/{path.stem}.html", title))
    index = out / "index.html"
    index.write_text(index_page(chapters, links, header), encoding="utf-8")
    return index


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--page", action="append", type=Path, default=[], help="a markdown page to add (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "book")
    parser.add_argument("--figures", type=Path, default=ROOT / "figures")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    index = build_book(args.notebooks, args.out, args.page, args.figures, timeout=args.timeout)
    print(f"the book is at {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

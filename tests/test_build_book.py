"""`make book`'s builder on two tiny notebooks and a markdown page, and the lab's shipped settings."""

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import build_book  # noqa: E402


class _Links(HTMLParser):
    """Every href and src of a page."""

    def __init__(self):
        super().__init__()
        self.links = []

    def handle_starttag(self, tag, attrs):
        self.links += [value for name, value in attrs if name in ("href", "src") and value]


def _local_links(page: Path) -> list[str]:
    parser = _Links()
    parser.feed(page.read_text())
    return [link for link in parser.links if not re.match(r"^(https?:|data:|#|mailto:)", link)]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    (src / "notebooks").mkdir()
    figures = src / "figures"
    figures.mkdir()
    (figures / "tiny_static.png").write_bytes((ROOT / "figures" / "setup_all_reduce.png").read_bytes())
    first = nbformat.v4.new_notebook()
    first.cells = [nbformat.v4.new_markdown_cell("# 00 · First steps\n\n"
                                                  "![a stored figure](../figures/tiny_static.png)"),
                   nbformat.v4.new_code_cell("print(6 * 7)"),
                   nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")]
    second = nbformat.v4.new_notebook()
    second.cells = [nbformat.v4.new_markdown_cell("Some text before the title.\n\n## 01 · A widget"),
                    # an Output widget drawn into, as the course's panels do (viz.widgets.figure_panel)
                    nbformat.v4.new_code_cell("import ipywidgets\n\ndef tiny_widget():\n"
                                              "    out = ipywidgets.Output()\n    with out:\n        print('drawn')\n"
                                              "    return ipywidgets.VBox([ipywidgets.IntSlider(), out])\n"
                                              "\ntiny_widget()"),
                    nbformat.v4.new_code_cell("ipywidgets.IntSlider()")]
    # written in reverse order: the index follows the file names, not the command line
    nbformat.write(second, src / "notebooks" / "01_widget.ipynb")
    nbformat.write(first, src / "notebooks" / "00_first.ipynb")
    page = src / "measurements.md"
    page.write_text("# Measured here\n\n| runs | s |\n| --- | --- |\n| 1 | 0.5 |\n")
    out = src / "book"
    (out / "stale").mkdir(parents=True)  # an old build is replaced, not added to
    index = build_book.build_book([src / "notebooks" / "01_widget.ipynb", src / "notebooks" / "00_first.ipynb"],
                                  out, pages=[page], figures=figures, timeout=120,
                                  widget_figures={"tiny_widget": "tiny_static"})
    return out, index


def test_index_lists_the_chapters_in_course_order_with_their_titles(book):
    out, index = book
    assert index == out / "index.html" and not (out / "stale").exists()
    text = index.read_text()
    first, second, page = (text.index("00 · First steps"), text.index("01 · A widget"), text.index("Measured here"))
    assert first < second < page
    assert 'href="notebooks/00_first.html"' in text and 'href="pages/measurements.html"' in text


def test_every_local_link_of_the_book_resolves(book):
    out, _ = book
    pages = [out / "index.html", *sorted((out / "notebooks").glob("*.html")), *sorted((out / "pages").glob("*.html"))]
    assert len(pages) == 4
    for page in pages[1:]:
        assert 'href="../index.html"' in page.read_text(), f"{page.name} does not lead back to the index"
    for page in pages:
        for link in _local_links(page):
            assert (page.parent / link.split("#")[0]).resolve().exists(), f"{page.name}: {link} is broken"


def test_executed_pages_name_the_machine_and_show_outputs_and_images(book):
    out, _ = book
    first = (out / "notebooks" / "00_first.html").read_text()
    for page in (first, (out / "index.html").read_text()):
        header = re.search(r'<div class="book-machine".*?</div>', page, re.DOTALL).group(0)
        assert f"{os.cpu_count()} cores" in header and f"torch {torch.__version__}" in header
        assert build_book.cpu_model() in header
    assert "42" in first  # the cell ran
    assert "data:image/png;base64," in first  # the inline plot, kept
    assert "../figures/tiny_static.png" in first  # the markdown's own image


def test_widgets_become_their_static_image_or_a_note(book):
    out, _ = book
    page = (out / "notebooks" / "01_widget.html").read_text()
    assert page.count('src="../figures/tiny_static.png"') == 1  # the known widget
    assert "run this notebook in JupyterLab" in page  # the unknown one
    assert "IntSlider(value=0)" not in page and "widget-view" not in page


def test_a_markdown_page_is_rendered_with_its_table(book):
    out, _ = book
    page = (out / "pages" / "measurements.html").read_text()
    assert re.search(r"<table>.*<td>0.5</td>", page, re.DOTALL)
    assert "book-machine" not in page  # pasted tables keep their own machine labels


def test_widget_table_chooses_the_chapter_s_image():
    assert build_book.widget_figure("schedule_widget('1f1b')", "04", build_book.WIDGET_FIGURES) == "pipeline_animation"
    assert build_book.widget_figure("schedule_widget('interleaved')", "08",
                                    build_book.WIDGET_FIGURES) == "pipeline_schedules_ch08"
    assert build_book.widget_figure("print(1)", "04", build_book.WIDGET_FIGURES) is None
    for stem in set(build_book.WIDGET_FIGURES.values()):
        assert (ROOT / "figures" / f"{stem}.png").exists(), stem


def test_a_split_chapter_keeps_its_number():
    assert build_book.chapter_number(Path("notebooks/08a_interleaving.ipynb")) == "08"
    assert build_book.chapter_number(Path("notebooks/10_training_at_scale.ipynb")) == "10"
    assert build_book.chapter_number(Path("intro.ipynb")) == ""


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ipynb does not exist"):
        build_book.build_book([tmp_path / "nope.ipynb"], tmp_path / "book", machine={})


def test_make_lab_ships_jupyterlab_without_the_news_prompt():
    settings = ROOT / "jupyterlab-settings"
    overrides = json.loads((settings / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    makefile = (ROOT / "Makefile").read_text()
    lab = re.search(r"^lab:.*?(?=^\S)", makefile, re.MULTILINE | re.DOTALL).group(0)
    assert "--LabApp.app_settings_dir=$(CURDIR)/jupyterlab-settings" in lab
    jupyter = Path(sys.executable).parent / "jupyter"
    if jupyter.exists():  # the flag is one JupyterLab knows
        help_all = subprocess.run([str(jupyter), "lab", "--help-all"], capture_output=True, text=True, timeout=120)
        assert "--LabApp.app_settings_dir" in help_all.stdout

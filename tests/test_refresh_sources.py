"""helpers.tooling.refresh_sources: the outputs of `show_source` cells made again from the current code, and nothing
else in the notebook touched."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from helpers.display import show_source
from helpers.tooling import refresh_sources
from helpers.tooling.refresh_sources import NOTEBOOKS, refresh
from helpers.training import seed_everything


def shown_notebook(path: Path, markdown: str) -> None:
    """A recorded notebook: an import cell, a cell that shows `seed_everything` with `markdown` as its output."""
    cells = [nbformat.v4.new_code_cell("from helpers.display import show_source\nx = 1 / 0  # never runs"),
             nbformat.v4.new_code_cell("from helpers.training import seed_everything\n\nshow_source(seed_everything)"),
             nbformat.v4.new_markdown_cell("prose")]
    cells[1].outputs = [nbformat.v4.new_output("execute_result", execution_count=2, data={
        "text/markdown": markdown, "text/plain": "<IPython.core.display.Markdown object>"})]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


def test_a_stale_output_is_rewritten_from_the_current_code_and_nothing_else_changes(tmp_path):
    path = tmp_path / "99_lesson.ipynb"
    shown_notebook(path, "```python\ndef seed_everything(seed): ...\n```")
    before = json.loads(path.read_text())

    assert refresh(path, write=False) == [1] and json.loads(path.read_text()) == before, "a check writes nothing"
    assert refresh(path) == [1]

    after = json.loads(path.read_text())
    assert "".join(after["cells"][1]["outputs"][0]["data"]["text/markdown"]) == show_source(seed_everything).data
    after["cells"][1]["outputs"][0]["data"]["text/markdown"] = before["cells"][1]["outputs"][0]["data"]["text/markdown"]
    assert after == before, "only the shown source changed"
    assert refresh(path) == [], "refreshing a fresh notebook changes nothing"


def test_the_check_fails_on_a_stale_output_and_passes_on_a_fresh_one(tmp_path, capsys):
    path = tmp_path / "99_lesson.ipynb"
    shown_notebook(path, "stale")
    assert refresh_sources.main(["--check", str(path)]) == 1
    assert "99_lesson.ipynb: stale cell(s) 1" in capsys.readouterr().out
    assert refresh_sources.main([str(path)]) == 0 and refresh_sources.main(["--check", str(path)]) == 0


def test_a_show_source_cell_without_its_recorded_result_is_refused(tmp_path):
    path = tmp_path / "99_lesson.ipynb"
    shown_notebook(path, "stale")
    notebook = nbformat.read(path, as_version=4)
    notebook.cells[1].outputs = []
    nbformat.write(notebook, path)
    with pytest.raises(ValueError, match="has 0 results, not 1: record the lesson once"):
        refresh(path)


@pytest.mark.parametrize("notebook", sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_every_lesson_shows_the_code_as_it_is(notebook):
    stale = refresh(NOTEBOOKS / notebook, write=False)
    assert stale == [], f"{notebook}: cells {stale} show older code: run `make refresh-sources`, then commit"

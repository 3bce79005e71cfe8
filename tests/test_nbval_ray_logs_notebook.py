"""The nbval plugin for Ray's forwarded lines, run through nbval itself on a notebook."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from helpers.config import REPO_ROOT

pytestmark = pytest.mark.notebook  # runs nbval, a kernel


def _forwarding_notebook(expected: list[str] | None) -> nbformat.NotebookNode:
    """Three cells as nbval sees them in a lesson: the recording holds only the kernel's own output, and the run also
    prints lines as Ray forwards them: a benign one in the first cell, a worker's traceback in the last. `expected`:
    what the middle cell's metadata allows (an allowance also covers the cells after it)."""
    printer = 'import sys\nprint("(RayTrainWorker pid=7) {}", file=sys.stderr)\nprint("hello")'
    cells = [
        nbformat.v4.new_code_cell(printer.format("Moving model to device: cpu")),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell(printer.format("Traceback (most recent call last):")),
    ]
    for count, cell in enumerate(cells, start=1):
        cell.execution_count = count
        if "hello" in cell.source:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]
    if expected is not None:
        cells[1].metadata["testing"] = {"ray_errors_expected": expected, "ray_errors_because": "on purpose"}
    return nbformat.v4.new_notebook(cells=cells)


@pytest.mark.parametrize(("expected", "passes"), [(None, False), (["Traceback"], True), (["InjectedFailure"], False)])
def test_nbval_with_the_plugin_drops_ray_lines_and_fails_on_unexpected_errors(tmp_path, expected, passes):
    path = tmp_path / "forwarded.ipynb"
    nbformat.write(_forwarding_notebook(expected), path)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", "tests.plugins.nbval_ray",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", str(path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    # Cells 0 and 1 pass either way: the forwarded line leaves the comparison; only cell 2's error is at stake.
    assert ("3 passed" in run.stdout) == passes, run.stdout[-3000:]
    if not passes:
        assert "1 failed, 2 passed" in run.stdout and "Ray reported errors from other processes" in run.stdout
        assert "(RayTrainWorker pid=7) Traceback (most recent call last):" in run.stdout

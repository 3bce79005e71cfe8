"""Every lesson notebook follows the course frame and is committed with real outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")
SETUP_CELLS = ("from helpers import setup\n\ncfg = setup()", "from helpers import setup\n\ncfg = setup(start=False)")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_lessons_exist_in_order():
    assert [p.name for p in NOTEBOOKS][:2] == ["00_ray_core.ipynb", "01_single_gpu_pytorch.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_frame(path):
    cells = _cells(path)
    first = _source(cells[0])
    number = path.name[:2]
    assert re.match(rf"# {number} · \S", first), "title must be '# NN · Title'"
    for heading in ("**You will learn**", "**Runs on**", "The outputs below were recorded"):
        assert heading in first, f"the first cell needs {heading!r}"
    code = [_source(c) for c in cells if c["cell_type"] == "code"]
    # setup(start=False): lesson 07's kernel starts no Ray; it runs a cluster of separate processes instead.
    assert code[0].strip() in SETUP_CELLS, "the first code cell is the setup cell"
    markdown = "\n".join(_source(c) for c in cells if c["cell_type"] == "markdown")
    for section in ("## Exercises", "## What you learned", "**Next:**"):
        assert section in markdown, f"missing {section!r}"
    # Lesson 08 starts nothing in the kernel: its last cell deletes what its cluster commands created. Lesson 10's
    # kernel starts no Ray either: its last cell deletes the synthetic datasets its streaming runs wrote.
    cleanups = ("ray.shutdown()", "cluster.stop()", "kubectl delete", "remove_synthetic_images(")
    assert any(cleanup in code[-1] for cleanup in cleanups), "the last code cell cleans up what the notebook started"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_real_outputs_and_no_hacks(path):
    code = [c for c in _cells(path) if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "every code cell must carry a real execution"
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), "outputs must come from one top-to-bottom run"
    for cell in code:
        assert not any(o.get("output_type") == "error" for o in cell["outputs"]), "a committed cell failed"
        for hack in ("sys.path.insert", "sys.path.append", "%pip", "!pip"):
            assert hack not in _source(cell)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_nbval_marker_gives_a_visible_reason(path):
    for cell in _cells(path):
        lines = _source(cell).splitlines()
        for i, line in enumerate(lines):
            if line.strip().lstrip("#").strip() in MARKERS:
                reason = lines[i + 1].strip() if i + 1 < len(lines) else ""
                assert reason.startswith("# (") and len(reason) > 20, f"{line.strip()} needs a reason on the next line"
        assert not set(cell.get("metadata", {}).get("tags", [])) & {"nbval-skip", "nbval-ignore-output"}, (
            "use a visible comment marker with a reason, not a hidden tag")

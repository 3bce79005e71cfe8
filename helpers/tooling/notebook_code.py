"""deptry over the lessons' code as IPython runs it: each notebook's code cells with IPython's own syntax (`!cmd`,
`x = !cmd`, `%magic`, a `!` command continued on indented lines) turned into the calls IPython makes.

deptry parses a notebook's cells as plain Python and skips, with only a warning, a notebook it cannot parse (lesson
06's `dump = !py-spy ...`, lesson 07's multi-line `!ray job ...`): an import there would go unchecked.

    python -m helpers.tooling.notebook_code   # `make lint` runs it; exits with deptry's status
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from helpers.config import REPO_ROOT

#: deptry's rules for the lessons alone: DEP002 (a declared package unused) needs the whole project, which `deptry .`
#: scans; DEP001 (undeclared), DEP003 (transitive) and DEP004 (a package of the `test` extra only) hold for every lesson.
IGNORED_RULES = "DEP002"


def write_notebook_code(target: Path, notebooks: Path = REPO_ROOT / "notebooks") -> list[Path]:
    """Write each lesson's code cells, IPython's syntax transformed, to `target`/<lesson>.py; the files written."""
    import nbformat
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(notebooks.glob("*.ipynb")):
        cells = [transform(cell.source) for cell in nbformat.read(path, as_version=4).cells
                 if cell.cell_type == "code"]
        written.append(target / f"{path.stem}.py")
        written[-1].write_text("\n".join(cells), encoding="utf-8")
    return written


def check_notebooks(notebooks: Path = REPO_ROOT / "notebooks", capture: bool = False) -> subprocess.CompletedProcess:
    """Run deptry over the lessons' transformed code with the project's configuration; its completed process."""
    with tempfile.TemporaryDirectory(prefix="notebook-code-") as folder:  # outside the repository: not git-ignored
        write_notebook_code(Path(folder), notebooks)
        deptry = Path(sys.executable).with_name("deptry")
        return subprocess.run([str(deptry), folder, "--config", str(REPO_ROOT / "pyproject.toml"), "--ignore",
                               IGNORED_RULES, "--optional-dependencies-dev-groups", "test", *(["--no-ansi"] * capture)],
                              cwd=REPO_ROOT, capture_output=capture, text=True)


if __name__ == "__main__":
    sys.exit(check_notebooks().returncode)

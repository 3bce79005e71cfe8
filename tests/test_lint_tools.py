"""`make lint`'s deptry over the lessons as IPython runs them: a lesson plain Python cannot parse is checked too."""

from __future__ import annotations

from pathlib import Path

from helpers.tooling.notebook_code import check_notebooks, write_notebook_code
from tests.support import notebook


def test_ipython_syntax_becomes_the_calls_ipython_makes(tmp_path: Path) -> None:
    (tmp_path / "nb").mkdir()
    notebook(tmp_path / "nb" / "01_lesson.ipynb", "import os\ndump = !py-spy dump --pid {os.getpid()} --native",
             "!ray job submit \\\n    --working-dir . -- python x.py\n%time x = 1")
    (code,) = write_notebook_code(tmp_path / "code", tmp_path / "nb")
    assert code.name == "01_lesson.py"
    compile(code.read_text(), str(code), "exec")  # plain Python now
    assert "get_ipython().getoutput('py-spy dump --pid {os.getpid()} --native')" in code.read_text()


def test_an_undeclared_or_test_only_import_behind_ipython_syntax_fails_the_check(tmp_path: Path) -> None:
    # Each import follows a line plain Python cannot parse, which deptry alone would skip with a warning.
    (tmp_path / "nb").mkdir()
    notebook(tmp_path / "nb" / "06_lesson.ipynb", "dump = !echo hi\nimport course_missing_package", "import moto")
    done = check_notebooks(tmp_path / "nb", capture=True)
    assert done.returncode != 0
    assert "DEP001 'course_missing_package' imported but missing from the dependency definitions" in done.stderr
    assert "DEP004 'moto' imported but declared as a dev dependency" in done.stderr


def test_the_lessons_pass() -> None:
    done = check_notebooks(capture=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Scanning {len(list(Path('notebooks').glob('*.ipynb')))} files" in done.stdout + done.stderr

"""helpers/__init__.py opens with a map of which lesson imports which module: it must say what the lessons import."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager

import helpers
from helpers.config import REPO_ROOT

NOTEBOOKS = REPO_ROOT / "notebooks"
LESSONS = sorted(NOTEBOOKS.glob("*.ipynb")) + sorted(NOTEBOOKS.glob("*.py"))


def _map() -> dict[str, set[str]]:
    """The docstring's rows: a lesson's name at 4 spaces, its modules after it, continued on deeper-indented lines."""
    rows: dict[str, set[str]] = {}
    lesson = None
    for line in (helpers.__doc__ or "").splitlines():
        if row := re.fullmatch(r" {4}(\S+) {2,}(\S.*)", line):
            lesson, modules = row.groups()
            rows[lesson] = set()
        elif lesson is not None and re.fullmatch(r" {5,}\S.*", line):
            modules = line
        else:
            lesson = None
            continue
        rows[lesson] |= {name.strip() for name in modules.split(",") if name.strip()}
    return rows


def _code(path: Path) -> list[str]:
    """The lesson's code: a script's text, or each code cell of a notebook as Python (`!` and `%` lines turned into
    the calls IPython makes of them)."""
    if path.suffix == ".py":
        return [path.read_text()]
    cells = json.loads(path.read_text())["cells"]
    return [TransformerManager().transform_cell("".join(cell["source"])) for cell in cells
            if cell["cell_type"] == "code"]


def _is_module(name: str) -> bool:
    folder = REPO_ROOT / name.replace(".", "/")
    return folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """The modules of helpers the lesson imports, named below `helpers` ("cluster", "tooling.bench"); the names this
    package itself exports (`setup`) and `import helpers` count as none."""
    found = set()
    for code in _code(path):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "helpers":
                for alias in node.names:
                    module = f"{node.module}.{alias.name}"
                    found.add(module if _is_module(module) else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "helpers"}
    return {module.removeprefix("helpers.") for module in found} - {"helpers"}


def _row_name(path: Path) -> str:
    return path.stem if path.suffix == ".ipynb" else path.name


def test_the_map_has_one_row_per_lesson():
    assert set(_map()) == {_row_name(path) for path in LESSONS}


@pytest.mark.parametrize("path", LESSONS, ids=[path.name for path in LESSONS])
def test_the_map_lists_the_modules_the_lesson_imports(path):
    listed = _map().get(_row_name(path), set())
    imported = imported_modules(path)
    assert not imported - listed, f"{path.name} imports {sorted(imported - listed)}: add them to its row in " \
                                  "helpers/__init__.py's docstring"
    assert not listed - imported, f"{path.name} no longer imports {sorted(listed - imported)}: take them out of its " \
                                  "row in helpers/__init__.py's docstring"


def test_every_module_in_the_map_exists():
    for lesson, modules in _map().items():
        for module in modules:
            assert _is_module(f"helpers.{module}"), f"{lesson}'s row names helpers.{module}, which does not exist"

"""The code a lesson teaches is defined in a notebook cell the learner can edit; `helpers` keeps the copy that the
scripts and later lessons import. These tests fail when the two drift apart (d2l's `#@save`, checked instead of
extracted)."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

#: notebook -> the functions its cells define, each with the helpers module that keeps the copy.
LESSON_CODE = {
    "02_ray_train_ddp.ipynb": {"train_loop_per_worker": "helpers.ddp"},
    "03_ray_data_ingest.ipynb": {"train_loop_per_worker": "helpers.ingest"},
    "05_fault_tolerance.ipynb": {"train_loop_per_worker": "helpers.fault_tolerance"},
    "09_capstone_cifar10_vit.ipynb": dict.fromkeys(["train_epoch", "run_epoch", "report_epoch", "resume", "as_pairs",
                                                    "train_loop_per_worker_ray_data", "cifar10_datasets"],
                                                   "helpers.capstone"),
    "11_hyperparameter_search.ipynb": {"train_driver": "helpers.tuning"},
    "12_fsdp.ipynb": {"train_loop_per_worker": "helpers.sharding"},
}


def notebook_functions(notebook: Path) -> dict[str, list[str]]:
    """Every top-level function a notebook's code cells define: name -> its source, once per definition. A skeleton
    for the learner to fill in (a docstring and `...`) is not a definition."""
    found: dict[str, list[str]] = {}
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "code" or cell.source.lstrip().startswith(("%", "!")):
            continue
        lines = cell.source.splitlines()
        for node in ast.parse(cell.source).body:
            if isinstance(node, ast.FunctionDef) and not _skeleton(node):
                # whole lines: a comment after the last statement counts too
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                found.setdefault(node.name, []).append("\n".join(lines[first - 1:node.end_lineno]))
    return found


def _skeleton(node: ast.FunctionDef) -> bool:
    body = [statement for statement in node.body
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str))]
    return [ast.dump(statement) for statement in body] == [ast.dump(ast.Expr(ast.Constant(Ellipsis)))]


@pytest.mark.parametrize("notebook,name,module", [(notebook, name, module) for notebook, functions in
                                                  LESSON_CODE.items() for name, module in functions.items()])
def test_the_notebook_cell_and_the_helpers_copy_are_the_same_code(notebook, name, module):
    definitions = notebook_functions(NOTEBOOKS / notebook).get(name, [])
    assert len(definitions) == 1, f"{notebook} must define {name} in exactly one cell, found {len(definitions)}"
    helpers_copy = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name))).rstrip()
    assert definitions[0].rstrip() == helpers_copy, (
        f"{notebook}'s {name} differs from {module}.{name}: change both (the scripts and later lessons use "
        f"{module})")


def test_the_comparison_sees_a_changed_line(tmp_path):
    cell = nbformat.v4.new_code_cell("import x\n\n\ndef f(a):\n    return a + 1\n")
    notebook = nbformat.v4.new_notebook(cells=[cell])
    nbformat.write(notebook, tmp_path / "n.ipynb")
    assert notebook_functions(tmp_path / "n.ipynb") == {"f": ["def f(a):\n    return a + 1"]}


def test_a_skeleton_is_not_a_definition(tmp_path):
    cells = [nbformat.v4.new_code_cell('def f(a):\n    """Add one."""\n    ...\n'),
             nbformat.v4.new_code_cell("def f(a):\n    return a + 1\n")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "n.ipynb")
    assert notebook_functions(tmp_path / "n.ipynb") == {"f": ["def f(a):\n    return a + 1"]}

"""Ray's private APIs: the installed Ray has every one `helpers.tooling.ray_internals` relies on, and no other code of
the course uses one directly."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import nbformat
import ray

from helpers.config import REPO_ROOT
from helpers.tooling import ray_internals

#: A private Ray API: a module or attribute of Ray whose name starts with "_" (ray._private, ray._common, ray._raylet,
#: ray.data._internal, ray.train.v2._internal, ...), Ray's key-value store, its global node, its generated protobufs.
PRIVATE_RAY = re.compile(r"\bray(\.\w+)*\._(?!_)|internal_kv|_global_node|\bray\.core\.generated\b")
#: Where the course's code lives; ray_internals.py and this file are the two allowed to name private APIs.
ALLOWED = {Path(ray_internals.__file__).resolve(), Path(__file__).resolve()}


def code_lines(source: str) -> list[tuple[int, str]]:
    """The lines of Python `source` (1-based) with their comments removed; strings stay (they may hold code)."""
    lines = source.splitlines()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                row, col = token.start
                lines[row - 1] = lines[row - 1][:col]
    except (tokenize.TokenError, SyntaxError):  # not Python (a notebook's shell line): every line is checked
        lines = source.splitlines()
    return list(enumerate(lines, start=1))


def private_uses(path: Path) -> list[str]:
    """Every line of `path` (a .py file or a notebook's code cells) that uses a private Ray API: "file:line: code"."""
    name = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    if path.suffix == ".ipynb":
        cells = [(f"{name} cell {index}", cell.source)
                 for index, cell in enumerate(nbformat.read(path, as_version=4).cells) if cell.cell_type == "code"]
    else:
        cells = [(str(name), path.read_text())]
    return [f"{where}:{number}: {line.strip()}" for where, source in cells
            for number, line in code_lines(source) if PRIVATE_RAY.search(line)]


def course_files() -> list[Path]:
    """The course's code: helpers/, the scripts and notebooks, tests/ and the suite's conftest.py."""
    files = [*REPO_ROOT.glob("helpers/**/*.py"), *REPO_ROOT.glob("notebooks/*.py"),
             *REPO_ROOT.glob("notebooks/*.ipynb"), *REPO_ROOT.glob("tests/**/*.py"), REPO_ROOT / "conftest.py"]
    return sorted(path for path in files if path.resolve() not in ALLOWED)


def test_the_installed_ray_has_every_private_api_the_course_uses():
    missing = ray_internals.missing_private_apis()
    assert missing == [], (
        f"Ray {ray.__version__} lacks private APIs that helpers/tooling/ray_internals.py was written for (Ray 2.60.0): "
        f"{', '.join(missing)}. Find what replaced each one in this Ray, and change ray_internals.py only.")


def test_private_apis_lists_every_private_import_of_ray_internals():
    listed = {(module, attribute.split(".")[0]) for module, attribute in ray_internals.PRIVATE_APIS}
    modules = {module for module, _ in ray_internals.PRIVATE_APIS}
    unlisted = []
    for node in ast.walk(ast.parse(Path(ray_internals.__file__).read_text())):
        if isinstance(node, ast.ImportFrom):
            unlisted += [f"{node.module}.{alias.name}" for alias in node.names
                         if (PRIVATE_RAY.search(f"{node.module}.{alias.name}") or alias.name.startswith("_"))
                         and (node.module, alias.name) not in listed]
        elif isinstance(node, ast.Import):
            unlisted += [alias.name for alias in node.names
                         if PRIVATE_RAY.search(alias.name) and alias.name not in modules]
    assert unlisted == [], f"ray_internals.py imports these without listing them in PRIVATE_APIS: {unlisted}"


def test_no_code_but_ray_internals_uses_a_private_ray_api():
    uses = [use for path in course_files() for use in private_uses(path)]
    assert uses == [], ("Private Ray APIs used outside helpers/tooling/ray_internals.py; add a function there (with "
                        "the public API that is missing) and call it instead:\n" + "\n".join(uses))


def test_the_scan_sees_a_private_use(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('import ray\n# ray._private in a comment is no use\nnode = ray._private.worker._global_node\n'
                      'CODE = "from ray.experimental.internal_kv import _internal_kv_get"\nprint(ray.__version__)\n')
    assert private_uses(module) == [
        f"{module}:3: node = ray._private.worker._global_node",
        f'{module}:4: CODE = "from ray.experimental.internal_kv import _internal_kv_get"',
    ]
    notebook = tmp_path / "n.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("`ray._private` in prose is no use"),
        nbformat.v4.new_code_cell("!ray status\nfrom ray.data._internal.progress import logger"),
    ]), notebook)
    assert private_uses(notebook) == [f"{notebook} cell 1:2: from ray.data._internal.progress import logger"]


def test_the_report_logger_is_the_one_ray_train_logs_its_reports_with():
    from ray.train.v2._internal.execution import context

    assert context.logger.name == ray_internals.ray_train_report_logger()

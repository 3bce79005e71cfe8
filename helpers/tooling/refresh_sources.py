"""`make refresh-sources`: the outputs of the cells that show a helper's code (`show_source(...)`), made again from the
current code without running the lessons.

A lesson shows the code it teaches from `helpers` with `show_source(obj)`, and nbval compares that output like any
other: an edit to a shown function used to mean re-recording its whole lesson (15-60 minutes on a 2-core CPU). This
rewrites only those outputs, deterministically: each cell whose last statement is `show_source(<expression>)` gets
the Markdown `helpers.display.show_source` renders for the object the expression names, evaluated after the
notebook's own imports (no other code runs). Everything else in the notebook is left byte for byte.

    python -m helpers.tooling.refresh_sources [notebooks/NN_topic.ipynb ...]   # default: every lesson
    python -m helpers.tooling.refresh_sources --check                            # exit 1 if any output is stale
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

from helpers.config import REPO_ROOT
from helpers.display import show_source

NOTEBOOKS = REPO_ROOT / "notebooks"


def _shown_expression(source: str) -> ast.expr | None:
    """The argument of a cell's last statement when it is `show_source(<one argument>)`, else None."""
    try:
        body = ast.parse(source).body
    except SyntaxError:  # a cell of shell lines (`!ray ...`) or magics
        return None
    last = body[-1] if body else None
    if (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)
            and last.value.func.id == "show_source" and len(last.value.args) == 1 and not last.value.keywords):
        return last.value.args[0]
    return None


def _imports(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The names the notebook's `import` statements bind, in order (its other code does not run)."""
    namespace: dict[str, Any] = {}
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        try:
            body = ast.parse("".join(cell["source"]))
        except SyntaxError:
            continue
        statements: list[ast.stmt] = [node for node in body.body if isinstance(node, ast.Import | ast.ImportFrom)]
        if statements:
            exec(compile(ast.Module(body=statements, type_ignores=[]), "<imports>", "exec"), namespace)
    return namespace


def _lines(text: str) -> list[str]:
    """Text as a notebook file stores it: a list of lines, each but the last with its newline."""
    return text.splitlines(keepends=True)


def refresh(path: Path, write: bool = True) -> list[int]:
    """Rewrite the stale `show_source` outputs of the notebook at `path` (only report them with `write=False`);
    return the indices of the stale cells."""
    notebook = json.loads(path.read_text())
    namespace = _imports(notebook["cells"])
    changed = []
    for index, cell in enumerate(notebook["cells"]):
        expression = _shown_expression("".join(cell["source"])) if cell["cell_type"] == "code" else None
        if expression is None:
            continue
        shown = show_source(eval(compile(ast.Expression(expression), "<shown>", "eval"), dict(namespace)))
        results = [output for output in cell.get("outputs", []) if output.get("output_type") == "execute_result"]
        if len(results) != 1:
            raise ValueError(f"{path.name} cell {index}: show_source's cell has {len(results)} results, not 1: "
                             "record the lesson once (make record) before refreshing it")
        data = results[0]["data"]
        if "".join(data.get("text/markdown", [])) != shown.data:
            data["text/markdown"] = _lines(shown.data)
            changed.append(index)
    if changed and write:  # the layout nbformat writes: one-space indent, UTF-8 kept, a final newline
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.tooling.refresh_sources", description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/NN_*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when an output is stale")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    stale = 0
    for path in paths:
        changed = refresh(path, write=not args.check)
        if changed:
            stale += len(changed)
            print(f"{path.name}: {'stale' if args.check else 'refreshed'} cell(s) {', '.join(map(str, changed))}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

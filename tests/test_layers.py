"""The layers of helpers/ (pyproject.toml's import contract, `lint-imports` in `make lint`): every module is in one
layer, the contract holds, and it breaks on an import that runs back up, a lazy one inside a function included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _layers() -> list[set[str]]:
    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [contract["layers"] for contract in contracts if contract["id"] == "layers"]
    return [{name.strip() for name in layer.replace("|", ":").split(":")} for layer in layers]


def _modules() -> set[str]:
    """helpers' modules and packages below `helpers` and `helpers.tooling` (a package counts as one module)."""
    found = set()
    for package in ("helpers", "helpers.tooling"):
        folder = REPO_ROOT / package.replace(".", "/")
        for path in folder.iterdir():
            if path.name.startswith("_") or path.name == "tooling" and package == "helpers":
                continue
            if path.suffix == ".py" or (path / "__init__.py").is_file():
                found.add(f"{package}.{path.name.removesuffix('.py')}")
    return found


def test_every_module_of_helpers_is_in_exactly_one_layer():
    layers = _layers()
    named = [name for layer in layers for name in layer]
    assert len(named) == len(set(named)), "a module is named in two layers"
    assert set(named) == _modules(), "place each new module of helpers/ in a layer of pyproject.toml's contract"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    # The copy's helpers, not the installed one: PYTHONPATH comes before the editable install's path.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def copy_of_helpers(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(REPO_ROOT / "helpers", root / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", root)
    return root


def test_the_contract_holds():
    result = _lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "upward_import"), [
    # A lesson module importing a driver, at the top of the file.
    ("helpers/cluster.py", "from helpers.tooling import bench"),
    # The foundation importing a lesson module, lazily inside a function.
    ("helpers/tooling/ray_internals.py", "def _upward():\n    from helpers.cluster import plan_workers\n"),
])
def test_an_import_that_runs_back_up_breaks_the_contract(copy_of_helpers, module, upward_import):
    path = copy_of_helpers / module
    original = path.read_text()
    try:
        path.write_text(original + "\n\n" + upward_import + "\n")
        result = _lint_imports(copy_of_helpers)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    assert "0 kept, 1 broken" in result.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout

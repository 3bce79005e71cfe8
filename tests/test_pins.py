"""One source of truth for pins: environment.yml must install exactly what pyproject.toml pins."""

from __future__ import annotations

import tomllib

import yaml

from helpers.config import REPO_ROOT


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = [req for group in project.get("optional-dependencies", {}).values() for req in group]
    return set(project["dependencies"]) | set(extras)


def _environment_yml_pip() -> list[str]:
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip_sections = [item["pip"] for item in env["dependencies"] if isinstance(item, dict) and "pip" in item]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip: section"
    return pip_sections[0]


def test_environment_yml_matches_pyproject_pins():
    pip = _environment_yml_pip()
    assert "-e ." in pip, "environment.yml must install the helpers package itself"
    assert {req for req in pip if req != "-e ."} == _pyproject_requirements()


def test_every_dependency_is_pinned_exactly():
    for requirement in _pyproject_requirements():
        assert "==" in requirement, f"{requirement} is not pinned with =="


def test_the_apis_the_lessons_teach_are_pinned_to_the_course_versions():
    pins = _pyproject_requirements()
    assert {"ray[train,data,default]==2.60.0", "torch==2.14.1", "torchvision==0.29.1"} <= pins
    import ray
    import torch
    import torchvision

    assert (ray.__version__, torch.__version__.split("+")[0], torchvision.__version__.split("+")[0]) == (
        "2.60.0", "2.14.1", "0.29.1"), "the installed versions differ from the pins: run `make install`"


def test_importing_ray_does_not_build_the_rfc3987_grammar():
    # Every Ray worker process imports ray; with jsonschema >= 4.24 (plus JupyterLab's format extra)
    # that import builds rfc3987-syntax's Lark grammar: +2.7 s per process on a 2-core machine.
    import subprocess
    import sys

    loaded = subprocess.run(
        [sys.executable, "-c",
         "import sys, ray; print(sorted(m for m in sys.modules if m.startswith(('rfc3987', 'lark'))))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert loaded == "[]", f"`import ray` loads {loaded}: is jsonschema pinned as in pyproject.toml?"

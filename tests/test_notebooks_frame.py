"""Every lesson notebook follows the course frame and is committed with real outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT
from tests.plugins.nbval_ray import EXPECTED as RAY_ERRORS
from tests.plugins.nbval_ray import EXPECTED_BECAUSE as RAY_ERRORS_REASON
from tests.plugins.nbval_ray import TESTING

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
#: nbval's tags, each with the key of `metadata.testing` that must say why the cell carries it.
TAG_REASONS = {
    "nbval-ignore-output": "ignore_output_because",
    "nbval-skip": "skip_because",
    "raises-exception": "raises_because",
    "nbval-raises-exception": "raises_because",
}
#: Every key `metadata.testing` may hold; anything else is a typo that would silently do nothing.
TESTING_KEYS = {*TAG_REASONS.values(), RAY_ERRORS, RAY_ERRORS_REASON}
MIN_REASON = 10  # characters: a reason, not a placeholder
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


def _testing(cell: dict) -> dict:
    testing = cell.get("metadata", {}).get(TESTING, {})
    return testing if isinstance(testing, dict) else {}  # not an object: test_testing_metadata_holds_only_known_keys


def _is_reason(value) -> bool:
    return isinstance(value, str) and len(value.strip()) >= MIN_REASON


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_test_marker_in_the_code(path):
    # Learners read the code: nbval's markers and the course's own live in the cell's metadata instead.
    found = [
        f"{path.name} cell {index}: {line.strip()!r}"
        for index, cell in enumerate(_cells(path))
        if cell["cell_type"] == "code"
        for line in _source(cell).splitlines()
        if "nbval" in line.lower()
    ]
    assert not found, "move these markers into the cell's metadata (tags and metadata.testing):\n" + "\n".join(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_test_tag_gives_its_reason(path):
    problems = []
    for index, cell in enumerate(_cells(path)):
        tags = cell.get("metadata", {}).get("tags", [])
        testing = _testing(cell)
        for tag in tags:
            key = TAG_REASONS.get(tag)
            if key and not _is_reason(testing.get(key)):
                problems.append(
                    f"{path.name} cell {index}: tag {tag!r} needs metadata.testing.{key}, "
                    f'a reason of at least {MIN_REASON} characters (e.g. "timings differ from run to run")'
                )
        for key in set(TAG_REASONS.values()) & set(testing):
            if not any(TAG_REASONS.get(tag) == key for tag in tags):
                wanted = " or ".join(repr(tag) for tag, k in TAG_REASONS.items() if k == key)
                problems.append(f"{path.name} cell {index}: metadata.testing.{key} without the tag {wanted}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_expected_ray_errors_are_regexes_with_a_reason(path):
    problems = []
    for index, cell in enumerate(_cells(path)):
        testing = _testing(cell)
        if RAY_ERRORS not in testing and RAY_ERRORS_REASON not in testing:
            continue
        where = f"{path.name} cell {index}"
        patterns = testing.get(RAY_ERRORS)
        if not (isinstance(patterns, list) and patterns and all(isinstance(p, str) and p for p in patterns)):
            problems.append(f"{where}: metadata.testing.{RAY_ERRORS} must be a non-empty list of regex strings")
        else:
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as error:
                    problems.append(f"{where}: metadata.testing.{RAY_ERRORS} holds {pattern!r}, not a regex: {error}")
        if not _is_reason(testing.get(RAY_ERRORS_REASON)):
            problems.append(
                f"{where}: metadata.testing.{RAY_ERRORS} needs metadata.testing.{RAY_ERRORS_REASON}, "
                f'a reason of at least {MIN_REASON} characters (e.g. "the failure is injected on purpose")'
            )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_testing_metadata_holds_only_known_keys(path):
    problems = []
    for index, cell in enumerate(_cells(path)):
        testing = cell.get("metadata", {}).get(TESTING)
        if testing is None:
            continue
        if not isinstance(testing, dict):
            problems.append(f"{path.name} cell {index}: metadata.testing must be an object")
            continue
        known = ", ".join(sorted(TESTING_KEYS))
        for key in sorted(set(testing) - TESTING_KEYS):
            problems.append(f"{path.name} cell {index}: unknown key metadata.testing.{key} (known: {known})")
    assert not problems, "\n".join(problems)


#: A check call of helpers.exercises: `check("2", ...)`; or of helpers.capstone: a step's `check_step("2", ...)`,
#: and the lesson's run and job, `check_run(...)` and `check_job(...)`.
CHECK_CALL = re.compile(r"\bcheck(?:_step)?\(\s*[\"']([^\"']+)[\"']|\bcheck_(run|job)\(")


def _check_names(source: str) -> list[str]:
    """The exercises, steps or capstone stages whose checks `source` calls."""
    return [exercise or stage for exercise, stage in CHECK_CALL.findall(source)]


def exercise_problems(cells: list[dict]) -> list[str]:
    """What is wrong with a notebook's exercises (helpers.exercises, helpers.capstone): every solution cell is
    collapsed, its source and its output (which gives the answer away), ends with a strict check (or is the first
    part of a solution whose next cell does), and follows a check of the same exercise that the learner runs first."""
    problems, checked = [], set()
    code_cells = [(index, cell) for index, cell in enumerate(cells) if cell["cell_type"] == "code"]
    for position, (index, cell) in enumerate(code_cells):
        source = _source(cell)
        calls = _check_names(source)
        if "solution" not in cell.get("metadata", {}).get("tags", []):
            checked.update(calls)
            continue
        if not cell["metadata"].get("jupyter", {}).get("source_hidden"):
            problems.append(f"cell {index}: a solution is collapsed (metadata jupyter.source_hidden: true)")
        if not cell["metadata"].get("jupyter", {}).get("outputs_hidden"):
            problems.append(f"cell {index}: a solution's output is collapsed (metadata jupyter.outputs_hidden: true)")
        following = code_cells[position + 1][1] if position + 1 < len(code_cells) else None
        continued = (not calls and following is not None and "solution" in following["metadata"].get("tags", [])
                     and CHECK_CALL.search(_source(following)) and "strict=True" in _source(following))
        if not continued and (not calls or "strict=True" not in source):
            problems.append(f"cell {index}: a solution ends with its exercise's check(..., strict=True)")
        problems += [f"cell {index}: exercise {name}'s solution comes before the learner's check(\"{name}\", ...)"
                     for name in calls if name not in checked]
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_exercise_solutions_are_collapsed_and_prove_their_check(path):
    assert exercise_problems(_cells(path)) == [], path.name


def test_the_exercise_rule_finds_each_mistake():
    def code(source: str, solution: bool = False, hidden: bool = True) -> dict:
        collapsed = {"outputs_hidden": hidden, "source_hidden": hidden}
        metadata = {"tags": ["solution"], "jupyter": collapsed} if solution else {}
        return {"cell_type": "code", "source": source, "metadata": metadata}

    learner, check = code("answer = ..."), code('check("1", {"x": lambda: answer == 1})')
    solution = code('answer = 1\ncheck("1", {"x": lambda: answer == 1}, strict=True)', solution=True)
    assert exercise_problems([learner, check, solution]) == []
    assert "collapsed" in exercise_problems([check, {**solution, "metadata": {"tags": ["solution"]}}])[0]
    shown_output = {**solution, "metadata": {"tags": ["solution"], "jupyter": {"source_hidden": True}}}
    assert exercise_problems([learner, check, shown_output]) == [
        "cell 2: a solution's output is collapsed (metadata jupyter.outputs_hidden: true)"]
    assert "strict=True" in exercise_problems([check, code('check("1", {})', solution=True)])[0]
    assert "comes before" in exercise_problems([solution, check])[0]
    first_part = code("def helper(): return 1", solution=True)
    assert exercise_problems([learner, check, first_part, solution]) == []  # a solution in two cells
    assert "strict=True" in exercise_problems([learner, check, solution, first_part])[0]  # a part with no check after
    assert _check_names('check_step("2", loop, config)\ncheck_run(scaling_config, run_config)') == ["2", "run"]

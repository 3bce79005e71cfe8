"""Each lesson's exercise checks, run on the mistake the exercise targets: the check must say "not yet" and name
what does not hold. The check cell is taken from the notebook as the learner runs it; the answer is fed in as the
values the learner's cell would leave behind."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest

from helpers.exercises import check, expect_equal

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def run_check_cell(notebook: str, defines: str, answer: dict[str, Any], capsys) -> dict[str, bool]:
    """Run the one cell of `notebook` that defines `defines` (`exercise_1 = {`) in the namespace `answer` (it keeps
    what the cell defines), and return what its check printed: each expectation -> whether it held."""
    cells = [cell.source for cell in nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
             if cell.cell_type == "code" and f"{defines} = " in cell.source and "check(" in cell.source]
    assert len(cells) == 1, f"{notebook}: {len(cells)} cells define {defines}"
    answer.setdefault("check", check)
    answer.setdefault("expect_equal", expect_equal)
    exec(cells[0], answer)
    lines = capsys.readouterr().out.splitlines()
    expectations = [line[len("  - "):] for line in lines[1:] if line.startswith("  - ")]
    if lines[0].startswith("✓"):
        return dict.fromkeys(expectations, True)
    assert lines[0].startswith("✗"), lines
    return {line: False for line in expectations}  # a "not yet" lists only what does not hold


def failed(results: dict[str, bool]) -> list[str]:
    return [what for what, held in results.items() if not held]


# ---- 00 · exercise 1: results one at a time, as they finish (ray.wait), not in submission order (ray.get) ---------

NAPS_BY_GET = [3.0] + [0.25] * 7  # ray.get(refs): the submission order
NAPS_BY_WAIT = [0.25] * 7 + [3.0]  # ray.wait(..., num_returns=1) in a loop, on 2 CPUs or more


@pytest.mark.parametrize("as_finished,elapsed_s,wrong", [
    (NAPS_BY_WAIT, 3.1, []),
    (NAPS_BY_GET, 3.1, ["they arrived as they finished"]),  # ray.get on the list, or ray.wait(num_returns=8)
    ([0.25] * 7 + [3.0], 4.9, ["the naps ran"]),  # one after the other: sequential calls in a loop
])
def test_lesson_00_exercise_1_fails_on_results_taken_in_submission_order(capsys, as_finished, elapsed_s, wrong):
    results = run_check_cell("00_ray_core.ipynb", "exercise_1",
                             {"as_finished": as_finished, "elapsed_s": elapsed_s, "num_cpus": 2}, capsys)
    assert [what.split(":")[0].split(" (")[0] for what in failed(results)] == wrong, results


# ---- 07 · exercise 3: the token must not reach curl's arguments, where `ps` shows them ----------------------------

@pytest.mark.parametrize("answer,token_seen", [
    ('f"curl --silent --fail -H @{header_file} {api_url}"', False),  # the solution: curl reads the file
    ('f"curl --silent --fail -H \\"$(cat {header_file})\\" {api_url}"', True),  # the shell puts the token in argv
    ('f"curl -H \\"Authorization: Bearer $(cat {header_file} | cut -d\' \' -f3)\\" {api_url}"', True),
])
def test_lesson_07_exercise_3_fails_when_the_token_reaches_curls_command_line(tmp_path, capsys, answer, token_seen):
    """`-H "$(cat file)"` never shows the token in the command the learner writes, but the shell expands it into
    curl's arguments."""
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef\n")
    namespace: dict[str, Any] = {"Path": Path, "cluster": SimpleNamespace(token_file=token_file),
                                 "api": "http://127.0.0.1:9/api/jobs/"}  # nothing listens there: not asserted
    exec(f"def curl_command(api_url, header_file):\n    return {answer}\n", namespace)
    results = run_check_cell("07_ray_jobs.ipynb", "exercise_3", namespace, capsys)
    shutil.rmtree(namespace["header_file"].parent)  # the cell made it, as in the lesson
    token_check = [what for what in failed(results) if what.startswith("the token is not in curl's arguments")]
    assert bool(token_check) == token_seen, results


# ---- 11 · exercise 1: a trial's workers each fit on one node; the cluster's total CPUs over-count ---------------

def trials_at_once_per_node(node_cpus: list[float], workers_per_trial: int, cpus_per_worker: float) -> int:
    return sum(int(cpus // cpus_per_worker) for cpus in node_cpus) // workers_per_trial


def trials_at_once_cluster_total(node_cpus: list[float], workers_per_trial: int, cpus_per_worker: float) -> int:
    return int(sum(node_cpus) // cpus_per_worker) // workers_per_trial  # as if a worker could span nodes


@pytest.mark.parametrize("answer,passes", [(trials_at_once_per_node, True), (trials_at_once_cluster_total, False)])
def test_lesson_11_exercise_1_fails_on_the_cluster_total(capsys, answer, passes):
    from ray.train import ScalingConfig  # the lesson's earlier cells import it

    results = run_check_cell("11_hyperparameter_search.ipynb", "exercise_1",
                             {"trials_at_once": answer, "ScalingConfig": ScalingConfig}, capsys)
    assert all(results.values()) == passes, results
    if not passes:  # ([3, 3], 1, 2): 3 trials by the total, 2 by whole workers per node
        assert failed(results)[0].endswith("(AssertionError: got [2, 2, 1, 5, 1, 3])"), results

"""What several test modules share that is not a fixture: bounds on wall-clock time, the environment of a driver
that joins a test's own cluster, and checks that a test's own processes are gone; and the helpers that a module's
fast tests and its `_ray` or `_notebook` module both use. (Test modules import from here, never from each other.)

Every process check here looks only at the processes of the test's own cluster or session: processes it listed
before they stopped, or processes whose command line names its own temp dir or GCS address. Another test session
on the same machine, or a learner's Ray beside the suite, is never looked at.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import psutil

from helpers.cluster import Capacity, plan_workers
from helpers.config import REPO_ROOT, load_config
from helpers.exercises import check, expect_equal
from helpers.system import free_ports
from helpers.tooling.local_cluster import LocalCluster

#: The bound on "fails fast": a check that refuses, or reports an error, without waiting for anything slow. The slow
#: paths these tests guard against take longer: a download's time-outs and retries (minutes), a run that waits for
#: resources that never come (Ray Train's 60 s worker-group time-out, or forever), a Ray Train fit (20-30 s from its
#: start to its first report on the 2-core CI machine). The checks themselves take well under 1 s on an idle
#: machine; the bound is that generous so that a machine shared with another test run, or with a learner's training,
#: does not fail them. One bound for all: a test whose own limit is the behaviour under test names that limit.
FAILS_FAST_S = 20.0

#: The same for a process that starts a local Ray first and then refuses its run: Ray's start-up (about 15 s here, up
#: to 60 s with three started side by side on a loaded 2-core machine) plus the check. Without the check, such a run
#: would wait for its resources without end.
RAY_START_THEN_FAILS_S = 120.0

#: The Ray variables that send a driver to a cluster: a test's driver starts without them, then gets its own cluster's.
RAY_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without any Ray address or token setting, plus `variables`."""
    env = {name: value for name, value in os.environ.items() if name not in RAY_VARS}
    return {**env, **variables}


def running(proc: psutil.Process) -> bool:
    """Whether `proc` still runs; a zombie does not."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running_processes_naming(temp_dir: Path, address: str) -> list[str]:
    """Command lines of the running processes that name this cluster's `temp_dir` or GCS `address` (whole: not
    another cluster's /tmp/rc-abc1 for /tmp/rc-abc, nor port 63790 for 6379)."""
    marks = [re.escape(str(temp_dir)) + r"(?![\w.-])", r"(?<![\w.])" + re.escape(address) + r"(?!\d)"]
    names_cluster = re.compile("|".join(marks))
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] != psutil.STATUS_ZOMBIE and names_cluster.search(cmdline):
            found.append(cmdline[:160])
    return found


def assert_stopped(processes: list[psutil.Process], temp_dir: Path, address: str) -> None:
    """Nothing of a stopped cluster is left: none of its `processes` (listed before stop(): they include the agents,
    workers and job drivers, which name neither its temp dir nor its address), no process naming its temp dir or GCS
    address, and no temp dir."""
    assert processes, "the cluster had no processes to stop"
    assert [proc for proc in processes if running(proc)] == []
    assert running_processes_naming(temp_dir, address) == []
    assert not temp_dir.exists()


@contextlib.contextmanager
def stopped_after(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Start `cluster`, yield it, and afterwards stop it and check that nothing of it is left (`assert_stopped`): its
    processes, listed just before it stops, include the drivers of jobs still running (children of its workers)."""
    cluster.start()
    temp_dir, address = cluster.temp_dir, cluster.address
    assert temp_dir is not None
    try:
        yield cluster
    finally:
        processes = cluster.processes()
        cluster.stop()
    assert_stopped(processes, temp_dir, address)


# --- Helpers of a module's fast tests and of its `_ray` or `_notebook` module -------------------------------------

#: test_cluster: a laptop of 2 CPUs, as helpers.cluster sees it.
LAPTOP = Capacity([{"CPU": 2.0, "memory": 1e10}])


def plan(capacity: Capacity, **variables: str):
    """test_cluster: the workers `plan_workers` plans on `capacity` for the configuration `variables` make."""
    return plan_workers(load_config(variables), capacity=capacity)


def notebook(path: Path, *cells: str) -> None:
    """test_gpu_lane: write a notebook of these code cells to `path`."""
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells]), path)


def lab_recipe() -> str:
    """test_lab: the command of the Makefile's `lab` recipe."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    return re.search(r"^lab:.*\n\t(.+)$", makefile, flags=re.M).group(1)


def record(ray_tmpdir: Path, address: str) -> Path:
    """Write `address` where `ray start` records its cluster under `ray_tmpdir`; return the file."""
    file = ray_tmpdir / "ray" / "ray_current_cluster"
    file.write_text(address)
    return file


def dead_address() -> str:
    """127.0.0.1 and a port that was free a moment ago: nothing listens there."""
    return f"127.0.0.1:{free_ports(host='127.0.0.1')[0]}"


def passed_over_line(file: Path, address: str, why: str) -> str:
    """The one line `start_ray` prints when it passes over the dead cluster at `address` recorded in `file`."""
    return (f"Ray: {file} names the cluster {address}, which does not answer ({why}), so a local Ray starts instead. "
            f"That file is left over from a Ray that ended without `ray stop`: delete it (rm {file}), or set "
            "RAY_ADDRESS=local to always start a local Ray (`ray stop` deletes it too, but stops every Ray on this "
            "machine).")


#: test_streaming: a synthetic dataset of 2 MiB, 168 images.
TINY_GB = 0.002


# --- Exercise checks: a lesson's check cell run on an answer (tests/test_exercise_checks*.py, tests/test_jobs.py) ---

#: The lessons.
NOTEBOOKS = REPO_ROOT / "notebooks"


def lesson_cell(notebook: str, *markers: str) -> str:
    """The one code cell of lesson `notebook` whose source has every one of `markers`, as the learner runs it."""
    cells = [cell.source for cell in nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
             if cell.cell_type == "code" and all(marker in cell.source for marker in markers)]
    assert len(cells) == 1, f"{notebook}: {len(cells)} cells have {markers}"
    return cells[0]


def run_check_cell(notebook: str, defines: str, answer: dict[str, Any], capsys) -> dict[str, bool]:
    """Run the one cell of `notebook` that defines `defines` (`exercise_1 = {`) in the namespace `answer` (it keeps
    what the cell defines), and return what its check printed: each expectation -> whether it held."""
    return run_check_source(lesson_cell(notebook, f"{defines} = ", "check("), answer, capsys)


def exercise_check_cell(notebook: str, number: str) -> str:
    """The one code cell of lesson `notebook` that checks exercise `number` (`check("2", ...`), not its solution."""
    cells = [cell.source for cell in nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
             if cell.cell_type == "code" and f'check("{number}"' in cell.source
             and "solution" not in cell.metadata.get("tags", [])]
    assert len(cells) == 1, f"{notebook}: {len(cells)} cells check exercise {number}"
    return cells[0]


def run_check_source(source: str, answer: dict[str, Any], capsys) -> dict[str, bool]:
    """Run a lesson's check cell `source` in the namespace `answer`, and return what its check printed: each
    expectation -> whether it held."""
    answer.setdefault("check", check)
    answer.setdefault("expect_equal", expect_equal)
    exec(source, answer)
    lines = capsys.readouterr().out.splitlines()
    expectations = [line[len("  - "):] for line in lines[1:] if line.startswith("  - ")]
    if lines[0].startswith("✓"):
        return dict.fromkeys(expectations, True)
    assert lines[0].startswith("✗"), lines
    return {line: False for line in expectations}  # a "not yet" lists only what does not hold


def failed(results: dict[str, bool]) -> list[str]:
    return [what for what, held in results.items() if not held]


# --- A finished Ray Train run's folder, written without Ray (tests/test_exercise_checks.py, tests/test_tuning.py) ---

def write_run_folder(folder: Path, reports: list[tuple[str, dict[str, Any]]], on_disk: list[int],
                     history: bool) -> None:
    """A finished run's folder as Ray Train 2.60 leaves it: a folder per checkpoint still on disk, and its snapshot
    (checkpoint_manager_snapshot.json, the one `Result.from_path` reads) listing them by test_acc, worst first, and
    the last report's as the latest. The lesson's recorded folders have this layout; Ray Train's controller writes
    it, with Ray running, so here it is written from the same fields. With `history`, the course's MetricsHistory
    records every report, as the lesson's run does (exercise 1's has no callback)."""
    import json

    import ray
    from ray.train import Checkpoint

    from helpers.results import MetricsHistory

    folder.mkdir(parents=True)
    for index in on_disk:
        (folder / reports[index][0]).mkdir()
        (folder / reports[index][0] / "score.txt").write_text(str(reports[index][1]["test_acc"]))
    by_score = sorted(on_disk, key=lambda index: reports[index][1]["test_acc"])

    def state(index: int) -> dict[str, Any]:
        return {"version": 0, "checkpoint_dir_name": reports[index][0], "metrics": reports[index][1]}

    (folder / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "ray_version": ray.__version__, "checkpoint_results": [state(index) for index in by_score],
        "checkpoint_report_indices": by_score, "latest_checkpoint_result": state(len(reports) - 1),
        "pending_training_results": [], "pending_validation_specs": [], "current_report_index": len(reports),
        "validated_checkpoint_dir_names": [], "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": []}))
    if history:
        run_config = SimpleNamespace(storage_path=str(folder.parent), name=folder.name)
        run_context = SimpleNamespace(get_run_config=lambda: run_config)  # what the controller passes callbacks
        for name, metrics in reports:
            MetricsHistory().after_report(run_context, [metrics], Checkpoint(str(folder / name)))

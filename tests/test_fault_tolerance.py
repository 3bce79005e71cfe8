"""helpers.fault_tolerance without Ray: with_failure refuses a failure that a run could not recover from or never
reach; section 07's timeline reads the controller's decisions from its log; a spot node's end touches only its own
processes.

Lesson 05's claims, on real runs: tests/test_fault_tolerance_ray.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from helpers.config import REPO_ROOT
from helpers.fault_tolerance import (
    _end_processes,
    controller_decisions,
    train_loop_per_worker,
    with_failure,
)
from helpers.system import wait_until
from helpers.tooling import ray_internals


@pytest.mark.parametrize("epoch,step,rank", [(0, 2, 1), (1, -1, 1), (1, 2, -1)])
def test_with_failure_refuses_a_failure_it_could_not_recover_from_or_never_reach(epoch, step, rank):
    # A failure in epoch 0 comes before any checkpoint: the restarted attempt would start fresh and fail again.
    with pytest.raises(ValueError, match="with_failure needs epoch >= 1"):
        with_failure(train_loop_per_worker, epoch=epoch, step=step, rank=rank)


def _controller_record(asctime: str, level: str, message: str, run_name: str = "05_elastic-run-1") -> str:
    """One line of Ray Train's controller log (Ray 2.60 writes JSON lines, DEBUG included)."""
    return json.dumps({"asctime": asctime, "levelname": level, "message": message, "run_name": run_name,
                       "filename": "elastic.py", "lineno": 1})


def test_controller_decisions_reads_the_run_s_decisions_once_each(tmp_path, monkeypatch):
    timeout = ("The worker group startup timed out after 20.0 seconds waiting for 2 workers. Potential causes "
               "include: ...")
    lines = [
        _controller_record("2026-11-29 08:41:57,606", "INFO", "Detected ready resources for 1 workers in the cluster. "
                           "Deciding to start/restart training with this worker group size."),
        _controller_record("2026-11-29 08:41:58,000", "DEBUG", "Skipping resize decision due to ..."),
        _controller_record("2026-11-29 08:42:08,834", "INFO", "Started training worker group of size 1: \n- (ip=...)"),
        _controller_record("2026-11-29 08:42:09,000", "INFO", "Started training worker group of size 2:",
                           run_name="another-run"),
        "Traceback (most recent call last):",
        _controller_record("2026-11-29 08:43:02,038", "INFO", "Detected changes in the cluster resources. Deciding to "
                           "resize the worker group from 1 -> 2 workers."),
        _controller_record("2026-11-29 08:43:33,077", "INFO", "[FailurePolicy] RETRY\n  Source: worker group\n  "
                           "Error count: 1 (max allowed: 1)\nError: Training failed due to worker errors: ..."),
        _controller_record("2026-11-29 08:43:53,122", "ERROR", f"Error in control loop iteration: {timeout}"),
        # The retry quotes the error: one row for it, not a second "not placed" row.
        _controller_record("2026-11-29 08:43:53,125", "INFO", "[FailurePolicy] RETRY\n  Source: controller\n  Error "
                           f"count: 1 (max allowed: inf)\nError: Training failed due to controller error:\n{timeout}"),
    ]
    (tmp_path / "ray-train-sys-controller-abc.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "ray-train-app-controller-abc.log").write_text("not read\n")
    monkeypatch.setattr(ray_internals, "train_log_dir", lambda: str(tmp_path))

    rows = controller_decisions("05_elastic-run-1")

    assert [row["event"] for row in rows] == [
        "controller: (re)start with 1",
        "controller: group of 1 started",
        "controller: resize 1 -> 2",
        "controller: worker group failure 1 of 1 allowed -> RETRY",
        "controller: group of 2 not placed in 20.0 s",
        "controller: controller failure 1 of inf allowed -> RETRY",
    ]
    assert rows[2]["time"] - rows[0]["time"] == pytest.approx(64.432)


def test_end_processes_ends_only_the_node_s_processes_and_deletes_its_folder(tmp_path):
    node_dir = tmp_path / "spot-node"
    node_dir.mkdir()
    # A "raylet" naming the node's folder, with a child that does not (as Ray's workers and agents do not)...
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                               "time.sleep(120)", str(node_dir)])
    # ...and a process of another node, on the same machine.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(tmp_path / "spot-other")])
    try:
        wait_until(lambda: psutil.Process(parent.pid).children(), 30, 0.1, what="the child process")
        child = psutil.Process(parent.pid).children()[0]

        _end_processes(node_dir)

        assert parent.wait(timeout=5) is not None
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None, "a process of another node was ended"
        assert not node_dir.exists()
    finally:
        for proc in (parent, other):
            proc.kill()
            proc.wait()


def test_spot_nodes_needs_ray_started_first():
    # In a process of its own: the suite's shared Ray may already run in this one (tests/plugins).
    done = subprocess.run([sys.executable, "-c", "from helpers.fault_tolerance import SpotNodes; SpotNodes()"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 1, done
    assert "RuntimeError: SpotNodes joins this driver's Ray: call setup() (or ray.init()) first." in done.stderr

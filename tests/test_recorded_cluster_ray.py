"""setup() and a script beside a dead recorded cluster start a local Ray and say so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT
from helpers.session import PREEMPTION_WATCHER_VAR
from tests.support import RAY_START_THEN_FAILS_S, dead_address, passed_over_line, record

pytestmark = pytest.mark.ray  # each test starts a local Ray in a subprocess


#: setup() as a notebook's first cell runs it, then what it decided (the course's settings in the environment).
SETUP_DRIVER = f"""
import os
from helpers import setup

cfg = setup()
print("ray_address:", cfg.ray_address, "preemption watcher:", os.environ.get({PREEMPTION_WATCHER_VAR!r}))
"""
#: The cheapest run of a course script that starts Ray: it refuses 64 workers once it has seen the cluster.
SCRIPT = [str(REPO_ROOT / "notebooks" / "train_ray_ddp.py"), "--num-workers", "64", "--smoke-test"]
#: The most a run may take: tests.support's bound for a process that starts Ray and then refuses (or, for setup(),
#: gets going). Without the check, both would wait for the dead cluster without end.
BOUND_S = RAY_START_THEN_FAILS_S


@pytest.fixture(scope="module")
def runs_beside_a_dead_cluster(tmp_path_factory) -> Iterator[dict]:
    """setup() and a script, side by side, each in its own process with a dead cluster recorded in its RAY_TMPDIR:
    their outcome and wall time, the recorded file and the dead address."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    (folder / "ray").mkdir()
    address = dead_address()
    file = record(folder, address)
    env = {name: value for name, value in os.environ.items() if name not in ("RAY_ADDRESS", PREEMPTION_WATCHER_VAR)}
    env.update(RAY_TMPDIR=str(folder), PYTHONUNBUFFERED="1")
    commands = {"setup": ["-c", SETUP_DRIVER],
                "script": [*SCRIPT, "--storage-path", str(tmp_path_factory.mktemp("storage"))]}
    started = time.monotonic()
    runs = {name: subprocess.Popen([sys.executable, *args], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name, args in commands.items()}
    done = {}
    try:
        for name, run in runs.items():
            try:
                stdout, stderr = run.communicate(timeout=max(1.0, started + BOUND_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                run.kill()  # the hang this module is about: its output so far goes into the failure
                stdout, stderr = run.communicate()
            done[name] = (subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr),
                          time.monotonic() - started)
        yield {"runs": done, "file": file, "address": address}
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_setup_beside_a_dead_recorded_cluster_starts_a_local_ray_and_says_so(runs_beside_a_dead_cluster):
    found = runs_beside_a_dead_cluster
    done, wall_s = found["runs"]["setup"]
    assert done.returncode == 0, f"after {wall_s:.0f} s:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert wall_s < BOUND_S
    lines = done.stdout.splitlines()
    assert lines[0] == passed_over_line(found["file"], found["address"], "connection refused")
    assert any(line.startswith("Ray          : ") and ", started a local Ray in " in line for line in lines), lines
    # A local Ray, as without the file: Ray Train's preemption watcher off, cfg.ray_address None.
    assert lines[-1] == "ray_address: None preemption watcher: 0"
    assert found["file"].read_text() == found["address"]


def test_a_script_beside_a_dead_recorded_cluster_starts_a_local_ray_and_says_so(runs_beside_a_dead_cluster):
    found = runs_beside_a_dead_cluster
    done, wall_s = found["runs"]["script"]
    assert wall_s < BOUND_S, f"after {wall_s:.0f} s:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.splitlines()[0] == passed_over_line(found["file"], found["address"], "connection refused")
    # It got as far as asking the local Ray for 64 workers, and refused them with the course's error.
    assert done.returncode != 0 and "error: This run can never start: it asks for 64 workers" in done.stderr
    assert "Traceback" not in done.stderr

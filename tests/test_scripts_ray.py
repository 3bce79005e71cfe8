"""The course's scripts in smoke mode, refusing what they cannot run with the course's own errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.config import REPO_ROOT
from tests.support import RAY_START_THEN_FAILS_S

pytestmark = pytest.mark.ray  # the scripts start Ray


SCRIPT = REPO_ROOT / "notebooks" / "train_ray_ddp.py"


#: Requests the script must refuse before training, each with the course's error. Each run starts its own local Ray
#: (about 15 s here), so the module starts them all at once.
REFUSED = {
    "gpu": ["--use-gpu", "--smoke-test"],
    "64 workers": ["--num-workers", "64", "--smoke-test"],
    "unwritable storage": ["--num-workers", "1", "--smoke-test", "--storage-path", "/dev/null/runs"],
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Each of REFUSED's runs of the script, run side by side: its outcome and its wall time in seconds."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started, runs = time.monotonic(), {}
    for name, args in REFUSED.items():
        if "--storage-path" not in args:
            args = [*args, "--storage-path", str(tmp_path_factory.mktemp("storage"))]
        runs[name] = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    done = {}
    for name, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr), time.monotonic() - started
    return done


def test_use_gpu_on_a_machine_without_gpus_says_what_to_change(refused):
    done, wall_s = refused["gpu"]
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "error: GPUs were asked for (COURSE_USE_GPU=true, or a script's --use-gpu), but the Ray cluster has no " \
           "GPU" in done.stderr
    assert wall_s < RAY_START_THEN_FAILS_S  # Ray's start-up (three at once) included; the check is instant


def test_train_ray_ddp_refuses_an_impossible_request_with_the_courses_error(refused):
    done, wall_s = refused["64 workers"]
    assert done.returncode != 0
    assert "error: This run can never start: it asks for 64 workers" in done.stderr
    assert "Traceback" not in done.stderr
    assert wall_s < RAY_START_THEN_FAILS_S


def test_train_ray_ddp_refuses_a_storage_path_it_cannot_write_before_training(refused):
    done, wall_s = refused["unwritable storage"]
    assert done.returncode != 0
    assert "error: Runs cannot be written to the storage path /dev/null/runs: Not a directory." in done.stderr
    assert "COURSE_STORAGE_PATH" in done.stderr and "Traceback" not in done.stderr
    assert wall_s < RAY_START_THEN_FAILS_S

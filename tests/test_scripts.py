"""The course's command-line scripts: their flags, and requests they refuse at once with the course's error.

The scripts' training runs are tested on a real multi-node cluster (tests/test_multinode.py), with 1 and 2
workers; two workers there take every CPU of the cluster, as one worker per CPU does on a laptop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.config import REPO_ROOT

SCRIPT = REPO_ROOT / "notebooks" / "train_ray_ddp.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO_ROOT)


def test_use_gpu_flags_default_to_the_configuration():
    from helpers.scripts import parse_args

    assert parse_args("x", []).use_gpu is None, "unset: COURSE_USE_GPU decides (auto: GPUs when the cluster has any)"
    assert parse_args("x", ["--use-gpu"]).use_gpu is True
    assert parse_args("x", ["--no-use-gpu"]).use_gpu is False


def test_use_gpu_on_a_machine_without_gpus_says_what_to_change(tmp_path):
    started = time.monotonic()
    done = _run("--use-gpu", "--smoke-test", "--storage-path", str(tmp_path), timeout=180)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "error: GPUs were asked for (COURSE_USE_GPU=true, or a script's --use-gpu), but the Ray cluster has no " \
           "GPU" in done.stderr
    assert time.monotonic() - started < 120


def test_train_ray_ddp_refuses_an_impossible_request_with_the_courses_error(tmp_path):
    started = time.monotonic()
    done = _run("--num-workers", "64", "--smoke-test", "--storage-path", str(tmp_path), timeout=180)
    assert done.returncode != 0
    assert "error: This run can never start: it asks for 64 workers" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 120  # Ray's start-up included; the check itself is instant


def test_train_ray_ddp_refuses_a_storage_path_it_cannot_write_before_training(tmp_path):
    started = time.monotonic()
    done = _run("--num-workers", "1", "--smoke-test", "--storage-path", "/dev/null/runs", timeout=180)
    assert done.returncode != 0
    assert "error: Runs cannot be written to the storage path /dev/null/runs: Not a directory." in done.stderr
    assert "COURSE_STORAGE_PATH" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 120  # Ray's start-up included; the check itself is instant


def test_a_course_error_raised_in_a_worker_is_printed_as_one_line():
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from helpers.data import DataNotFoundError
    from helpers.scripts import run_script

    def worker_without_data():  # what fit() raises when a worker's load_mnist fails (Ray Train 2.60)
        wrapped = UserExceptionWithTraceback(DataNotFoundError("MNIST is not in /data on node ab"), "Traceback ...")
        raise WorkerGroupError("Training failed", {1: wrapped})

    with pytest.raises(SystemExit, match="^error: MNIST is not in /data on node ab$"):
        run_script(worker_without_data)

    def worker_bug():
        raise WorkerGroupError("Training failed", {0: UserExceptionWithTraceback(ZeroDivisionError(), "Traceback")})

    with pytest.raises(WorkerGroupError):  # anything else keeps its traceback
        run_script(worker_bug)

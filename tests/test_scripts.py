"""The course's command-line scripts run end to end (smoke mode, on this machine's CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers.config import REPO_ROOT

SCRIPT = REPO_ROOT / "notebooks" / "train_ray_ddp.py"
RAY_DATA_SCRIPT = REPO_ROOT / "notebooks" / "train_ray_ddp_with_ray_data.py"


def _run(*args: str, timeout: float, script=SCRIPT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO_ROOT)


def test_train_ray_ddp_smoke_run_writes_a_checkpoint(tmp_path):
    done = _run("--num-workers", "2", "--epochs", "1", "--smoke-test", "--storage-path", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_acc=" in done.stdout
    checkpoints = list(tmp_path.glob("train_ray_ddp-run-*/checkpoint_*/model.pt"))
    assert len(checkpoints) == 1, list(tmp_path.rglob("*"))


def test_train_ray_ddp_refuses_an_impossible_request_with_the_courses_error(tmp_path):
    started = time.monotonic()
    done = _run("--num-workers", "64", "--smoke-test", "--storage-path", str(tmp_path), timeout=180)
    assert done.returncode != 0
    assert "error: This run can never start: it asks for 64 workers" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 120  # Ray's start-up included; the check itself is instant


def test_ray_data_script_with_one_worker_per_cpu_trains_instead_of_hanging(tmp_path):
    # Every CPU goes to a training worker: the seed's set-up that hangs Ray Data on a small laptop.
    workers = str(os.cpu_count())
    done = _run("--num-workers", workers, "--epochs", "1", "--smoke-test", "--storage-path", str(tmp_path),
                timeout=600, script=RAY_DATA_SCRIPT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_acc=" in done.stdout
    assert len(list(tmp_path.glob("train_ray_ddp_with_ray_data-run-*/checkpoint_*/model.pt"))) == 1
    assert len(list(tmp_path.glob("datasets/mnist-parquet/train/*.parquet"))) == 8


def test_train_ray_ddp_refuses_a_storage_path_it_cannot_write_before_training(tmp_path):
    started = time.monotonic()
    done = _run("--num-workers", "1", "--smoke-test", "--storage-path", "/dev/null/runs", timeout=180)
    assert done.returncode != 0
    assert "error: Runs cannot be written to the storage path /dev/null/runs: Not a directory." in done.stderr
    assert "COURSE_STORAGE_PATH" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 120  # Ray's start-up included; the check itself is instant

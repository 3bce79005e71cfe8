"""Lesson 06, section 04: a `breakpoint()` in a worker of a real 2-worker run, attached with `ray debug`.

With `RAY_DEBUG=legacy` in the workers' environment, Ray's breakpoint hook (`PYTHONBREAKPOINT`, set when a worker
connects: ray/_private/worker.py) opens a pdb on a localhost port and lists it in the GCS; `ray debug` in a
terminal lists the breakpoints, takes an index and attaches (ray/scripts/scripts.py, ray/util/rpdb.py). The other
rank waits in `report` meanwhile, and the run ends normally once the debugger continues.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import ray.train
from ray.train import RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import course_scaling_config
from helpers.system import wait_until
from helpers.tooling.local_cluster import RAY_CLI
from helpers.tooling.ray_internals import pdb_breakpoints

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


def stop_on_rank_zero(config: dict) -> None:
    rank = ray.train.get_context().get_world_rank()
    secret = 40 + rank
    if rank == 0:
        breakpoint()  # with RAY_DEBUG=legacy: waits here for `ray debug`
    ray.train.report({"secret": secret})


def test_ray_debug_attaches_to_a_breakpoint_in_rank_0_of_a_running_2_worker_run(course_ray, tmp_path):
    trainer = TorchTrainer(
        stop_on_rank_zero, scaling_config=course_scaling_config(course_ray, num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path), name="debugged",
                             worker_runtime_env={"env_vars": {"RAY_DEBUG": "legacy"}}))
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(trainer.fit)
        stops = wait_until(lambda: [b for b in pdb_breakpoints() if b["filename"].endswith("test_debugger_ray.py")],
                           timeout_s=240, interval_s=1, what="a breakpoint listed in the GCS")
        assert len(stops) == 1 and stops[0]["pdb_address"].startswith("localhost:"), stops
        assert not running.done(), "fit() waits while rank 0 is stopped"
        debugger = subprocess.Popen(
            [str(RAY_CLI), "debug", "--address", ray.get_runtime_context().gcs_address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "RAY_DEBUG": "legacy"})
        try:
            output, _ = debugger.communicate("0\np ('secret', secret, rank)\nc\n", timeout=120)
        except subprocess.TimeoutExpired:
            debugger.kill()
            output, _ = debugger.communicate()
            pytest.fail(f"ray debug did not end after continuing:\n{output[-3000:]}")
        result = running.result(timeout=120)
    assert "Active breakpoints:" in output and "stop_on_rank_zero" in output, output[-3000:]
    assert "('secret', 40, 0)" in output, output[-3000:]
    assert result.error is None, "the run ended normally: rank 0 went on from the breakpoint and reported"

"""helpers.tooling.bench against the pinned Ray: a real fit's controller log has every start-up phase."""

from __future__ import annotations

import pytest

from helpers.tooling import bench

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


def test_ray_trains_controller_still_logs_every_phase(course_ray, tmp_path):
    """Against the pinned Ray: a real fit's controller log has every phase `startup_phases` reads."""
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(lambda: ray.train.report({"done": 1}), scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(storage_path=str(tmp_path), name="phases")).fit()
    phases = bench.startup_phases(bench.controller_records("phases"))
    parts = sum(seconds for phase, seconds in phases.items() if phase not in ("worker_group_total", "controller_setup"))
    assert 0 < parts <= phases["worker_group_total"] + 0.05

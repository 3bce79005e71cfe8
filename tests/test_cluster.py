"""helpers.cluster: the resource preflight fails fast with what to change."""

from __future__ import annotations

import time

import pytest
import ray
from ray.train import ScalingConfig

from helpers import setup
from helpers.cluster import ResourceRequestError, check_resources, resources_per_worker

LAPTOP = [{"CPU": 2.0, "memory": 1e10}]
GPU_CLUSTER = [{"CPU": 8.0}, {"CPU": 8.0, "GPU": 4.0, "accelerator_type:T4": 1.0}]


@pytest.mark.parametrize("scaling_config", [
    ScalingConfig(num_workers=2),
    ScalingConfig(num_workers=2, use_gpu=True),
    ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2, "GPU": 0}),
    ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"CPU": 4}),
    ScalingConfig(num_workers=2, use_gpu=True, accelerator_type="T4"),
])
def test_resources_per_worker_follow_ray_trains_rules(scaling_config):
    assert resources_per_worker(scaling_config) == pytest.approx(scaling_config._resources_per_worker_not_none)


def test_requests_that_fit_pass_quietly():
    check_resources(ScalingConfig(num_workers=2), nodes=LAPTOP)
    check_resources(ScalingConfig(num_workers=4, use_gpu=True), nodes=GPU_CLUSTER)
    check_resources(ScalingConfig(num_workers=2, use_gpu=True, accelerator_type="T4"), nodes=GPU_CLUSTER)


def test_too_many_workers_says_how_many_fit():
    with pytest.raises(ResourceRequestError) as error:
        check_resources(ScalingConfig(num_workers=64), nodes=LAPTOP)
    message = str(error.value)
    assert "64 workers x (1 CPU)" in message and "2 CPU in all" in message
    assert "COURSE_NUM_WORKERS=2" in message


def test_workers_must_fit_on_one_node_each():
    # 2 nodes x 3 CPUs hold 6 CPUs in all, but only two 2-CPU workers (one per node).
    with pytest.raises(ResourceRequestError, match="room for 2 such worker"):
        check_resources(ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2}),
                        nodes=[{"CPU": 3.0}, {"CPU": 3.0}])


def test_gpu_on_a_cpu_only_cluster_says_to_train_on_cpu():
    with pytest.raises(ResourceRequestError, match="COURSE_USE_GPU=auto or false"):
        check_resources(ScalingConfig(num_workers=1, use_gpu=True), nodes=LAPTOP)


def test_missing_accelerator_type_says_to_drop_it():
    with pytest.raises(ResourceRequestError, match="COURSE_ACCELERATOR_TYPE"):
        check_resources(ScalingConfig(num_workers=1, use_gpu=True, accelerator_type="A100"), nodes=GPU_CLUSTER)


def test_preflight_on_this_machine_fails_fast_for_64_workers():
    assert not ray.is_initialized()
    try:
        setup()
        started = time.monotonic()
        with pytest.raises(ResourceRequestError, match="64 workers"):
            check_resources(ScalingConfig(num_workers=64))
        assert time.monotonic() - started < 30
        check_resources(ScalingConfig(num_workers=int(ray.cluster_resources()["CPU"])))  # a full machine fits
    finally:
        ray.shutdown()

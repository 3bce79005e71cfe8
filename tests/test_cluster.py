"""helpers.cluster: the resource preflight fails fast with what to change."""

from __future__ import annotations

import time

import pytest
import ray
from ray.train import ScalingConfig

import helpers.cluster
from helpers import setup
from helpers.cluster import (
    ResourceRequestError,
    StoragePathError,
    check_resources,
    check_storage_path,
    resources_per_worker,
    scaling_config,
)

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


@pytest.fixture(scope="module")
def live():
    assert not ray.is_initialized()
    yield setup()
    ray.shutdown()


def test_preflight_on_this_machine_fails_fast_for_64_workers(live):
    started = time.monotonic()
    with pytest.raises(ResourceRequestError, match="64 workers"):
        check_resources(ScalingConfig(num_workers=64))
    assert time.monotonic() - started < 30
    check_resources(ScalingConfig(num_workers=int(ray.cluster_resources()["CPU"])))  # a full machine fits


def test_the_course_scaling_config_splits_the_cpus_or_takes_a_gpu_each(live):
    cpus = ray.cluster_resources()["CPU"]
    one = scaling_config(live, num_workers=1, use_gpu=False)
    assert (one.num_workers, one.use_gpu, one.resources_per_worker) == (1, False, {"CPU": cpus})
    two = scaling_config(live, num_workers=2, use_gpu=False)
    assert two.resources_per_worker == {"CPU": max(1.0, cpus // 2)}
    assert scaling_config(live, num_workers=2, use_gpu=True).resources_per_worker == {"CPU": 1, "GPU": 1}
    check_resources(scaling_config(live))  # the course's default request fits this machine


def test_a_writable_storage_path_passes_and_keeps_no_probe(live, tmp_path):
    target = tmp_path / "new" / "runs"
    assert check_storage_path(target) == target and target.is_dir()
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("bad", ["/dev/null/runs", "/proc/course-runs"])
def test_an_unwritable_storage_path_fails_at_once_saying_what_to_set(live, bad):
    started = time.monotonic()
    with pytest.raises(StoragePathError) as error:
        check_storage_path(bad)
    assert time.monotonic() - started < 5
    assert f"Runs cannot be written to the storage path {bad}" in str(error.value)
    assert "COURSE_STORAGE_PATH" in str(error.value)


def test_a_storage_path_other_nodes_do_not_see_fails(live, tmp_path, monkeypatch):
    # On this one machine every task sees the probe; fake a second node that does not.
    monkeypatch.setattr(helpers.cluster, "_nodes_missing", lambda probe: ["ffffffff00000000"])
    with pytest.raises(StoragePathError, match="local to this machine: 1 node\\(s\\) of the cluster do not see"):
        check_storage_path(tmp_path)
    assert list(tmp_path.iterdir()) == [], "the probe file was left behind"

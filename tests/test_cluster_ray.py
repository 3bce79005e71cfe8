"""helpers.cluster against this machine's Ray: its capacity, the preflight, the scaling config, the storage check."""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.train import ScalingConfig

import helpers.cluster
from helpers.cluster import (
    Capacity,
    ResourceRequestError,
    StoragePathError,
    check_data_resources,
    check_resources,
    check_storage_path,
    cluster_capacity,
    course_scaling_config,
    plan_workers,
)
from helpers.config import REPO_ROOT, load_config
from tests.support import FAILS_FAST_S, LAPTOP

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


def test_this_machine_is_a_fixed_one_node_cluster(course_ray):
    capacity = cluster_capacity()
    assert not capacity.can_grow and not capacity.groups, "a local Ray has no autoscaler"
    assert capacity.nodes == [node["Resources"] for node in ray.nodes()]


def test_preflight_on_this_machine_fails_fast_for_64_workers(course_ray):
    started = time.monotonic()
    with pytest.raises(ResourceRequestError, match="64 workers"):
        check_resources(ScalingConfig(num_workers=64))
    assert time.monotonic() - started < FAILS_FAST_S
    check_resources(ScalingConfig(num_workers=int(ray.cluster_resources()["CPU"])))  # a full machine fits


def test_the_course_scaling_config_splits_the_cpus_or_takes_a_gpu_each(course_ray):
    cpus = ray.cluster_resources()["CPU"]
    one = course_scaling_config(course_ray, num_workers=1, use_gpu=False)
    assert (one.num_workers, one.use_gpu, one.resources_per_worker) == (1, False, {"CPU": cpus})
    two = course_scaling_config(course_ray, num_workers=2, use_gpu=False)
    assert two.resources_per_worker == {"CPU": max(1.0, cpus // 2)}
    assert course_ray.num_workers == course_scaling_config(course_ray).num_workers, "setup() printed the same sizing"
    check_resources(course_scaling_config(course_ray))  # the course's default request fits this machine


#: The nodes of the sizing rule for Ray Data: one GPU with 16 CPUs (a cloud GPU box), four GPUs with 32 CPUs.
ONE_GPU_16_CPUS = Capacity([{"CPU": 16.0, "GPU": 1.0}])
FOUR_GPUS_32_CPUS = Capacity([{"CPU": 32.0, "GPU": 4.0}])


def sizing_datasets() -> dict[str, dict]:
    """The three cases of the rule: no datasets (a DataLoader), materialized ones, and one that streams."""
    materialized = ray.data.range(64).materialize()
    return {"none": {}, "materialized": {"train": materialized, "valid": materialized},
            "streaming": {"train": materialized.map_batches(lambda batch: batch), "valid": materialized}}


def test_cpus_are_kept_for_ray_data_on_every_gpu_node_only_when_a_dataset_streams(course_ray):
    cases = sizing_datasets()
    sized = {(name, case): plan_workers(load_config({}), capacity=capacity, datasets=datasets)
             for name, capacity in (("1 GPU, 16 CPUs", ONE_GPU_16_CPUS), ("4 GPUs, 32 CPUs", FOUR_GPUS_32_CPUS))
             for case, datasets in cases.items()}
    assert {key: (plan.num_workers, plan.resources_per_worker) for key, plan in sized.items()} == {
        ("1 GPU, 16 CPUs", "none"): (1, {"CPU": 16.0, "GPU": 1.0}),
        ("1 GPU, 16 CPUs", "materialized"): (1, {"CPU": 16.0, "GPU": 1.0}),
        ("1 GPU, 16 CPUs", "streaming"): (1, {"CPU": 2.0, "GPU": 1.0}),  # 14 CPUs for Ray Data's tasks
        ("4 GPUs, 32 CPUs", "none"): (4, {"CPU": 8.0, "GPU": 1.0}),
        ("4 GPUs, 32 CPUs", "materialized"): (4, {"CPU": 8.0, "GPU": 1.0}),
        ("4 GPUs, 32 CPUs", "streaming"): (4, {"CPU": 2.0, "GPU": 1.0}),  # 24 CPUs for Ray Data's tasks
    }
    # The plan says which case applies: setup()'s line (no datasets) is unchanged, the others name the datasets.
    assert sized[("1 GPU, 16 CPUs", "none")].why == ("one per GPU (the cluster has GPUs), each with its share of a "
                                                    "node's CPUs")
    assert "the datasets are materialized: Ray Data needs no CPU" in sized[("4 GPUs, 32 CPUs", "materialized")].why
    assert ("2 of its 8 CPUs per GPU; the rest of each GPU node's CPUs stay for Ray Data, since the datasets ['train'] "
            "stream") in sized[("4 GPUs, 32 CPUs", "streaming")].why
    # A GPU node with few CPUs per GPU still keeps half of them for Ray Data.
    tight = plan_workers(load_config({}), capacity=Capacity([{"CPU": 2.0, "GPU": 2.0}]), datasets=cases["streaming"])
    assert tight.resources_per_worker == {"CPU": 0.5, "GPU": 1.0}
    # On CPU nodes a streaming dataset keeps one CPU (as reserve_for_data=1), a materialized one none.
    assert plan_workers(load_config({}), capacity=LAPTOP, datasets=cases["streaming"]).resources_per_worker == {
        "CPU": 0.5}
    assert plan_workers(load_config({}), capacity=LAPTOP, datasets=cases["materialized"]).resources_per_worker == {
        "CPU": 1.0}
    for (name, case), plan in sized.items():  # and the preflight agrees with the sizing, case by case
        capacity = ONE_GPU_16_CPUS if name.startswith("1") else FOUR_GPUS_32_CPUS
        scaling = ScalingConfig(num_workers=plan.num_workers, use_gpu=True,
                                resources_per_worker=plan.resources_per_worker)
        check_resources(scaling, capacity)
        check_data_resources(scaling, cases[case], capacity)
    with pytest.raises(ResourceRequestError, match=r"Ray Data would never get a CPU(.|\n)*course_scaling_config\(cfg, "
                                                    r"datasets=\.\.\.\)(.|\n)*resources_per_worker=\{'CPU': 2\}"):
        check_data_resources(ScalingConfig(num_workers=1, use_gpu=True,
                                           resources_per_worker=sized[("1 GPU, 16 CPUs", "none")].resources_per_worker),
                             cases["streaming"], ONE_GPU_16_CPUS)


def test_a_cpu_worker_gets_no_loader_process(course_ray):
    from helpers.training import loader_workers

    @ray.remote
    def workers_in_a_task() -> int:
        return loader_workers()

    assert loader_workers() == 0, "the driver is no Ray worker: its DataLoader loads in its own process"
    # Without a GPU the reserved CPUs compute the model: no loader process competes with them, whatever their number.
    assert [ray.get(workers_in_a_task.options(num_cpus=cpus).remote()) for cpus in (0.5, 1, 2)] == [0, 0, 0]


def test_a_gpu_worker_gets_a_loader_process_per_cpu_ray_reserved_less_one_and_a_predictor_the_gpu_it_asked_for(
        tmp_path):
    # A Ray with two (logical) GPUs in a subprocess: Ray assigns GPUs it is told of, on any machine. Lesson 04's
    # predictor actors take a GPU only with num_gpus: Ray leaves CUDA_VISIBLE_DEVICES alone for those that ask none.
    import subprocess
    import sys

    code = """
import ray
from helpers.training import has_a_gpu
from helpers.training import loader_workers
ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
@ray.remote
def workers():
    return loader_workers()
print([ray.get(workers.options(num_cpus=cpus, num_gpus=1).remote()) for cpus in (0, 1, 2)])
print([ray.get(ray.remote(has_a_gpu).options(num_gpus=gpus).remote()) for gpus in (0, 1)])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.stdout.strip().splitlines()[-2:] == ["[0, 0, 1]", "[False, True]"], out.stderr[-2000:]


def test_a_writable_storage_path_passes_and_keeps_no_probe(course_ray, tmp_path):
    target = tmp_path / "new" / "runs"
    assert check_storage_path(str(target)) == str(target) and target.is_dir()
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("bad", ["/dev/null/runs", "/proc/course-runs"])
def test_an_unwritable_storage_path_fails_at_once_saying_what_to_set(course_ray, bad):
    started = time.monotonic()
    with pytest.raises(StoragePathError) as error:
        check_storage_path(bad)
    assert time.monotonic() - started < FAILS_FAST_S
    assert f"Runs cannot be written to the storage path {bad}" in str(error.value)
    assert "COURSE_STORAGE_PATH" in str(error.value)


def test_a_storage_path_other_nodes_do_not_see_fails(course_ray, tmp_path, monkeypatch):
    # On this one machine every task sees the probe; fake a second node that does not.
    monkeypatch.setattr(helpers.cluster, "_nodes_missing", lambda probe: {"ffffffff00000000": "not there"})
    with pytest.raises(StoragePathError, match="not reachable from 1 node\\(s\\) of the cluster \\(ffffffff: not"):
        check_storage_path(str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "the probe file was left behind"

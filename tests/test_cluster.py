"""helpers.cluster: workers sized from the nodes that host them; preflights that fail fast or say what a run waits
for.

On this machine's own Ray: tests/test_cluster_ray.py.
"""

from __future__ import annotations

import pytest
from ray.train import ScalingConfig

from helpers.cluster import (
    Capacity,
    NodeGroup,
    ResourceRequestError,
    ResourceWaitWarning,
    check_resources,
    gpus_hold,
    plan_workers,
    resources_per_worker,
)
from helpers.config import ConfigError, load_config
from helpers.tooling.ray_internals import train_resources_per_worker
from tests.support import LAPTOP, plan

#: As on Anyscale: a head with no CPUs, and two worker nodes.
THREE_NODES = Capacity([{"memory": 1e10}, {"CPU": 2.0}, {"CPU": 2.0}])
ONE_GPU_MACHINE = Capacity([{"CPU": 16.0, "GPU": 1.0}])
GPU_CLUSTER = Capacity([{"CPU": 8.0}, {"CPU": 8.0, "GPU": 4.0, "accelerator_type:T4": 1.0}])
#: Worker groups that start at zero nodes, with the node types Ray's cluster config reports (as Anyscale's).
AUTOSCALING = Capacity([{"memory": 1e10}], [NodeGroup({"CPU": 2.0}, 2), NodeGroup({"CPU": 8.0, "GPU": 1.0}, 4)],
                       can_grow=True)
#: A Ray autoscaler that does not report its node types (Ray's own, as `ray up` and KubeRay run it).
AUTOSCALING_UNKNOWN = Capacity([{"memory": 1e10}], can_grow=True)


@pytest.mark.parametrize("scaling_config", [
    ScalingConfig(num_workers=2),
    ScalingConfig(num_workers=2, use_gpu=True),
    ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2, "GPU": 0}),
    ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"CPU": 4}),
    ScalingConfig(num_workers=2, use_gpu=True, accelerator_type="T4"),
])
def test_resources_per_worker_follow_ray_trains_rules(scaling_config):
    assert resources_per_worker(scaling_config) == pytest.approx(train_resources_per_worker(scaling_config))


def test_on_a_laptop_two_workers_split_the_cpus():
    laptop = plan(LAPTOP)
    assert (laptop.num_workers, laptop.use_gpu, laptop.resources_per_worker) == (2, False, {"CPU": 1.0})
    assert "the default on CPU (no GPU in the cluster)" in laptop.why
    assert plan(LAPTOP, COURSE_NUM_WORKERS="1").resources_per_worker == {"CPU": 2.0}


def test_cpus_per_worker_come_from_the_node_not_the_cluster_total():
    # 4 CPUs in all, but 2 per node: one 4-CPU worker would fit no node (the bug this replaces).
    assert plan(THREE_NODES, COURSE_NUM_WORKERS="1").resources_per_worker == {"CPU": 2.0}
    two = plan(THREE_NODES)  # a whole node each: the two workers must land on different nodes
    assert (two.num_workers, two.resources_per_worker) == (2, {"CPU": 2.0})
    assert plan(THREE_NODES, COURSE_NUM_WORKERS="3").resources_per_worker == {"CPU": 1.0}
    for workers in ("1", "2", "3", "4"):
        check_resources(course_scaling_config_for(THREE_NODES, workers), THREE_NODES)


def course_scaling_config_for(capacity: Capacity, workers: str) -> ScalingConfig:
    sized = plan(capacity, COURSE_NUM_WORKERS=workers)
    return ScalingConfig(num_workers=sized.num_workers, resources_per_worker=sized.resources_per_worker)


def test_cpus_per_worker_can_be_set():
    fixed = plan(THREE_NODES, COURSE_CPUS_PER_WORKER="0.5")
    assert fixed.resources_per_worker == {"CPU": 0.5} and "COURSE_CPUS_PER_WORKER" in fixed.why


def test_keeping_cpus_for_ray_data():
    assert plan_workers(load_config({}), 2, reserve_for_data=1, capacity=LAPTOP).resources_per_worker == {"CPU": 0.5}
    assert plan_workers(load_config({}), 2, reserve_for_data=1, capacity=THREE_NODES).resources_per_worker == {
        "CPU": 1.0}
    assert plan_workers(load_config({}), 2, reserve_for_data=1,
                        capacity=Capacity([{"CPU": 16.0}])).resources_per_worker == {"CPU": 7.0}


def test_cpus_kept_for_the_input_stay_on_the_workers_own_node():
    # Lesson 10 section 05: one worker, its node's other CPUs free for its input. Counted over the cluster, the 15
    # CPUs of a second node would have let the worker take all 16 of its own.
    two_gpu_nodes = Capacity([{"CPU": 0.0}, {"CPU": 16.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 1.0}])
    assert plan_workers(load_config({}), 1, reserve_for_data=15, capacity=two_gpu_nodes).resources_per_worker == {
        "CPU": 1.0, "GPU": 1.0}
    assert plan_workers(load_config({}), 2, reserve_for_data=15, capacity=two_gpu_nodes).resources_per_worker == {
        "CPU": 1.0, "GPU": 1.0}, "a worker on each node, each node keeping 15"
    two_cpu_nodes = Capacity([{"CPU": 8.0}, {"CPU": 8.0}])
    assert plan_workers(load_config({}), 1, reserve_for_data=7, capacity=two_cpu_nodes).resources_per_worker == {
        "CPU": 1.0}
    assert plan_workers(load_config({}), 3, reserve_for_data=7, capacity=two_cpu_nodes).resources_per_worker == {
        "CPU": 0.5}, "three workers: two share one node's spare CPU"
    # Nodes too small to keep it beside a worker (tests/test_multinode.py's cluster): kept over the cluster instead,
    # where Ray Data's tasks can run on any node.
    one_cpu_nodes = Capacity([{"CPU": 0.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    assert plan_workers(load_config({}), 2, reserve_for_data=1, capacity=one_cpu_nodes).resources_per_worker == {
        "CPU": 0.5}


def test_a_single_gpu_machine_just_works_with_the_defaults():
    gpu = plan(ONE_GPU_MACHINE)
    assert (gpu.num_workers, gpu.use_gpu, gpu.resources_per_worker) == (1, True, {"CPU": 16.0, "GPU": 1.0})
    assert gpu.describe().startswith("1 x (16 CPU, 1 GPU): one per GPU (the cluster has GPUs)")
    check_resources(ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker=gpu.resources_per_worker),
                    ONE_GPU_MACHINE)
    assert plan(ONE_GPU_MACHINE, COURSE_USE_GPU="false").resources_per_worker == {"CPU": 8.0}


def test_gpu_workers_get_the_cpus_per_gpu_of_their_own_node():
    mixed = Capacity([{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 1.0}])
    sized = plan(mixed)
    assert (sized.num_workers, sized.resources_per_worker) == (5, {"CPU": 2.0, "GPU": 1.0})
    check_resources(ScalingConfig(num_workers=5, use_gpu=True, resources_per_worker=sized.resources_per_worker), mixed)


def test_one_worker_per_gpu_on_a_gpu_cluster():
    gpus = plan(GPU_CLUSTER)
    assert (gpus.num_workers, gpus.resources_per_worker) == (4, {"CPU": 2.0, "GPU": 1.0})
    on_t4 = plan(GPU_CLUSTER, COURSE_ACCELERATOR_TYPE="T4")
    assert on_t4.num_workers == 4 and on_t4.use_gpu


def test_gpus_required_on_a_cpu_cluster_is_a_config_error():
    with pytest.raises(ConfigError, match="GPUs were asked for .* but the Ray cluster has no GPU"):
        plan(THREE_NODES, COURSE_USE_GPU="true")


def test_an_autoscaler_that_can_add_gpu_nodes_counts():
    auto = plan(AUTOSCALING)  # no node has a GPU yet
    assert (auto.num_workers, auto.use_gpu, auto.resources_per_worker) == (1, True, {"CPU": 8.0, "GPU": 1.0})
    assert "its autoscaler can add GPU nodes" in auto.why
    on_cpu = plan(AUTOSCALING, COURSE_USE_GPU="false")
    assert on_cpu.resources_per_worker == {"CPU": 2.0}, "sized for the CPU nodes the autoscaler adds"
    assert "up to 2 x (2 CPU), up to 4 x (8 CPU, 1 GPU)" in AUTOSCALING.describe()


def test_an_autoscaler_with_unknown_node_types_accepts_a_gpu_request():
    assert plan(AUTOSCALING_UNKNOWN, COURSE_USE_GPU="true").use_gpu  # not rejected: a GPU node may come
    assert not plan(AUTOSCALING_UNKNOWN).use_gpu, "auto: no GPU seen, none known to come"
    assert "1 CPU until a node joins" in plan(AUTOSCALING_UNKNOWN).why


def test_gpus_hold_as_many_workers_as_the_gpus_a_run_can_get():
    assert gpus_hold(load_config({}), 1, ONE_GPU_MACHINE) and not gpus_hold(load_config({}), 2, ONE_GPU_MACHINE)
    assert gpus_hold(load_config({}), 4, GPU_CLUSTER) and not gpus_hold(load_config({}), 5, GPU_CLUSTER)
    assert not gpus_hold(load_config({"COURSE_USE_GPU": "false"}), 1, ONE_GPU_MACHINE), "the course trains on CPUs"
    assert not gpus_hold(load_config({}), 1, LAPTOP)
    assert gpus_hold(load_config({}), 4, AUTOSCALING), "GPU nodes the autoscaler can add count"
    assert gpus_hold(load_config({"COURSE_ACCELERATOR_TYPE": "T4"}), 4, GPU_CLUSTER)
    assert not gpus_hold(load_config({"COURSE_ACCELERATOR_TYPE": "A100"}), 1, GPU_CLUSTER), "no A100 node"


def test_requests_that_fit_pass_quietly():
    check_resources(ScalingConfig(num_workers=2), LAPTOP)
    check_resources(ScalingConfig(num_workers=4, use_gpu=True), GPU_CLUSTER)
    check_resources(ScalingConfig(num_workers=2, use_gpu=True, accelerator_type="T4"), GPU_CLUSTER)


def test_too_many_workers_says_how_many_fit():
    with pytest.raises(ResourceRequestError) as error:
        check_resources(ScalingConfig(num_workers=64), LAPTOP)
    message = str(error.value)
    assert "64 workers x (1 CPU)" in message and "2 CPU in all" in message
    assert "COURSE_NUM_WORKERS=2" in message


def test_workers_must_fit_on_one_node_each():
    # 2 nodes x 3 CPUs hold 6 CPUs in all, but only two 2-CPU workers (one per node).
    with pytest.raises(ResourceRequestError, match="room for 2 such worker"):
        check_resources(ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2}),
                        Capacity([{"CPU": 3.0}, {"CPU": 3.0}]))
    with pytest.raises(ResourceRequestError, match="COURSE_CPUS_PER_WORKER"):
        check_resources(ScalingConfig(num_workers=1, resources_per_worker={"CPU": 4}), THREE_NODES)


def test_gpu_on_a_cpu_only_cluster_says_to_train_on_cpu():
    with pytest.raises(ResourceRequestError, match="COURSE_USE_GPU=auto or false"):
        check_resources(ScalingConfig(num_workers=1, use_gpu=True), LAPTOP)


def test_missing_accelerator_type_says_to_drop_it():
    with pytest.raises(ResourceRequestError, match="COURSE_ACCELERATOR_TYPE"):
        check_resources(ScalingConfig(num_workers=1, use_gpu=True, accelerator_type="A100"), GPU_CLUSTER)


def test_on_an_autoscaling_cluster_the_preflight_says_what_the_run_waits_for():
    request = ScalingConfig(num_workers=4, use_gpu=True, resources_per_worker={"CPU": 8, "GPU": 1})
    with pytest.warns(ResourceWaitWarning) as warned:
        check_resources(request, AUTOSCALING)  # 4 GPU nodes can be added: wait for them, not fail
    message = str(warned[0].message)
    assert "room for 0 of the 4 workers x (8 CPU, 1 GPU) now" in message
    assert "Kernel > Interrupt" in message and "Ctrl-C" in message
    assert "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S" in message
    with pytest.warns(ResourceWaitWarning):
        check_resources(ScalingConfig(num_workers=64), AUTOSCALING_UNKNOWN)  # limits unknown: waits


def test_node_types_of_a_cluster_that_cannot_grow_add_nothing():
    fixed = Capacity([{"CPU": 2.0}, {"CPU": 2.0}], [NodeGroup({"CPU": 2.0}, 2)], can_grow=False)
    assert "can add" not in fixed.describe()
    with pytest.raises(ResourceRequestError) as error:
        check_resources(ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2}), fixed)
    assert "the cluster's 2 node(s) have" in str(error.value)


def test_beyond_the_autoscalers_limits_the_preflight_still_fails_at_once():
    request = ScalingConfig(num_workers=5, use_gpu=True, resources_per_worker={"CPU": 8, "GPU": 1})
    with pytest.raises(ResourceRequestError) as error:
        check_resources(request, AUTOSCALING)
    assert "its autoscaler's limits included" in str(error.value) and "COURSE_NUM_WORKERS=4" in str(error.value)

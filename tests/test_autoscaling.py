"""The course on an autoscaling Ray cluster that starts with no worker node, as Anyscale's worker groups do.

A real Ray autoscaler runs on the head with Ray's fake multi-node provider (helpers.tooling.local_cluster): it adds
a real raylet on this machine for each node a request needs. Ray's own autoscaler does not report its node types, so
the course knows only that the cluster can grow; Anyscale's reports them in Ray's cluster config, which a test writes
the way it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from helpers.config import REPO_ROOT
from helpers.tooling.local_cluster import LocalCluster, fake_autoscaling_config

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster

NODE_TYPES = {"cpu_node": {"resources": {"CPU": 2}, "max_workers": 2},
              "gpu_node": {"resources": {"CPU": 4, "GPU": 1}, "max_workers": 1}}

#: setup() on the cluster, then the preflight of the course's default request and of `REQUEST` (JSON) if given.
DRIVER = """
import json, os, warnings
import ray
from ray.train import ScalingConfig
from helpers import setup
from helpers.cluster import ResourceRequestError, check_resources, course_scaling_config

if os.environ.get("REPORT_NODE_TYPES"):  # what Anyscale's autoscaler reports to Ray
    from helpers.session import send_token_if_given
    from helpers.tooling.ray_internals import report_node_groups
    send_token_if_given()
    ray.init()
    report_node_groups([{"name": name, "resources": spec["resources"], "min_count": 0, "max_count": spec["max_workers"]}
                        for name, spec in json.loads(os.environ["REPORT_NODE_TYPES"]).items()])
cfg = setup()
outcomes = {}
asked = [("asked", ScalingConfig(**json.loads(os.environ["REQUEST"])))] if "REQUEST" in os.environ else []
for name, request in [("default", course_scaling_config(cfg)), *asked]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_resources(request)
            outcomes[name] = "waits: " + str(caught[0].message) if caught else "fits"
        except ResourceRequestError as error:
            outcomes[name] = "error: " + str(error)
print(json.dumps({"use_gpu": cfg.use_gpu, "num_workers": cfg.num_workers, **outcomes}))
"""


@pytest.fixture(scope="module")
def autoscaling(no_ray, tmp_path_factory) -> Iterator[tuple[LocalCluster, str]]:
    """A head with no CPU and an autoscaler that can add two 2-CPU nodes and one 4-CPU, 1-GPU node; a storage path."""
    config = fake_autoscaling_config(NODE_TYPES, max_workers=3)
    with LocalCluster(worker_nodes=0, autoscaling_config=config) as cluster:
        yield cluster, str(tmp_path_factory.mktemp("storage"))


def run(autoscaling: tuple[LocalCluster, str], *args: str, code: str | None = None, timeout_s: float = 300,
        **variables: str):
    """A driver joining the cluster with its token only (setup() sets RAY_AUTH_MODE), in smoke mode."""
    cluster, storage_path = autoscaling
    env = {name: value for name, value in os.environ.items() if not name.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(cluster.driver_env(), COURSE_STORAGE_PATH=storage_path, COURSE_SMOKE_TEST="1", PYTHONUNBUFFERED="1",
               **variables)
    command = [sys.executable, "-c", code] if code else [sys.executable, *args]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT / "notebooks", capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_setup_sees_a_cluster_that_can_grow_and_the_preflight_waits_instead_of_failing(autoscaling):
    done = run(autoscaling, code=DRIVER, REQUEST=json.dumps({"num_workers": 1, "use_gpu": True}))
    assert "cluster      : 0 CPUs, 0 GPUs, 1 node(s); an autoscaler can add nodes" in done.stdout
    assert "each with 1 CPU until a node joins" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Ray's autoscaler does not say which node types it has: no GPU seen, so auto trains on CPU ...
    assert (result["use_gpu"], result["num_workers"]) == (False, 2)
    assert result["default"].startswith("waits: The cluster has room for 0 of the 2 workers x (1 CPU) now")
    # ... and a GPU request is not rejected: the autoscaler may add a GPU node.
    assert result["asked"].startswith("waits: The cluster has room for 0 of the 1 workers x (1 GPU) now")


def test_a_training_run_waits_for_the_node_the_autoscaler_adds(autoscaling, small_mnist):
    # Lesson 02's script with 1 worker: sized for a node that does not exist yet, trained on the one that came.
    done = run(autoscaling, str(REPO_ROOT / "notebooks" / "train_ray_ddp.py"), "--num-workers", "1", "--epochs", "1",
               "--smoke-test", "--no-use-gpu", timeout_s=600, COURSE_DATA_DIR=small_mnist)
    assert "ResourceWaitWarning: The cluster has room for 0 of the 1 workers x (1 CPU) now" in done.stderr
    assert "test_acc=" in done.stdout and "workers ran on 1 node(s)" in done.stdout


def test_with_the_node_types_reported_auto_picks_the_gpu_nodes_and_limits_hold(autoscaling):
    types = json.dumps(NODE_TYPES)
    done = run(autoscaling, code=DRIVER, REPORT_NODE_TYPES=types,
               REQUEST=json.dumps({"num_workers": 2, "use_gpu": True}))
    assert "its autoscaler can add up to 2 x (2 CPU), up to 1 x (4 CPU, 1 GPU)" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["use_gpu"], result["num_workers"]) == (True, 1), "one worker per GPU of the GPU node type"
    assert "1 x (4 CPU, 1 GPU): one per GPU of the first GPU node to join" in done.stdout
    assert result["default"].startswith("waits: The cluster has room for 0 of the 1 workers x (4 CPU, 1 GPU)")
    assert result["asked"].startswith("error: This run can never start: it asks for 2 workers x (1 GPU)")
    assert "COURSE_NUM_WORKERS=1" in result["asked"]

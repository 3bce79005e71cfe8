"""The course on a real multi-node Ray cluster on this machine, as on Anyscale: a head with no CPUs, two worker
nodes, token auth on, the dashboard on loopback (helpers.tooling.local_cluster). Each worker node has 1 CPU, as this
machine has 2 cores: with 2 CPUs per node, two workers of 2 threads each fought over the cores (86 images/s
instead of 272 in the same 2-worker run).

One cluster serves the module. Drivers run as subprocesses that join it through RAY_ADDRESS and the cluster's
token (RAY_AUTH_TOKEN, without RAY_AUTH_MODE: the course's setup() must set that), as a learner's script or
notebook would: lesson 02's and lesson 03's scripts with 1 and 2 workers, setup() itself (also with no RAY_ADDRESS,
where `ray start` recorded the cluster), and lesson 11's search (its trials on both worker nodes, run again by name;
lesson 11 interrupts a search and restores it, tests/test_tuning.py tests the rest); lesson 12's script; and lesson
09's job, submitted through the Jobs API with its code as the runtime env.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers.config import REPO_ROOT
from helpers.fault_tolerance import press_ctrl_c_when_checkpointed
from helpers.results import latest_checkpoint_metrics, read_history
from helpers.session import PREEMPTION_WATCHER_VAR
from helpers.tooling.local_cluster import LocalCluster
from helpers.tuning import TRIAL_ID_IN_FOLDER, search_state
from tests.support import RAY_VARS, clean_env, stopped_after

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster

#: Joins the cluster named by RAY_ADDRESS and prints its nodes.
NODES_DRIVER = """
import json, ray
ray.init()
print(json.dumps([{"alive": node["Alive"], "resources": node["Resources"]} for node in ray.nodes()]))
"""

#: A plain `ray.init()`, as in a notebook: prints the GCS it started or joined and its number of nodes, then waits
#: for a line on stdin before it runs a task.
PLAIN_DRIVER = """
import json, sys, ray
context = ray.init()
print(json.dumps({"gcs": context.address_info["gcs_address"], "nodes": len(ray.nodes())}), flush=True)
sys.stdin.readline()

@ray.remote
def one() -> int:
    return 1

print(json.dumps({"task": ray.get(one.remote(), timeout=60)}))
ray.shutdown()
"""


def run_driver(code: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a new Python process with `env`; fail the test if it takes longer than `timeout_s`."""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)


def last_json_line(output: str) -> dict | list:
    """The last line of `output` (a driver prints its result last), parsed as JSON."""
    return json.loads(output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster(no_ray) -> Iterator[LocalCluster]:
    """A head with no CPUs and two worker nodes with 1 CPU each; stopped, and checked gone, after the module."""
    ray_vars = {name: os.environ.get(name) for name in RAY_VARS}
    with stopped_after(LocalCluster(worker_nodes=2, cpus_per_worker_node=1)) as local_cluster:
        assert {name: os.environ.get(name) for name in RAY_VARS} == ray_vars, "start() changed this process's variables"
        yield local_cluster


def test_driver_with_token_sees_three_nodes(cluster: LocalCluster) -> None:
    result = run_driver(NODES_DRIVER, clean_env(**cluster.driver_env(), RAY_AUTH_MODE="token"))
    assert result.returncode == 0, result.stderr[-3000:]
    nodes = last_json_line(result.stdout)
    assert [node["alive"] for node in nodes] == [True, True, True]
    assert sorted(node["resources"].get("CPU", 0) for node in nodes) == [0, 1, 1]
    # The head offers no CPU at all: Ray leaves the key out rather than reporting 0.
    assert sum("CPU" not in node["resources"] for node in nodes) == 1


def test_driver_without_auth_mode_is_refused(cluster: LocalCluster) -> None:
    # The token alone is not enough: without RAY_AUTH_MODE=token the driver does not send it. Ray retries for
    # about 20 s before it gives up (ray/_private/node.py, _init_gcs_client); 3 attempts show the same error.
    env = clean_env(**cluster.driver_env(), RAY_gcs_server_port_wait_time_s="3")
    result = run_driver(NODES_DRIVER, env, timeout_s=60)
    assert result.returncode != 0
    assert "Authentication token is missing or incorrect" in result.stderr
    assert "RAY_AUTH_MODE is currently 'disabled'" in result.stderr


@pytest.mark.parametrize("path", ["/api/version", "/api/v0/nodes", "/api/jobs/"])
def test_dashboard_requires_the_token(cluster: LocalCluster, path: str) -> None:
    def status(headers: dict[str, str]) -> int:
        request = urllib.request.Request(cluster.dashboard_url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    assert status({}) == 401
    assert status({"Authorization": "Bearer not-the-token"}) == 403
    assert status({"Authorization": f"Bearer {cluster.token}"}) == 200


def test_dashboard_listens_on_loopback_only(cluster: LocalCluster) -> None:
    port = int(cluster.dashboard_url.rsplit(":", 1)[1])
    listening = {conn.laddr.ip for conn in psutil.net_connections("tcp")
                 if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port}
    assert listening == {"127.0.0.1"}


def test_the_token_stays_out_of_the_commands(cluster: LocalCluster) -> None:
    assert cluster.token and re.fullmatch(r"[0-9a-f]{64}", cluster.token)
    token_file = cluster.temp_dir / "auth_token"
    assert token_file.read_text() == cluster.token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(cluster.commands) == 3
    assert all(cluster.token not in command for command in cluster.commands)
    assert all(f"RAY_AUTH_TOKEN_PATH={token_file}" in command for command in cluster.commands)
    assert cluster.commands[0].startswith(f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_file} ray start --head ")
    assert cluster.driver_env() == {"RAY_ADDRESS": cluster.address, "RAY_AUTH_TOKEN": cluster.token}


def test_a_plain_ray_init_starts_its_own_ray_beside_the_cluster(cluster: LocalCluster) -> None:
    # A notebook's `ray.init()` while the cluster runs (RAY_ADDRESS unset): it must not join the cluster.
    local_ray = subprocess.Popen([sys.executable, "-c", PLAIN_DRIVER], env=clean_env(), text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert select.select([local_ray.stdout], [], [], 120)[0], "ray.init() did not return within 120 s"
        started = json.loads(local_ray.stdout.readline())
        stdout, stderr = local_ray.communicate("go\n", timeout=120)
    finally:
        local_ray.kill()
        local_ray.wait()
    assert local_ray.returncode == 0, stderr[-3000:]
    assert started["gcs"] != cluster.address and started["nodes"] == 1
    assert "Started a local Ray instance" in stderr
    assert last_json_line(stdout) == {"task": 1}


#: setup() on the cluster, then where `helpers` comes from on each worker node, as JSON.
SETUP_DRIVER = """
import json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from helpers import setup

cfg = setup()

@ray.remote(num_cpus=0)
def helpers_here() -> dict:
    import helpers
    return {"file": helpers.__file__, "py_modules": ray.get_runtime_context().runtime_env.get("py_modules", [])}

workers = [node["NodeID"] for node in ray.nodes() if node["Resources"].get("CPU")]
found = ray.get([helpers_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                 for node in workers])
print(json.dumps({"num_workers": cfg.num_workers, "use_gpu": cfg.use_gpu, "helpers": found}))
"""


@pytest.fixture(scope="module")
def course_env(cluster: LocalCluster, tmp_path_factory, small_mnist: str) -> dict[str, str]:
    """A driver's environment on the cluster: its address and token only, a storage path every node sees (on one
    machine, any folder is shared), smoke mode, the small MNIST."""
    env = clean_env(**cluster.driver_env(), COURSE_STORAGE_PATH=str(tmp_path_factory.mktemp("shared-storage")),
                    COURSE_SMOKE_TEST="1", COURSE_DATA_DIR=small_mnist, PYTHONUNBUFFERED="1")
    for sizing in ("COURSE_NUM_WORKERS", "COURSE_USE_GPU", "COURSE_CPUS_PER_WORKER"):  # the defaults are under test
        env.pop(sizing, None)
    return env


@pytest.fixture(scope="module")
def worker_node_ids(course_env: dict[str, str]) -> set[str]:
    """The ids of the cluster's nodes that have CPUs (the two worker nodes; the head has none)."""
    code = ("import json, ray; ray.init(); "
            "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Resources'].get('CPU')]))")
    result = run_driver(code, {**course_env, "RAY_AUTH_MODE": "token"})
    assert result.returncode == 0, result.stderr[-3000:]
    return set(last_json_line(result.stdout))


def test_setup_joins_with_the_token_sizes_per_node_and_ships_helpers(course_env: dict[str, str]) -> None:
    # From notebooks/, where a notebook's kernel runs. Ray puts the driver's current folder on its workers' sys.path
    # (ray/_private/worker.py, _py_driver_sys_path), and on this one machine every node would find the checkout's
    # `helpers` in the repository root; on a real cluster that folder does not exist on the other nodes.
    result = subprocess.run([sys.executable, "-c", SETUP_DRIVER], env=course_env, cwd=REPO_ROOT / "notebooks",
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    printed = out.rsplit("\n", 2)[0]  # setup()'s lines, shown whole when a check fails
    assert "token auth   : on: Ray requires its token (this kernel's from RAY_AUTH_TOKEN)" in out, printed
    assert "cluster      : 2 CPUs, 0 GPUs, 3 node(s) with (0 CPU), (1 CPU), (1 CPU)" in out, printed
    assert "workers      : 2 x (1 CPU): the default on CPU (no GPU in the cluster)" in out, printed
    found = last_json_line(out)
    assert (found["num_workers"], found["use_gpu"]) == (2, False)
    for node in found["helpers"]:  # imported on each worker node from the package Ray shipped, not the checkout
        assert "runtime_resources" in node["file"] and "py_modules_files" in node["file"], node
        assert not node["file"].startswith(str(REPO_ROOT)), node
        assert len(node["py_modules"]) == 1 and node["py_modules"][0].startswith("gcs://_ray_pkg_"), node


#: Lesson 05's section 07 on a cluster: setup(), one spot node added and removed, what the cluster saw, as JSON.
SPOT_DRIVER = """
import json, ray, psutil
from helpers import setup
from helpers.fault_tolerance import SpotNodes
from helpers.system import wait_until

setup()
spot = SpotNodes()
node_id = spot.add()
temp_dir = str(spot._nodes[node_id])
joined = ray.cluster_resources().get("spot", 0)
spot.remove()
gone = wait_until(lambda: not any(node["Alive"] for node in ray.nodes() if node["NodeID"] == node_id), 60, 0.5)
left = [proc.pid for proc in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(proc.info["cmdline"] or [])]
print(json.dumps({"joined": joined, "gone": gone, "left": left, "events": [e["event"] for e in spot.events],
                  "alive": sum(node["Alive"] for node in ray.nodes())}))
"""


def test_a_spot_node_joins_the_cluster_with_its_token_and_leaves_it(course_env: dict[str, str]) -> None:
    # Lesson 05's SpotNodes from a driver of this cluster, as from a notebook on its head node: the node joins through
    # the GCS address and the driver's token, and ending it leaves no process behind and the other three nodes alive.
    result = run_driver(SPOT_DRIVER, course_env, timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = last_json_line(result.stdout)
    assert found == {"joined": 1.0, "gone": True, "left": [], "events": ["node joined", "node left"], "alive": 3}


#: setup() with no RAY_ADDRESS, then what the course made of the cluster it found, as JSON.
RECORDED_DRIVER = """
import json, os
from helpers import setup
from helpers.session import PREEMPTION_WATCHER_VAR

cfg = setup()
print(json.dumps({"ray_address": cfg.ray_address, "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                  "preemption_watcher": os.environ.get(PREEMPTION_WATCHER_VAR)}))
"""


def test_setup_joins_the_cluster_ray_start_recorded_as_a_cluster(cluster: LocalCluster) -> None:
    # No RAY_ADDRESS: a plain ray.init() joins the cluster that `ray start --head` recorded, and so does setup(), but
    # as a joined cluster (the token sent, Ray Train's preemption watcher left on), saying where the address came from.
    # The file `ray start` wrote goes where Ray looks for it, in a private RAY_TMPDIR: never /tmp/ray, which is shared.
    ray_tmpdir = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        recorded = ray_tmpdir / "ray" / "ray_current_cluster"
        recorded.parent.mkdir()
        shutil.copy(cluster.temp_dir / "ray_current_cluster", recorded)
        env = clean_env(RAY_AUTH_TOKEN=cluster.token, RAY_TMPDIR=str(ray_tmpdir), COURSE_SMOKE_TEST="1")
        env.pop(PREEMPTION_WATCHER_VAR, None)  # as in a fresh kernel (setup() in this process may have set it)
        result = run_driver(RECORDED_DRIVER, env)
    finally:
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    printed = out.rsplit("\n", 2)[0]  # setup()'s lines, shown whole when a check fails
    assert out.startswith("mode "), printed  # nothing before setup()'s rows: the recorded cluster answered
    assert f", connected to {cluster.address} (recorded by `ray start` in {recorded}) in " in out, printed
    assert "token auth   : on: Ray requires its token (this kernel's from RAY_AUTH_TOKEN)" in out, printed
    assert "cluster      : 2 CPUs, 0 GPUs, 3 node(s)" in out, printed
    assert last_json_line(out) == {"ray_address": cluster.address, "auth_mode": "token", "preemption_watcher": None}


def start_script(script: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    """Run one of the course's scripts, as the README does, from the repository root: 1 epoch in smoke mode."""
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "notebooks" / script), "--epochs", "1", "--smoke-test",
                             *args], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def check_run(script: subprocess.Popen, storage: Path, prefix: str, num_workers: int, worker_node_ids: set[str],
              checkpoints: int = 1) -> Path:
    """The script trained `num_workers` workers on as many worker nodes, with its run folder on the shared storage,
    holding `checkpoints` checkpoints; returns the run folder. `prefix`: the run's name, or what it starts with."""
    stdout, stderr = script.communicate(timeout=600)
    assert script.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert f"workers ran on {num_workers} node(s)" in stdout
    (run,) = [run for run in storage.glob(f"{prefix}*") if f"{run.name}/checkpoint_" in stdout]
    assert len(list(run.glob("checkpoint_*/model.pt"))) == checkpoints
    nodes = read_history(str(run)).iloc[-1]["worker_nodes"]  # reported from inside the training function
    assert len(nodes) == num_workers and len(set(nodes)) == num_workers, "two workers shared a node"
    assert set(nodes) <= worker_node_ids, "a worker ran on the head, which has no CPU"
    return run


# Lesson 02's script runs on clusters in tests/test_autoscaling.py (1 worker, on a node the autoscaler adds) and
# tests/test_jobs.py (as a job), and fails on a node without the data below; a 1-worker run sized from the
# cluster's total CPUs (which fits no node) is test_cluster.py's sizing test.
RAY_DATA_SCRIPT = "train_ray_ddp_with_ray_data.py"
#: What a resumed run must reproduce of the run without a failure, epoch by epoch.
COMPARED = ["epoch", "train_loss", "test_loss", "test_acc"]


@pytest.fixture(scope="module")
def uninterrupted_run(course_env: dict[str, str], worker_node_ids: set[str]) -> Path:
    """Lesson 03's script (lesson 05's resumable loop) for 2 epochs on both worker nodes, without a failure."""
    storage = Path(course_env["COURSE_STORAGE_PATH"])
    # Every CPU to training: the datasets must be materialized, or it hangs.
    return check_run(start_script(RAY_DATA_SCRIPT, course_env, "--num-workers", "2", "--epochs", "2"), storage,
                     RAY_DATA_SCRIPT.removesuffix(".py"), 2, worker_node_ids, checkpoints=2)


def test_lesson_03_s_script_trains_on_two_worker_nodes(course_env: dict[str, str], uninterrupted_run: Path) -> None:
    # The Parquet copy, written by the run's Ray Data tasks on the worker nodes, lies on the shared storage.
    assert len(list(Path(course_env["COURSE_STORAGE_PATH"]).glob("datasets/mnist-parquet/*/*/*.parquet"))) == 16


def test_a_script_stopped_with_ctrl_c_continues_by_name_to_the_uninterrupted_metrics(
        course_env: dict[str, str], worker_node_ids: set[str], uninterrupted_run: Path) -> None:
    # Lesson 05 section 05 on a cluster. By default Ray Data gives each rank the blocks on its own node, and which node
    # each rank lands on changes from run to run: the continued run then trained its ranks on other rows and ended
    # with other metrics. The script's DataConfig(enable_shard_locality=False) splits the blocks in order instead.
    storage, name = Path(course_env["COURSE_STORAGE_PATH"]), "lesson05-ctrl-c"
    stopped = start_script(RAY_DATA_SCRIPT, course_env, "--num-workers", "2", "--epochs", "2", "--name", name)
    press_ctrl_c_when_checkpointed(stopped, storage / name, epoch=0, timeout_s=600)
    _, stderr = stopped.communicate(timeout=600)
    assert stopped.returncode != 0 and latest_checkpoint_metrics(str(storage / name))["epoch"] == 0, stderr[-3000:]
    continued = check_run(start_script(RAY_DATA_SCRIPT, course_env, "--num-workers", "2", "--epochs", "2",
                                       "--name", name), storage, name, 2, worker_node_ids, checkpoints=2)
    history, reference = read_history(str(continued)), read_history(str(uninterrupted_run))
    reports = history[history["event"] == "report"].reset_index(drop=True)
    assert list(reports["start_epoch"]) == [0, 1], "the second start did not continue at epoch 1"
    assert reports[COMPARED].equals(reference[reference["event"] == "report"][COMPARED].reset_index(drop=True))


def test_a_node_without_the_data_stops_the_script_with_the_courses_error(course_env: dict[str, str]) -> None:
    # The worker, on a worker node, cannot find MNIST nor create the folder to download it into.
    done = start_script("train_ray_ddp.py", {**course_env, "COURSE_DATA_DIR": "/proc/course-data"},
                        "--num-workers", "1")
    stdout, stderr = done.communicate(timeout=600)
    assert done.returncode != 0
    assert "error: MNIST is not in /proc/course-data/MNIST/raw on node " in stderr, stderr[-3000:]
    assert "COURSE_DATA_DIR" in stderr and "Traceback" not in stderr.split("error: MNIST")[-1]


#: Lesson 11's script: a search of `--num-samples` trials, each a Ray Train run of 2 workers.
TUNE_SCRIPT = "tune_ray_ddp.py"
#: Trials in its search on the cluster, all at once: one per worker node. (Lesson 11 stops a search mid-way and
#: restores it, the trials it had not finished going on; here the script continues a search by its name.)
NUM_SAMPLES = 2


@pytest.fixture(scope="module")
def continued_search(course_env: dict[str, str]) -> dict:
    """Lesson 11's script on the cluster, 2 trials at a time, then run again under the same name: each run's
    output, each trial's state and result.json lines between the two, and the search's folder."""
    storage, name = Path(course_env["COURSE_STORAGE_PATH"]), "lesson11-search"
    command = [sys.executable, str(REPO_ROOT / "notebooks" / TUNE_SCRIPT), "--smoke-test",
               "--num-samples", str(NUM_SAMPLES), "--max-concurrent-trials", "2", "--name", name]
    first = subprocess.run(command, env=course_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    state = search_state(str(storage / name))
    lines_before = {trial: [json.loads(line) for line in path.read_text().splitlines()]
                    for trial, path in result_files(storage / name).items()}
    second = subprocess.run(command, env=course_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    return {"first": first, "second": second, "state": state, "before": lines_before, "folder": storage / name,
            "storage": storage, "name": name}


def result_files(search: Path) -> dict[str, Path]:
    """Each trial's result.json in a search's folder, by trial id (Tune names the folder after it)."""
    return {TRIAL_ID_IN_FOLDER.search(path.parent.name).group(1): path for path in search.glob("*/result.json")}


def test_a_search_run_again_by_name_continues_without_running_finished_trials_again(continued_search: dict) -> None:
    for run in (continued_search["first"], continued_search["second"]):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "continuing the search" not in continued_search["first"].stdout
    assert f"continuing the search {continued_search['name']}" in continued_search["second"].stdout
    state = continued_search["state"]
    assert len(state) == NUM_SAMPLES and set(state["status"]) == {"TERMINATED"}, state
    after = {trial: [json.loads(line) for line in path.read_text().splitlines()]
             for trial, path in result_files(continued_search["folder"]).items()}
    assert after == continued_search["before"] and len(after) == NUM_SAMPLES, "a finished trial ran again"
    assert set(search_state(str(continued_search["folder"]))["status"]) == {"TERMINATED"}


def test_the_search_s_trials_train_on_both_worker_nodes_with_checkpoints_on_the_shared_storage(
        continued_search: dict, worker_node_ids: set[str]) -> None:
    results = [json.loads(line) for path in result_files(continued_search["folder"]).values()
               for line in path.read_text().splitlines()]
    assert {result["node_id"] for result in results} == worker_node_ids, "two trials at once: one per worker node"
    storage, name = continued_search["storage"], continued_search["name"]
    for trial in result_files(continued_search["folder"]):
        run = storage / f"{name}-{trial}"  # the trial's Ray Train run, beside the search's folder
        assert list(run.glob("checkpoint_*/model.pt")), f"no checkpoint of trial {trial} in {run}"
    assert all(Path(result["checkpoint_path"]).is_relative_to(storage) for result in results)


def test_the_best_checkpoint_loads_and_reproduces_its_accuracy(continued_search: dict,
                                                               course_env: dict[str, str]) -> None:
    import torch
    from ray.train import Checkpoint
    from torch.utils.data import DataLoader, Subset

    from helpers.data import load_mnist
    from helpers.inference import load_model
    from helpers.training import evaluate
    from helpers.tuning import SMOKE_SEARCH_ROWS

    # The best trial's best checkpoint as its run kept it: an epoch that ended while Ctrl-C stopped the trials is in
    # the run's checkpoints only, and may have replaced (num_to_keep) the checkpoint Tune's last result names.
    stdout = continued_search["second"].stdout
    best = re.search(r"^its best checkpoint: epoch \d+, test_acc=([\d.]+), (.+)$", stdout, re.MULTILINE)
    assert best, stdout[-3000:]
    reported, path = float(best.group(1)), best.group(2)
    model = load_model(Checkpoint(path))
    # The rows the trials validated on: the first SMOKE_SEARCH_ROWS["valid"] test images, in file order.
    test_images = Subset(load_mnist(course_env["COURSE_DATA_DIR"], train=False), range(SMOKE_SEARCH_ROWS["valid"]))
    with torch.no_grad():
        accuracy = evaluate(model, DataLoader(test_images, batch_size=256), "cpu")["accuracy"]
    assert abs(accuracy - reported) < 1e-3, f"the best checkpoint gives {accuracy:.4f}, the search reported {reported}"


#: Lesson 12's script: FSDP2, each rank writing its own shard of every checkpoint (torch.distributed.checkpoint).
FSDP_SCRIPT = "train_fsdp.py"


@pytest.fixture(scope="module")
def fsdp_run(course_env: dict[str, str]) -> Path:
    """Lesson 12's script on both worker nodes for 2 epochs: its run folder. (Continuing a run from its sharded
    checkpoint is lesson 12's own run, under nbval; on this cluster every node reads the one local folder.)"""
    storage, name = Path(course_env["COURSE_STORAGE_PATH"]), "lesson12-fsdp"
    script = start_script(FSDP_SCRIPT, course_env, "--num-workers", "2", "--epochs", "2", "--name", name)
    stdout, stderr = script.communicate(timeout=600)
    assert script.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return storage / name


def test_lesson_12_s_script_writes_every_rank_s_shard_from_both_worker_nodes(
        fsdp_run: Path, worker_node_ids: set[str]) -> None:
    checkpoints = sorted(path for path in fsdp_run.glob("checkpoint_*") if path.is_dir())
    assert len(checkpoints) == 2, "one checkpoint per epoch"
    for checkpoint in checkpoints:  # each rank uploaded its own shard into the one folder
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "progress.json"} <= {
            path.name for path in checkpoint.iterdir()}, checkpoint
    reports = read_history(str(fsdp_run)).query("event == 'report'")
    assert list(reports["epoch"]) == [0, 1]
    assert reports["train_loss"].iloc[-1] < reports["train_loss"].iloc[0], "the second epoch did not learn"
    for epoch, nodes in zip(reports["epoch"], reports["worker_nodes"]):  # reported from inside the loop
        assert len(nodes) == 2 and set(nodes) == worker_node_ids, f"epoch {epoch}: {nodes}"


def test_the_sharded_checkpoint_gathered_whole_reproduces_the_run_s_accuracy(
        fsdp_run: Path, course_env: dict[str, str]) -> None:
    # The loop's evaluate_shard counts every row of "valid" (the first 1000 test images in smoke mode), split across
    # the ranks, with the sharded model: a model gathered from the wrong shards would not score the same.
    import torch
    from ray.train import Checkpoint
    from torch.utils.data import DataLoader, Subset

    from helpers.data import load_mnist
    from helpers.ingest import SMOKE_ROWS
    from helpers.sharding import load_unsharded
    from helpers.sizes import sized
    from helpers.training import evaluate

    last = read_history(str(fsdp_run)).query("event == 'report'").iloc[-1]
    model = load_unsharded(Checkpoint(str(fsdp_run / last["checkpoint"])), sized("fsdp_model", True))
    test_images = Subset(load_mnist(course_env["COURSE_DATA_DIR"], train=False), range(SMOKE_ROWS["valid"]))
    with torch.no_grad():
        accuracy = evaluate(model, DataLoader(test_images, batch_size=500), "cpu")["accuracy"]
    # One image more or less right is 1e-3; the run's all-reduced sum may differ from this count in the last bits.
    assert accuracy == pytest.approx(last["test_acc"], abs=1e-9), \
        f"the gathered model gives {accuracy}, the run reported {last['test_acc']}"


def test_lesson_09_s_job_trains_on_the_cluster_and_keeps_its_best_two_checkpoints_and_the_latest(
        cluster: LocalCluster, course_env: dict[str, str]) -> None:
    # Lesson 09 section 09 on a cluster: the job the learner submits, with the notebooks' folder as its working dir and
    # helpers as a py_module, its settings in env_vars; its driver on the head, its workers and Ray Data on the nodes.
    from ray.job_submission import JobSubmissionClient

    from helpers.capstone import follow_job, kept_by_rule
    from helpers.config import load_config

    storage, name = Path(course_env["COURSE_STORAGE_PATH"]), "lesson09-job"
    client = JobSubmissionClient(cluster.dashboard_url,
                                 headers={"Authorization": f"Bearer {cluster.token_file.read_text()}"})
    submission_id = client.submit_job(
        entrypoint=f"python train_capstone.py --name {name} --epochs 3",
        runtime_env={"working_dir": str(REPO_ROOT / "notebooks"), "py_modules": [str(REPO_ROOT / "helpers")],
                     "env_vars": {"COURSE_STORAGE_PATH": str(storage), "COURSE_SMOKE_TEST": "1",
                                  "COURSE_DATA_DIR": str(load_config().data_dir)}})  # CIFAR-10's offline subset
    status = follow_job(client, submission_id, timeout_s=600)
    logs = client.get_job_logs(submission_id)
    assert status == "SUCCEEDED", logs[-3000:]
    reports = read_history(str(storage / name)).query("event == 'report'")
    assert list(reports["epoch"]) == [0, 1, 2] and reports["kept"].iloc[-1], "Ray Train keeps the latest checkpoint"
    assert reports["kept"].sum() == len(list((storage / name).glob("checkpoint_*/train_state.pt"))) in (2, 3)
    assert kept_by_rule(reports), "the best 2 by test accuracy, and the latest"
    best = reports[reports["kept"]]["test_acc"].max()
    assert re.search(rf"best checkpoint: epoch \d, test_acc={best:.4f}, {re.escape(str(storage / name))}/checkpoint_",
                     logs), logs[-2000:]

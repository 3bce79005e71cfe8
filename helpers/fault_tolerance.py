"""Lesson 05's training loop: lesson 03's loop, made to survive failures; and the failures the lesson causes.

The loop saves everything it needs to go on (weights, optimizer state, epoch) in every checkpoint and, when
it starts, continues from `ray.train.get_checkpoint()`: after Ray Train restarted the workers because
one failed, or when you start the same run (same `RunConfig` name and storage path) again.
The numbered comments mark what changed from lesson 03's `helpers.ingest.train_loop_per_worker`.

The failures stay out of the loop: `with_failure` wraps it to raise once on one rank, `kill_worker_when_checkpointed`
kills a worker process, and `press_ctrl_c_when_checkpointed` stops a training script as Ctrl-C would.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pandas as pd
import psutil
import ray
import ray.train
import ray.train.torch
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.util.state import list_actors
from torch import nn

from helpers.ingest import DTYPES, evaluate_shard
from helpers.models import resnet18_mnist
from helpers.results import latest_checkpoint_metrics, read_history
from helpers.system import end_processes, processes_naming, wait_until
from helpers.tooling import ray_internals


class InjectedFailure(RuntimeError):
    """The failure lesson 05 causes on purpose, to watch Ray Train recover from it."""


def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray Train worker; resumes from the run's latest checkpoint when there is one."""
    ray.train.torch.enable_reproducibility(config["seed"])  # [1] seeds, and deterministic algorithms on GPUs too
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    batch_size_per_worker = config["global_batch_size"] // world_size
    train_shard = ray.train.get_dataset_shard("train")
    valid_shard = ray.train.get_dataset_shard("valid")

    model, optimizer_state, start_epoch = resnet18_mnist(), None, 0
    checkpoint = ray.train.get_checkpoint()  # [2] None on a fresh start, else the run's latest checkpoint
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:  # [3] weights, optimizer state and epoch
            model.load_state_dict(torch.load(Path(checkpoint_dir) / "model.pt", map_location="cpu"))
            state = torch.load(Path(checkpoint_dir) / "train_state.pt", map_location="cpu")
        optimizer_state, start_epoch = state["optimizer"], state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)  # DDP starts from the restored weights on every worker
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    if optimizer_state:
        optimizer.load_state_dict(optimizer_state)  # [4] Adam's running averages too, not only the weights
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(start_epoch, config["num_epochs"]):  # [5] go on after the checkpoint's epoch
        model.train()
        started_at, total_loss, num_images = time.time(), 0.0, 0
        batches = train_shard.iter_torch_batches(batch_size=batch_size_per_worker, dtypes=DTYPES,
                                                 device=ray.train.torch.get_device(),
                                                 prefetch_batches=config["prefetch_batches"],
                                                 local_shuffle_buffer_size=config["shuffle_buffer"],
                                                 local_shuffle_seed=config["seed"] + epoch)  # a resumed epoch: same order
        for batch in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch["label"])
            num_images += len(batch["label"])
        epoch_s = time.time() - started_at

        plain_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        valid = evaluate_shard(plain_model, valid_shard, batch_size=512)
        metrics = {"epoch": epoch, "train_loss": total_loss / num_images, "test_loss": valid["loss"],
                   "test_acc": valid["accuracy"], "epoch_s": epoch_s,
                   "images_per_s": num_images * world_size / epoch_s,
                   "node_id": ray.get_runtime_context().get_node_id(),
                   "start_epoch": start_epoch}  # [6] where the attempt that trained this epoch began
        with tempfile.TemporaryDirectory() as checkpoint_dir:
            checkpoint = None
            if rank == 0:
                torch.save(plain_model.state_dict(), Path(checkpoint_dir) / "model.pt")  # as before: for inference
                torch.save({"optimizer": optimizer.state_dict(), "epoch": epoch},  # [7] what resuming needs
                           Path(checkpoint_dir) / "train_state.pt")
                checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
            ray.train.report(metrics, checkpoint=checkpoint)


class _FailingShard:
    """A dataset shard that raises InjectedFailure as it hands out batch `step` of pass `epoch` (both from 0)."""

    def __init__(self, shard, epoch: int, step: int, rank: int):
        self._shard, self._epoch, self._step, self._rank, self._passes = shard, epoch, step, rank, 0

    def iter_torch_batches(self, **kwargs):
        this_pass, self._passes = self._passes, self._passes + 1
        for step, batch in enumerate(self._shard.iter_torch_batches(**kwargs)):
            if (this_pass, step) == (self._epoch, self._step):
                raise InjectedFailure(f"rank {self._rank} fails on purpose at epoch {this_pass}, step {step}")
            yield batch

    def __getattr__(self, name: str):
        return getattr(self._shard, name)


def with_failure(train_loop: Callable[[dict], None], epoch: int, step: int, rank: int) -> Callable[[dict], None]:
    """`train_loop` with one failure injected, its code unchanged: in the run's first attempt (no checkpoint yet),
    the "train" shard of rank `rank` raises InjectedFailure as it hands out batch `step` of epoch `epoch`.

    The restarted attempt starts from a checkpoint and runs through. `epoch` must be 1 or more: a failure in epoch 0
    comes before any checkpoint, so the restarted attempt would start without one and fail again.
    """
    if epoch < 1 or step < 0 or rank < 0:
        raise ValueError(f"with_failure needs epoch >= 1 (a checkpoint to resume from), step >= 0 and rank >= 0; "
                         f"got epoch={epoch}, step={step}, rank={rank}")

    @functools.wraps(train_loop)
    def loop_with_failure(config: dict) -> None:
        if ray.train.get_checkpoint() is not None or ray.train.get_context().get_world_rank() != rank:
            return train_loop(config)  # a restarted attempt, or another rank: the loop as it is
        get_dataset_shard = ray.train.get_dataset_shard

        def failing_get_dataset_shard(name: str):
            shard = get_dataset_shard(name)
            return _FailingShard(shard, epoch, step, rank) if name == "train" else shard

        ray.train.get_dataset_shard = failing_get_dataset_shard  # what the loop calls, in this worker process only
        try:
            return train_loop(config)
        finally:
            ray.train.get_dataset_shard = get_dataset_shard

    return loop_with_failure


def _when_checkpointed(run_path: str | Path, epoch: int, action: Callable[[], object], timeout_s: float) -> threading.Event:
    """Call `action` in a background thread once the run has registered the checkpoint of `epoch`.
    Returns an Event: set it to call the watch off."""
    cancelled = threading.Event()

    def checkpointed() -> bool:
        try:
            latest = latest_checkpoint_metrics(run_path)
        except json.JSONDecodeError:  # Ray Train is rewriting its snapshot file: read it again next time
            latest = None
        return bool(latest and latest["epoch"] >= epoch)

    def watch() -> None:
        try:
            wait_until(lambda: cancelled.is_set() or checkpointed(), timeout_s, 0.2, sleep=cancelled.wait)
        except TimeoutError:
            return  # as when called off: the run never registered that checkpoint
        if cancelled.is_set():
            return
        try:
            action()
        except Exception as error:  # a thread's exception would vanish: say what went wrong
            print(f"{action.__name__} failed: {type(error).__name__}: {error}", file=sys.stderr)

    threading.Thread(target=watch, name=f"when-checkpointed-{action.__name__}", daemon=True).start()
    return cancelled


def press_ctrl_c_when_checkpointed(driver: subprocess.Popen, run_path: str | Path, epoch: int,
                                   timeout_s: float = 3600) -> threading.Event:
    """Send `driver`, a training script's process, SIGINT (what Ctrl-C sends in a terminal) once its run has
    registered the checkpoint of `epoch`: the driver stops mid-run. Returns an Event: set it to call the watch off."""
    def ctrl_c() -> None:
        driver.send_signal(signal.SIGINT)

    return _when_checkpointed(run_path, epoch, ctrl_c, timeout_s)


@ray.remote(num_cpus=0)  # runs even while the training workers hold every CPU
def _send_sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def kill_worker_process() -> dict:
    """SIGKILL the process of one running Ray Train worker, as a crash or the out-of-memory killer would.

    The signal is sent by a task placed on the worker's node, so this works on a cluster too.
    Returns the worker's pid and node id.
    """
    workers = list_actors(address=ray.get_runtime_context().gcs_address,  # this driver's cluster, not another
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    if not workers:
        raise RuntimeError("no Ray Train worker is running")
    worker = workers[-1]
    if worker.pid is None or worker.node_id is None:  # an ALIVE actor has both
        raise RuntimeError(f"the Ray Train worker {worker.actor_id} has no process or node yet")
    sigkill_on_its_node(worker.pid, worker.node_id)
    return {"pid": worker.pid, "node_id": worker.node_id}


def sigkill_on_its_node(pid: int, node_id: str) -> None:
    """SIGKILL process `pid` of node `node_id`: at once on this machine, else by a task placed on that node."""
    if node_id == ray.get_runtime_context().get_node_id():
        os.kill(pid, signal.SIGKILL)
    else:
        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        ray.get(_send_sigkill.options(scheduling_strategy=strategy).remote(pid))


def kill_worker_when_checkpointed(run_path: str | Path, epoch: int, timeout_s: float = 3600) -> threading.Event:
    """SIGKILL one Ray Train worker process once the run has registered the checkpoint of `epoch`: a process
    dies in the middle of the next epoch. Returns an Event: set it to call the watch off."""
    return _when_checkpointed(run_path, epoch, kill_worker_process, timeout_s)


# --- Section 07: an elastic run, with nodes that join and leave ---------------------------------------------------

#: The custom resource each pretend spot node has one of: the elastic run's workers ask for it, so they run there only.
SPOT_RESOURCE = "spot"
#: A pretend spot node's object store: enough for the batches its worker reads (Ray's minimum is 75 MiB).
SPOT_OBJECT_STORE_BYTES = 256 * 1024**2
#: How long one `ray start` may take (about 5 s on a 2-core machine, more while it trains).
SPOT_START_TIMEOUT_S = 120


def _this_machine_addresses() -> set[str]:
    """The IP addresses of this machine's interfaces, loopback included."""
    return {address.address for addresses in psutil.net_if_addrs().values() for address in addresses
            if address.family in (socket.AF_INET, socket.AF_INET6)} | {"localhost"}


class SpotNodes:
    """Ray nodes that join this driver's cluster and leave it on demand, as spot nodes do: each a `ray start
    --address=<GCS>` on this machine with `cpus` CPUs, no GPU and one `spot` resource, in a temp dir of its own.

    `remove` ends a node's processes (found by its temp dir), as a cloud taking the machine back would; the cluster's
    other nodes, and any other Ray on the machine, are left alone. `close()` removes those still running (also at exit).
    `events` records when each node joined and left. The driver must run on a node of the cluster (a local Ray, or the
    head node of a cluster): the nodes join from this machine.
    """

    #: The instances not closed yet, oldest first.
    _open: list[SpotNodes] = []

    def __init__(self, cpus: int = 1):
        if not ray.is_initialized():
            raise RuntimeError("SpotNodes joins this driver's Ray: call setup() (or ray.init()) first.")
        self.cpus = cpus
        self.gcs_address = ray.get_runtime_context().gcs_address
        host = self.gcs_address.rsplit(":", 1)[0].strip("[]")
        if host not in _this_machine_addresses():
            raise RuntimeError(f"The cluster's GCS ({self.gcs_address}) is on another machine: SpotNodes starts nodes "
                               "on this one. Run this section on the cluster's head node (where the GCS runs).")
        #: One row per node joining or leaving: time, event, node_id.
        self.events: list[dict] = []
        self._nodes: dict[str, Path] = {}  # node id -> its temp dir
        self._closed = False
        for earlier in SpotNodes._open:  # a cell run again: the nodes of its earlier run leave first
            earlier.close()
        SpotNodes._open.append(self)
        atexit.register(self.close)

    def add(self) -> str:
        """Start one node and wait until the cluster lists it; returns its node id."""
        before = {node["NodeID"] for node in ray.nodes()}
        # Short on purpose: the node's socket paths live under it, and Unix sockets allow about 100 characters.
        temp_dir = Path(tempfile.mkdtemp(prefix="spot-", dir="/tmp"))
        # The address is given; a token travels as this driver's does (RAY_AUTH_MODE=token: the file or variable Ray reads).
        env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
        command = [str(Path(sys.executable).parent / "ray"), "start", f"--address={self.gcs_address}",
                   f"--num-cpus={self.cpus}", "--num-gpus=0", f"--resources={json.dumps({SPOT_RESOURCE: 1})}",
                   f"--object-store-memory={SPOT_OBJECT_STORE_BYTES}", "--dashboard-agent-listen-port=0",
                   f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        try:
            done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=SPOT_START_TIMEOUT_S, start_new_session=True)
            if done.returncode != 0:
                raise RuntimeError(f"`ray start` of a spot node failed (exit code {done.returncode}):\n"
                                   f"{(done.stdout + done.stderr)[-2000:]}")
            node_id = wait_until(lambda: next((node["NodeID"] for node in ray.nodes() if node["Alive"]
                                               and node["NodeID"] not in before
                                               and SPOT_RESOURCE in node["Resources"]), None),
                                 60, 0.5, what="the spot node in the cluster's list")
        except BaseException:
            _end_processes(temp_dir)
            raise
        if self._closed:  # closed while this node started (a watch thread's add, after the run ended)
            _end_processes(temp_dir)
            raise RuntimeError("SpotNodes was closed while a node started: the node was ended.")
        self._nodes[node_id] = temp_dir
        self.events.append({"time": time.time(), "event": "node joined", "node_id": node_id})
        return node_id

    def remove(self, node_id: str | None = None) -> str:
        """End one node's processes (the latest added when `node_id` is None); returns its node id."""
        if not self._nodes:
            raise RuntimeError("No spot node is running.")
        node_id = node_id or list(self._nodes)[-1]
        _end_processes(self._nodes.pop(node_id))
        self.events.append({"time": time.time(), "event": "node left", "node_id": node_id})
        return node_id

    def add_when_checkpointed(self, run_path: str | Path, epoch: int, timeout_s: float = 3600) -> threading.Event:
        """Add a node once the run has registered the checkpoint of `epoch`. Returns an Event: set it to call it off."""
        return _when_checkpointed(run_path, epoch, self.add, timeout_s)

    def remove_when_checkpointed(self, run_path: str | Path, epoch: int, timeout_s: float = 3600) -> threading.Event:
        """Remove the latest node once the run has registered the checkpoint of `epoch`."""
        return _when_checkpointed(run_path, epoch, self.remove, timeout_s)

    def close(self) -> None:
        """Remove every node still running, and any that a watch starts later; idempotent."""
        self._closed = True
        atexit.unregister(self.close)
        if self in SpotNodes._open:
            SpotNodes._open.remove(self)
        while self._nodes:
            self.remove()


def _end_processes(temp_dir: Path) -> None:
    """End the processes of the node started in `temp_dir` (those naming it, and their children): SIGTERM, SIGKILL
    those left after 10 s; then delete the folder."""
    end_processes(processes_naming(re.compile(re.escape(str(temp_dir)) + r"(?![\w.-])")))
    shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_resize(train_loop: Callable[[dict], None], after: dict[int, int],
                    timeout_s: float = 180) -> Callable[[dict], None]:
    """`train_loop`, its code unchanged, pausing where a resize is expected, so that the run takes the same steps
    every time: after reporting epoch `e` with `after[e]` workers, each worker waits for Ray Train to stop its group
    (a resize, or a failure elsewhere), instead of starting the next epoch. On a real cluster a change lands
    mid-epoch and the restarted group trains that epoch again from the checkpoint; here it lands between epochs.
    A worker still waiting after `timeout_s` raises TimeoutError.
    """
    @functools.wraps(train_loop)
    def loop_waiting_for_resize(config: dict) -> None:
        report = ray.train.report

        def report_then_wait(metrics: dict, *args, **kwargs) -> None:
            report(metrics, *args, **kwargs)
            workers = ray.train.get_context().get_world_size()
            if metrics.get("epoch") in after and after[metrics["epoch"]] == workers:
                time.sleep(timeout_s)  # Ray Train ends this process when it stops the group
                raise TimeoutError(f"The group of {workers} worker(s) was not stopped within {timeout_s} s of "
                                   f"epoch {metrics['epoch']}'s report: no resize and no failure came.")

        ray.train.report = report_then_wait  # what the loop calls, in this worker process only
        try:
            return train_loop(config)
        finally:
            ray.train.report = report

    return loop_waiting_for_resize


#: What `elastic_timeline` keeps of Ray Train's controller log, as (pattern of the message, how the row says it).
CONTROLLER_DECISIONS = [
    (r"\[FailurePolicy\] (\w+)\s+Source: (worker group|controller|preemption)\s+Error count: (\d+) \(max allowed: (\S+)\)",
     "controller: {1} failure {2} of {3} allowed -> {0}"),
    (r"Deciding to resize the worker group from (\d+) -> (\d+)", "controller: resize {0} -> {1}"),
    (r"Detected ready resources for (\d+) workers.*Deciding to start/restart", "controller: (re)start with {0}"),
    (r"Started training worker group of size (\d+)", "controller: group of {0} started"),
    (r"startup timed out after ([\d.]+) seconds waiting for (\d+) workers", "controller: group of {1} not placed in {0} s"),
]


def controller_decisions(run_name: str) -> list[dict]:
    """The decisions Ray Train's controller logged for run `run_name` (its INFO lines and errors, kept in its log file
    on this node even at `LoggingConfig(log_level="WARNING")`), as timeline rows: time and event."""
    rows = []
    for file in sorted(Path(ray_internals.train_log_dir()).glob(ray_internals.TRAIN_CONTROLLER_LOGS)):
        for line in file.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a traceback's line
            if record.get("run_name") != run_name or record.get("levelname") == "DEBUG":
                continue
            for pattern, text in CONTROLLER_DECISIONS:
                if match := re.search(pattern, record.get("message", ""), re.DOTALL):
                    when = datetime.strptime(record["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
                    rows.append({"time": when, "event": text.format(*match.groups())})
                    break  # a retry's message quotes the error it retries
    return rows


def elastic_timeline(result: ray.train.Result, events: list[dict]) -> pd.DataFrame:
    """An elastic run's timeline, oldest first, in seconds since its first row: the nodes joining and leaving
    (`SpotNodes.events`), the controller's decisions (`controller_decisions`), and the run's reports, with the
    number of workers, and worker failures (its `MetricsHistory`)."""
    rows = [{"time": event["time"], "event": event["event"]} for event in events]
    rows += controller_decisions(Path(result.path).name)
    for row in read_history(result).to_dict("records"):
        if row["event"] == "report":
            rows.append({"time": row["time"], "event": "report", "workers": len(row["worker_nodes"]),
                         "epoch": row["epoch"], "start_epoch": row["start_epoch"]})
        elif row["event"] == "failure":
            rows.append({"time": row["time"], "event": f"worker failure (rank {int(row['rank'])}): "
                                                       f"{row['error'].split(':')[0]}"})
    timeline = pd.DataFrame(rows).sort_values("time", kind="stable", ignore_index=True)
    first = timeline["time"].min()
    timeline.insert(0, "s", (timeline.pop("time") - first).round(1))
    for column in ("workers", "epoch", "start_epoch"):
        timeline[column] = timeline[column].astype("Int64")  # blank, not NaN, where a row has none
    return timeline

"""Lesson 05's training loop: lesson 03's loop, made to survive failures; and the failures the lesson causes.

The loop saves everything it needs to go on (weights, optimizer state, epoch) in every checkpoint and, when
it starts, continues from `ray.train.get_checkpoint()`: after Ray Train restarted the workers because
one failed, or when you start the same run (same `RunConfig` name and storage path) again.
The numbered comments mark what changed from lesson 03's `helpers.ingest.train_loop_per_worker`.

The failures stay out of the loop: `with_failure` wraps it to raise once on one rank, `kill_worker_when_checkpointed`
kills a worker process, and `press_ctrl_c_when_checkpointed` stops a training script as Ctrl-C would.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.util.state import list_actors
from torch import nn

from helpers.ingest import DTYPES, evaluate_shard
from helpers.models import resnet18_mnist
from helpers.results import latest_checkpoint_metrics
from helpers.system import wait_until


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

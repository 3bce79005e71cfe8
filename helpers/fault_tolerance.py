"""Lesson 05's training loop: lesson 03's loop, made to survive failures.

It saves everything it needs to go on (weights, optimizer state, epoch) in every checkpoint and, when
it starts, continues from `ray.train.get_checkpoint()`: after Ray Train restarted the workers because
one failed, or when you start the same run (same `RunConfig` name and storage path) again.
The numbered comments mark what changed from lesson 03's `helpers.ingest.train_loop_per_worker`.
"""

from __future__ import annotations

import os
import signal
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
from helpers.training import seed_everything


class InjectedFailure(RuntimeError):
    """The failure lesson 05 causes on purpose, to watch Ray Train recover from it."""


def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray Train worker; resumes from the run's latest checkpoint when there is one.

    `config["fail_at"]`: None, or `(epoch, step, rank)` where that rank raises InjectedFailure, once:
    only in an attempt that started before that epoch (epoch >= 1), so the restarted attempt runs through.
    """
    seed_everything(config["seed"])
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    batch_size_per_worker = config["global_batch_size"] // world_size
    fail_at = tuple(config["fail_at"]) if config["fail_at"] else None
    train_shard = ray.train.get_dataset_shard("train")
    valid_shard = ray.train.get_dataset_shard("valid")

    model, optimizer_state, start_epoch = resnet18_mnist(), None, 0
    checkpoint = ray.train.get_checkpoint()  # [1] None on a fresh start, else the run's latest checkpoint
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:  # [2] weights, optimizer state and epoch
            model.load_state_dict(torch.load(Path(checkpoint_dir) / "model.pt", map_location="cpu"))
            state = torch.load(Path(checkpoint_dir) / "train_state.pt", map_location="cpu")
        optimizer_state, start_epoch = state["optimizer"], state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)  # DDP starts from the restored weights on every worker
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    if optimizer_state:
        optimizer.load_state_dict(optimizer_state)  # [3] Adam's running averages too, not only the weights
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(start_epoch, config["num_epochs"]):  # [4] go on after the checkpoint's epoch
        model.train()
        started_at, total_loss, num_images = time.time(), 0.0, 0
        batches = train_shard.iter_torch_batches(batch_size=batch_size_per_worker, dtypes=DTYPES,
                                                 device=ray.train.torch.get_device(),
                                                 prefetch_batches=config["prefetch_batches"],
                                                 local_shuffle_buffer_size=config["shuffle_buffer"],
                                                 local_shuffle_seed=config["seed"] + epoch)  # a resumed epoch: same order
        for step, batch in enumerate(batches):
            if fail_at == (epoch, step, rank) and start_epoch < epoch:  # [5] the lesson's failure, once
                raise InjectedFailure(f"rank {rank} fails on purpose at epoch {epoch}, step {step}")
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


def _when_checkpointed(run_path: str | Path, epoch: int, action: Callable[[], object], timeout_s: float) -> threading.Event:
    """Call `action` in a background thread once the run has registered the checkpoint of `epoch`.
    Returns an Event: set it to call the watch off."""
    cancelled = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not cancelled.is_set() and time.monotonic() < deadline:
            latest = latest_checkpoint_metrics(run_path)
            if latest and latest["epoch"] >= epoch:
                try:
                    action()
                except Exception as error:  # a thread's exception would vanish: say what went wrong
                    print(f"{action.__name__} failed: {type(error).__name__}: {error}", file=sys.stderr)
                return
            cancelled.wait(0.2)

    threading.Thread(target=watch, name=f"when-checkpointed-{action.__name__}", daemon=True).start()
    return cancelled


def interrupt_when_checkpointed(run_path: str | Path, epoch: int, timeout_s: float = 3600) -> threading.Event:
    """Interrupt this process (SIGINT, what Jupyter's Interrupt button sends) once the run has registered
    the checkpoint of `epoch`: the driver stops mid-run. Returns an Event: set it to call the watch off.
    """
    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    return _when_checkpointed(run_path, epoch, interrupt, timeout_s)


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
    if worker.node_id == ray.get_runtime_context().get_node_id():
        os.kill(worker.pid, signal.SIGKILL)  # on this machine: at once
    else:
        strategy = NodeAffinitySchedulingStrategy(node_id=worker.node_id, soft=False)
        ray.get(_send_sigkill.options(scheduling_strategy=strategy).remote(worker.pid))
    return {"pid": worker.pid, "node_id": worker.node_id}


def kill_worker_when_checkpointed(run_path: str | Path, epoch: int, timeout_s: float = 3600) -> threading.Event:
    """SIGKILL one Ray Train worker process once the run has registered the checkpoint of `epoch`: a process
    dies in the middle of the next epoch. Returns an Event: set it to call the watch off."""
    return _when_checkpointed(run_path, epoch, kill_worker_process, timeout_s)

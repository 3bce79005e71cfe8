"""Small training utilities every lesson reuses: seeding and evaluation (on one device, or split between workers)."""

from __future__ import annotations

import platform
import random
import time
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader


def loader_workers() -> int:
    """DataLoader worker processes for this Ray task or worker: on a GPU, the CPUs Ray reserved for it less one for the
    training loop; 0 (the DataLoader loads in the loop's own process) without a GPU, on one CPU, and outside Ray.

    While a GPU computes, the loop's process needs one CPU and the others can prepare the next batches. Without a GPU
    the model computes on the reserved CPUs (Ray sets OMP_NUM_THREADS to them), and loader processes would compete
    for the same cores. Ray neither sees nor limits a DataLoader's processes: more would use cores it promised others.
    """
    import ray

    if not _in_ray_worker():
        return 0
    assigned = ray.get_runtime_context().get_assigned_resources()
    return max(0, int(assigned.get("CPU", 0.0)) - 1) if assigned.get("GPU", 0.0) > 0 else 0


def has_a_gpu() -> bool:
    """In a Ray task or actor, whether Ray gave it a GPU (`num_gpus`): one that asked for none still sees the node's
    GPUs, and `torch.cuda.is_available()` would put it on a GPU it did not reserve. Elsewhere (this notebook's own
    process), whether torch sees one."""
    import ray

    return bool(ray.get_gpu_ids()) if _in_ray_worker() else torch.cuda.is_available()


def _in_ray_worker() -> bool:
    """Whether this process is a Ray task's or actor's worker (not a driver, and Ray is running)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, device: torch.device | str, max_batches: int | None = None
) -> dict[str, float]:
    """Mean cross-entropy loss and accuracy of `model` over the batches of `loader` (the first `max_batches`)."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct, count = 0.0, 0, 0
    for step, (images, labels) in enumerate(loader):
        if max_batches is not None and step >= max_batches:
            break
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        total_loss += loss_fn(logits, labels).item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        count += labels.numel()
    return {"loss": total_loss / count, "accuracy": correct / count}


@torch.no_grad()
def evaluate_distributed(model: nn.Module, batches: Iterable, device: torch.device | str) -> dict[str, float]:
    """Loss and accuracy over a test set split between workers, the same figures as `evaluate` on all of it.

    Each worker sums the loss, the correct predictions and the images of its own (images, labels) batches; an
    all-reduce adds up the sums of every worker. Without a process group (one device) the sums are this process's.
    """
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
    for images, labels in batches:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        totals[0] += loss_fn(logits, labels).double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)  # the sums over every worker's share, on every worker
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count, "images": int(count)}


@torch.no_grad()
def same_weights_on_every_rank(model: nn.Module) -> bool:
    """Whether every process of the group holds the same weights, DDP's promise after every step (True without a
    group). Each rank sums its weights in float64; an all-reduce of that sum's minimum and of its maximum compares
    them: DDP's ranks hold bit-identical weights, ranks that train apart drift after their first step."""
    if not torch.distributed.is_initialized():
        return True
    total = torch.stack([parameter.detach().double().sum() for parameter in model.parameters()]).sum()
    low, high = total.clone(), total.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    return bool(low == high)


def train_for(model: nn.Module, optimizer: torch.optim.Optimizer, seconds: float, batch_size: int = 32) -> int:
    """Train `model` on random MNIST-shaped batches until `seconds` have passed, and return the number of steps: the
    work of an epoch, between two reports, without its data."""
    deadline, steps = time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline:
        images, labels = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        steps += 1
    return steps


@torch.no_grad()
def predict(model: nn.Module, images: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Predicted class of each image in a batch."""
    model.eval()
    return model(images.to(device)).argmax(dim=1).cpu()


def device_name(device: torch.device | str) -> str:
    """What a device is, for results tables: the GPU's name, or the CPU's model and the threads torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    return f"CPU: {model} ({threads} thread{'s' if threads > 1 else ''})"

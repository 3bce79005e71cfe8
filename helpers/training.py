"""Small training utilities every lesson reuses: seeding and evaluation."""

from __future__ import annotations

import platform
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader


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

"""Measurements lesson 06's troubleshooting labs use: time blocked on data, memory an autograd graph keeps."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn


def time_blocked_on_data(batches: Iterable[dict], step_s: float) -> dict[str, float]:
    """Run a stand-in training loop over `batches`: each step takes `step_s` seconds (say, on a GPU).

    Returns the images per second, the seconds until the first batch arrived, and the share of the loop's
    time spent waiting for batches: near 0 when data keeps up, near 1 when the loop is starved.
    """
    waited, first_batch_s, num_images, started = 0.0, None, 0, time.perf_counter()
    iterator = iter(batches)
    while True:
        asked = time.perf_counter()
        batch = next(iterator, None)
        waited += time.perf_counter() - asked
        if first_batch_s is None:
            first_batch_s = waited
        if batch is None:
            break
        time.sleep(step_s)  # the training step, which does not need the CPU
        num_images += len(batch["label"])
    total = time.perf_counter() - started
    return {"images_per_s": num_images / total, "first_batch_s": first_batch_s, "blocked_share": waited / total,
            "seconds": total}


def activation_bytes(model: nn.Module, images: torch.Tensor) -> int:
    """Bytes of activations autograd keeps for `backward()` after one forward pass of `images`.

    Counts the tensors saved for the backward pass that are not the model's own parameters. They stay
    in memory until `backward()` runs, or for as long as something refers to the output's graph.
    """
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    total = 0

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in parameters:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(images)
    return total


def graph_size(value: object) -> int:
    """How many autograd nodes `value` keeps alive: 0 for a Python number or a tensor without a graph."""
    root = getattr(value, "grad_fn", None)
    seen, stack = set(), [root] if root is not None else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(parent for parent, _ in node.next_functions if parent is not None)
    return len(seen)

"""Measurements lesson 06's troubleshooting labs use: a data iterator's own clock, memory an autograd graph keeps."""

from __future__ import annotations

import re

import torch
from torch import nn

#: The lines of a Ray Data iterator's `stats()` that `iterator_times` reads, by the key it returns them under.
ITERATOR_LINES = {
    "total_s": "Total time overall",
    "initialize_s": "Total time in Ray Data iterator initialization code",
    "blocked_s": "Total time user thread is blocked by Ray Data iter_batches",
    "first_batch_s": "Total time spent waiting for the first batch after starting iteration",
    "user_s": "Total execution time for user thread",
}
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def iterator_times(stats: str) -> dict[str, float]:
    """Seconds from a Ray Data iterator's `stats()` text: total, initialization, blocked, first batch, user code.

    Ray Data prints these times as text ("9.12s", "101.97ms") and leaves out a line whose time is still 0: such
    a key is 0.0 here. A shard iterator's times add up over every pass (epoch) made with it so far.
    """
    times = dict.fromkeys(ITERATOR_LINES, 0.0)
    for key, label in ITERATOR_LINES.items():
        found = re.search(rf"{re.escape(label)}: ([\d.]+)(us|ms|s)\b", stats)
        if found:
            times[key] = float(found.group(1)) * _UNITS[found.group(2)]
    return times


def activation_bytes(model: nn.Module, images: torch.Tensor) -> int:
    """Bytes of activations autograd keeps for `backward()` after one forward pass of `images`.

    Counts the storages of the tensors saved for the backward pass, each storage once (views, in-place
    results and a tensor saved by two operations share one), leaving out the model's parameters. They stay
    in memory until `backward()` runs, or for as long as something refers to the output's graph.
    """
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        output = model(images)  # kept until the count is done: its graph keeps the saved storages alive
        total = sum(storages.values())
    del output
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

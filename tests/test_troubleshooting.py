"""helpers.troubleshooting: the measurements lesson 06's labs rely on."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from helpers.models import resnet18_mnist
from helpers.troubleshooting import activation_bytes, graph_size, time_blocked_on_data


def test_activation_memory_grows_with_the_batch_and_vanishes_without_grad():
    model = resnet18_mnist()
    per_16, per_32 = activation_bytes(model, torch.zeros(16, 1, 28, 28)), activation_bytes(model, torch.zeros(32, 1, 28, 28))
    assert per_32 == pytest.approx(2 * per_16, rel=0.01), "activations are per image"
    assert 8e6 < per_16 < 10e6, "ResNet-18 on MNIST keeps about 0.55 MB per image"
    with torch.no_grad():
        assert activation_bytes(model, torch.zeros(16, 1, 28, 28)) == 0


def test_graph_size_counts_what_a_kept_loss_holds():
    weight = nn.Parameter(torch.ones(3))
    total = 0.0
    sizes = []
    for _ in range(3):
        loss = (weight * 2).sum()
        loss.backward()
        total = total + loss
        sizes.append(graph_size(total))
    assert sizes[0] < sizes[1] < sizes[2], "each kept step adds its graph"
    assert graph_size(loss.item()) == 0 and graph_size(loss.detach()) == 0


def _batches(count: int, delay_s: float):
    for _ in range(count):
        time.sleep(delay_s)
        yield {"label": [0] * 8}


def test_time_blocked_on_data_tells_a_starved_loop_from_a_fed_one():
    starved = time_blocked_on_data(_batches(5, delay_s=0.05), step_s=0.0)
    fed = time_blocked_on_data([{"label": [0] * 8}] * 5, step_s=0.05)
    assert starved["blocked_share"] > 0.9 and fed["blocked_share"] < 0.1
    assert starved["first_batch_s"] >= 0.05 and fed["first_batch_s"] < 0.01
    assert fed["images_per_s"] == pytest.approx(40 / fed["seconds"])

"""Lesson 12's pieces that run without Ray: micro-batches, the bytes a worker holds, the memory meter and its budget,
and reading a sharded (DCP) checkpoint back into one plain model.

Its loop trains on a real multi-node cluster in tests/test_multinode.py (train_fsdp.py, 2 workers on 2 nodes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from helpers.sharding import (
    MIB,
    MemoryBudgetError,
    MemoryMeter,
    ResidualMLP,
    is_sharded,
    load_unsharded,
    local_bytes,
    micro_batches,
    one_process_group,
)

MODEL = {"width": 32, "depth": 2}


def test_micro_batches_group_consecutive_batches_and_drop_a_short_last_group():
    assert list(micro_batches(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(micro_batches(range(4), 1)) == [[0], [1], [2], [3]]
    assert list(micro_batches(range(2), 4)) == []
    assert list(micro_batches(iter(range(4)), 2)) == [[0, 1], [2, 3]], "any iterable: Ray Data's batches are one"


def test_local_bytes_counts_each_tensor_s_elements_at_its_size():
    tensors = [torch.zeros(10), torch.zeros(3, 4, dtype=torch.float16), None, torch.zeros(5, dtype=torch.int64)]
    assert local_bytes(tensors) == 10 * 4 + 12 * 2 + 5 * 8
    assert local_bytes(iter(tensors)) == 104 and local_bytes([]) == 0


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, meter: MemoryMeter, batch_size: int) -> None:
    images, labels = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    with meter:
        loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()


def measured(batch_size: int, checkpoint_activations: bool = False) -> dict[str, int]:
    torch.manual_seed(0)
    network = ResidualMLP(**MODEL, checkpoint_activations=checkpoint_activations)
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    meter = MemoryMeter(network, optimizer)
    train_step(network, optimizer, meter, batch_size)
    return meter.held_bytes()


def test_memory_meter_counts_activations_and_not_the_weights_autograd_keeps():
    small, large = measured(batch_size=2), measured(batch_size=32)
    params = sum(p.numel() * 4 for p in ResidualMLP(**MODEL).parameters())
    assert small["params"] == large["params"] == params and small["grads"] == params
    assert small["optimizer"] == 2 * params, "AdamW's two moments per parameter; its step counters are not counted"
    # Linear and LayerNorm keep their weights for backward: counted, they alone would be more than `params`.
    assert 0 < small["activations"] < params / 4, small
    assert large["activations"] > 8 * small["activations"], "activations grow with the batch, weights do not"
    recomputed = measured(batch_size=32, checkpoint_activations=True)
    assert recomputed["activations"] < large["activations"], "with recompute, each block keeps only its input"


def test_memory_budget_on_cpu_raises_with_the_budget_in_the_message():
    network = ResidualMLP(**MODEL)
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    params_mib = local_bytes(network.parameters()) / MIB
    budget = round(params_mib / 2, 2)  # less than the weights alone
    with pytest.raises(MemoryBudgetError, match=rf"more than its budget of {budget:g} MiB"):
        train_step(network, optimizer, MemoryMeter(network, optimizer, budget_mb=budget), batch_size=4)
    generous = MemoryMeter(network, optimizer, budget_mb=1000 * params_mib)
    for _ in range(2):  # the second step with gradients and optimizer state held
        train_step(network, optimizer, generous, batch_size=4)
    assert generous.activations_bytes > 0


def test_load_unsharded_reads_a_sharded_checkpoint_into_one_plain_model(tmp_path):
    torch.manual_seed(0)
    images = torch.randn(4, 1, 28, 28)
    with one_process_group():  # one rank in this process, as Ray Train's gloo group on a CPU worker
        model = ResidualMLP(**MODEL)
        for block in model.blocks:  # as the loop does: each block, then the root
            fully_shard(block)
        fully_shard(model)
        assert is_sharded(model) and all(hasattr(p, "to_local") for p in model.parameters())
        initial = model.head.weight.full_tensor().clone()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, optimizer, MemoryMeter(model, optimizer), batch_size=8)  # weights and optimizer state moved
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp_path))
        full = {name: tensor.full_tensor().clone() for name, tensor in model.state_dict().items()}
        with torch.no_grad():
            expected = model(images)
    loaded = load_unsharded(Checkpoint.from_directory(str(tmp_path)), MODEL)  # no group, as after training
    assert not is_sharded(loaded) and not loaded.training
    assert sorted(loaded.state_dict()) == sorted(full)
    for name, tensor in loaded.state_dict().items():
        assert not hasattr(tensor, "to_local") and torch.equal(tensor, full[name]), name
    assert not torch.equal(full["head.weight"], initial), "the step changed the weights the checkpoint holds"
    with torch.no_grad():
        assert torch.allclose(loaded(images), expected, atol=1e-6)

"""Lesson 12's FSDP2 training: a model built of identical blocks, the loop that shards it with `fully_shard`, and
what the lesson measures about it (the bytes each worker holds, the activations kept for backward, a memory budget).

Lesson 12 defines `train_loop_per_worker` in a cell the learner edits; this copy is the one `train_fsdp.py` imports,
and tests/test_lesson_code.py fails when the two differ. The numbered comments mark what changed from lesson 05's
resumable DDP loop (`helpers.fault_tolerance.train_loop_per_worker`).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint as recompute

from helpers.cluster import cluster_capacity
from helpers.ingest import DTYPES, evaluate_shard

#: The bytes of one MiB: every memory figure of the lesson is in MiB.
MIB = 2**20
#: What a report's memory figures are, in the order of the lesson's tables.
COMPONENTS = ("params", "grads", "optimizer", "activations")


class Block(nn.Module):
    """One residual MLP block, a transformer block without attention: LayerNorm, Linear up 4x, GELU, Linear down."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """MNIST classifier of `depth` identical blocks of `width` features: the shape of the models FSDP is for.

    With `checkpoint_activations`, each block keeps only its input for backward and runs its forward again there.
    """

    def __init__(self, width: int, depth: int, checkpoint_activations: bool = False):
        super().__init__()
        self.embed = nn.Linear(28 * 28, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)
        self.checkpoint_activations = checkpoint_activations

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images.flatten(1))
        for block in self.blocks:
            x = recompute(block, x, use_reentrant=False) if self.checkpoint_activations else block(x)
        return self.head(self.norm(x)).float()  # float32 logits for the loss, also under bf16


def num_parameters(model: nn.Module) -> int:
    """The parameters of the whole model, sharded or not."""
    return sum(p.numel() for p in model.parameters())


def fsdp_workers(num_workers: int) -> tuple[bool, dict[str, float], str]:
    """`use_gpu`, `resources_per_worker` and why, for `num_workers` sharded workers on this cluster: one GPU each when
    it has that many GPUs (NCCL runs one rank per GPU), else CPU workers with an equal share of the cluster's CPUs."""
    nodes = cluster_capacity().nodes
    gpus = sum(math.floor(node.get("GPU", 0.0)) for node in nodes)
    if gpus >= num_workers:
        return True, {"GPU": 1.0}, f"{num_workers} GPU workers, one GPU each ({gpus} in the cluster)"
    cpus = sum(node.get("CPU", 0.0) for node in nodes)
    share = math.floor(cpus / num_workers) or math.floor(cpus / num_workers * 100) / 100
    why = f"NCCL needs one GPU per rank and the cluster has {gpus}" if gpus else "the cluster has no GPU"
    return False, {"CPU": share}, f"{num_workers} CPU workers of {share:g} CPU each: {why}"


# --- What a worker holds ---------------------------------------------------------------------------------------

def local_bytes(tensors) -> int:
    """The bytes of these tensors that this process holds: a sharded tensor (DTensor) counts its local shard."""
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def unsharded_gradient_bytes(model: nn.Module) -> int:
    """The bytes of the whole (unsharded) gradients FSDP2 keeps on this rank while gradient sync is off.

    FSDP2 accumulates them on its parameters' unsharded copies (torch's FSDPParam, a private class: read here only
    to measure, and 0 when a torch release changes it).
    """
    storages: dict[int, int] = {}  # each tensor once, by its storage
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", []):
                for param in group.fsdp_params:
                    for grad in (getattr(param, "unsharded_accumulated_grad", None),
                                 getattr(getattr(param, "_unsharded_param", None), "grad", None)):
                        if grad is not None:
                            storages[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return sum(storages.values())


class MemoryBudgetError(RuntimeError):
    """A worker's tensors outgrew its memory budget on a CPU: the out-of-memory error a GPU of that size raises."""


class MemoryMeter:
    """Counts the bytes autograd keeps for backward during the forward passes inside `with meter:`, and holds the
    worker to a memory budget of `budget_mb` MiB (None: no budget).

    `activations_bytes` is the most kept at once over the passes measured, each tensor once, the model's weights left
    out (also FSDP's gathered copies, which backward gathers again). The budget: on a GPU, this process's share of
    the card is capped (`torch.cuda.set_per_process_memory_fraction`) and CUDA raises `torch.OutOfMemoryError` past
    it; on a CPU, every tensor kept for backward adds up the rank's parameters, gradients, optimizer state and the
    activations so far, and raises MemoryBudgetError when they exceed the budget.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, budget_mb: float | None = None) -> None:
        self.model, self.optimizer, self.budget_mb = model, optimizer, budget_mb
        self.activations_bytes = self.grads_bytes = 0
        self._storages: dict[int, int] = {}
        self._device = next(iter(model.parameters())).device
        if budget_mb is not None and self._device.type == "cuda":
            total = torch.cuda.get_device_properties(self._device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_mb * MIB / total), self._device)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.grads_bytes = max(self.grads_bytes, self._gradient_bytes())  # also those kept between micro-batches
        local = local_tensor(tensor)
        if local.device.type != "meta":
            storage = local.untyped_storage()
            weights = {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}
            if storage.data_ptr() not in weights:
                self._storages[storage.data_ptr()] = storage.nbytes()
                if self.budget_mb is not None and self._device.type != "cuda":
                    self._check_budget()
        return tensor

    def _gradient_bytes(self) -> int:
        """The gradients this rank holds now: its slices' (`p.grad`), and the whole gradients FSDP2 keeps
        unsharded while gradient sync is off, until the micro-batch that reduce-scatters them."""
        return local_bytes(p.grad for p in self.model.parameters()) + unsharded_gradient_bytes(self.model)

    def held_bytes(self) -> dict[str, int]:
        """The most bytes of parameters, gradients, optimizer state and activations this rank has held."""
        state = [value for entry in self.optimizer.state.values() for value in entry.values()
                 if torch.is_tensor(value) and value.dim() > 0]  # Adam's step counters are scalars
        return {"params": local_bytes(self.model.parameters()),
                "grads": max(self.grads_bytes, self._gradient_bytes()), "optimizer": local_bytes(state),
                "activations": max(self.activations_bytes, sum(self._storages.values()))}

    def _check_budget(self) -> None:
        held = self.held_bytes()
        if self.budget_mb is not None and sum(held.values()) > self.budget_mb * MIB:
            parts = ", ".join(f"{name} {size / MIB:.1f}" for name, size in held.items())
            raise MemoryBudgetError(f"out of memory: this worker's tensors need {sum(held.values()) / MIB:.1f} MiB "
                                    f"({parts}), more than its budget of {self.budget_mb:g} MiB")

    def __enter__(self) -> MemoryMeter:
        self._storages = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self.activations_bytes = max(self.activations_bytes, sum(self._storages.values()))


def memory_per_rank(model: nn.Module, meter: MemoryMeter) -> dict[str, float]:
    """The MiB of parameters, gradients, optimizer state and activations a rank holds between steps, each the largest
    over all ranks (the rank that needs most decides whether a run fits); on a GPU also the peak CUDA allocated."""
    if isinstance(model, FSDPModule):
        model.reshard()  # the root stays gathered after an eval forward: count what each rank keeps between steps
    device = meter._device
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    figures = torch.tensor([*meter.held_bytes().values(), peak], dtype=torch.float64, device=device) / MIB
    if dist.is_initialized():
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return dict(zip((*COMPONENTS, "peak"), figures.tolist()))


def micro_batches(batches, accumulation_steps: int) -> Iterator[list]:
    """Groups of `accumulation_steps` consecutive batches, one group per optimizer step; a short last group is
    dropped, so every step sees the same number of images."""
    group: list = []
    for batch in batches:
        group.append(batch)
        if len(group) == accumulation_steps:
            yield group
            group = []


# --- The loop lesson 12 teaches ---------------------------------------------------------------------------------

def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray Train worker: ResidualMLP sharded with FSDP2 (`config["fsdp"]`) or replicated with DDP."""
    ray.train.torch.enable_reproducibility(config["seed"])
    world_size, rank = ray.train.get_context().get_world_size(), ray.train.get_context().get_world_rank()
    accumulation_steps = config["accumulation_steps"]
    batch_size_per_worker = config["global_batch_size"] // (world_size * accumulation_steps)  # [1]
    train_shard, valid_shard = ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("valid")

    device = ray.train.torch.get_device()
    model = ResidualMLP(**config["model"]).to(device)  # every rank builds the whole model, once
    if config["fsdp"]:
        mesh = init_device_mesh(device.type, (world_size,))  # [2] the ranks, on this worker's device type
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if config["bf16"] else None,
                                      reduce_dtype=torch.float32)  # [3] gather and compute in bf16
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)  # [4] each block: a slice per rank, gathered alone
        fully_shard(model, mesh=mesh, mp_policy=policy)  # [4] the root: embed, norm and head
    else:
        model = ray.train.torch.prepare_model(model)  # lesson 02's DDP: a whole copy on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])

    start_epoch, checkpoint = 0, ray.train.get_checkpoint()
    if checkpoint:  # [5] every rank reads its own slices of the weights and optimizer state
        model_state, optimizer_state = get_state_dict(model, optimizer)
        with checkpoint.as_directory() as checkpoint_dir:
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint_dir)
            start_epoch = json.loads((Path(checkpoint_dir) / "progress.json").read_text())["epoch"] + 1
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    for epoch in range(start_epoch, config["num_epochs"]):
        model.train()
        batches = train_shard.iter_torch_batches(batch_size=batch_size_per_worker, dtypes=DTYPES, device=device,
                                                 local_shuffle_buffer_size=config["shuffle_buffer"],
                                                 local_shuffle_seed=config["seed"] + epoch)
        meter = MemoryMeter(model, optimizer, config["memory_budget_mb"])  # [6] bytes held, and a budget
        step_s, total_loss = [], 0.0
        for step, group in enumerate(micro_batches(batches, accumulation_steps)):
            if step == config["steps_per_epoch"]:
                break
            started = time.perf_counter()
            for i, batch in enumerate(group):
                if config["fsdp"]:
                    model.set_requires_gradient_sync(i == len(group) - 1)  # [7] reduce-scatter once per step
                with meter:  # [6] counts what autograd keeps for backward
                    loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"]) / len(group)
                loss.backward()
                total_loss += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # [6] keep the gradients, to count them below
            step_s.append(time.perf_counter() - started)

        valid = evaluate_shard(model, valid_shard, batch_size=512)
        metrics = {"epoch": epoch, "start_epoch": start_epoch, "train_loss": total_loss / len(step_s),
                   "test_loss": valid["loss"], "test_acc": valid["accuracy"], "step_s": step_s,
                   "node_id": ray.get_runtime_context().get_node_id(), **memory_per_rank(model, meter)}
        with tempfile.TemporaryDirectory() as checkpoint_dir:  # [8] every rank writes its slices
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint_dir)
            if rank == 0:
                (Path(checkpoint_dir) / "progress.json").write_text(json.dumps({"epoch": epoch}))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir))  # [8] every rank


# --- After training -----------------------------------------------------------------------------------------------

def load_unsharded(checkpoint: Checkpoint, model_config: dict) -> ResidualMLP:
    """The model of a sharded (DCP) checkpoint, whole, in this process, in eval mode: the shards of every rank read
    into one plain `ResidualMLP`, without a process group."""
    model = ResidualMLP(**model_config)
    state = {"model": model.state_dict()}
    with checkpoint.as_directory() as checkpoint_dir, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no process group: what we want here
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)  # only the "model" entries, in this process
    model.load_state_dict(state["model"])
    return model.eval()


def is_sharded(model: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model`."""
    return isinstance(model, FSDPModule)


def sharded_parameters(model: nn.Module) -> list[str]:
    """The names of `model`'s parameters that `fully_shard` split into slices (DTensors)."""
    return [name for name, parameter in model.named_parameters() if hasattr(parameter, "to_local")]


def block_input_dtype(model: ResidualMLP) -> torch.dtype:
    """The dtype the first block's first layer computes in, in a forward pass of two blank images."""
    seen: list[torch.dtype] = []
    first_layer: nn.Module = model.blocks[0].up  # type: ignore[assignment]
    hook = first_layer.register_forward_pre_hook(lambda _module, inputs: seen.append(inputs[0].dtype))
    try:
        model(torch.zeros(2, 1, 28, 28))
    finally:
        hook.remove()
    return seen[0]


def gradient_sync(model: nn.Module) -> bool | str:
    """Whether the FSDP2 units of `model` will reduce-scatter their gradients at the next backward: True (all),
    False (none) or "some units only" (`set_requires_gradient_sync(..., recurse=False)` changes the root's alone)."""
    states = {group.reduce_grads for module in model.modules() if isinstance(module, FSDPModule)
              for group in module._get_fsdp_state()._fsdp_param_groups}
    return states.pop() if len(states) == 1 else "some units only"


def accumulation_trace(train_step: Callable[[nn.Module, torch.optim.Optimizer, list], None],
                       model_config: dict, num_micro_batches: int = 4) -> dict:
    """Runs `train_step(model, optimizer, group)` once on a sharded ResidualMLP in a process group of this process,
    with `num_micro_batches` micro-batches of 8 images, and returns what it did: the units' gradient sync at each
    backward (`sync`, see `gradient_sync`), the optimizer steps it took, and whether the gradient at the first step
    equals the whole batch's."""
    torch.manual_seed(0)
    group = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))) for _ in range(num_micro_batches)]
    reference = ResidualMLP(**model_config)
    with one_process_group():
        model = ResidualMLP(**model_config)
        model.load_state_dict(reference.state_dict())
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        trace: dict = {"sync": [], "optimizer_steps": 0, "gradients": None}

        def at_backward(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
            if output.requires_grad:  # the hook runs when backward starts, with the sync it will use
                output.register_hook(lambda grad: trace["sync"].append(gradient_sync(model)))

        step = optimizer.step

        def recording_step(*args, **kwargs):
            trace["optimizer_steps"] += 1
            if trace["gradients"] is None:
                trace["gradients"] = {name: parameter.grad.full_tensor().clone() for name, parameter
                                      in model.named_parameters() if parameter.grad is not None}
            return step(*args, **kwargs)

        model.register_forward_hook(at_backward)
        optimizer.step = recording_step  # type: ignore[method-assign]
        train_step(model, optimizer, group)
    images, labels = torch.cat([images for images, _ in group]), torch.cat([labels for _, labels in group])
    nn.functional.cross_entropy(reference(images), labels).backward()
    expected = {name: parameter.grad for name, parameter in reference.named_parameters() if parameter.grad is not None}
    got = trace.pop("gradients") or {}
    trace["gradient_matches"] = got.keys() == expected.keys() and all(
        torch.allclose(got[name], expected[name], rtol=1e-4, atol=1e-6) for name in expected)
    return trace


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A process group of this process alone (gloo, world size 1), for running `fully_shard` outside Ray Train."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

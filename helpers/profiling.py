"""Where the time of one training step goes: `torch.profiler` on every rank of a Ray Train run, read as phases.

Lesson 10's profiled loop labels each phase of a step with `record_function` (`PHASES`) and hands the profiler a
`StepTrace` as its `on_trace_ready`. `StepTrace` turns the profiled steps into milliseconds per phase and keeps the
Chrome trace (open it in https://ui.perfetto.dev); `gather_ranks` brings every rank's phases to rank 0.
`training_flops_per_image` counts a model's FLOPs per training image, which lesson 10 sets against the device's
FLOP/s. The rest is what the lesson does not teach: the models and batches its runs profile, and its tables.

The phases are read on the CPU's timeline. On a GPU the kernels run asynchronously after the CPU launches them:
lesson 10's loop profiles with `ProfilerActivity.CUDA` there and waits for the GPU at each step's end. Each step
then also gets `device_busy`, the time the GPU ran anything, and NCCL's all-reduce is read from its kernels; the
GPU's rows of the trace show where it waited.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import DeviceType
from torch.utils.data import DataLoader, Dataset

from helpers.training import has_a_gpu

#: The labels the profiled loop gives the phases of a step, in order.
PHASES = ("data_wait", "forward", "backward", "optimizer")
#: The columns of a step's split, in order; they add up to the step.
PARTS = ("data_wait", "forward", "backward", "allreduce_wait", "optimizer", "other")
#: The events of a gradient all-reduce: gloo's (CPU) or NCCL's, as torch's process group records them.
ALLREDUCE = re.compile(r"^(gloo|nccl):all_reduce")
#: NCCL's all-reduce kernels on the device. On NCCL the CPU's `nccl:all_reduce` range covers the launch only.
DEVICE_ALLREDUCE = re.compile(r"^nccl(Dev)?Kernel_AllReduce")
#: The autograd engine's work on the gradients, one event per backward function.
AUTOGRAD = "autograd::engine::evaluate_function"


def _within(event, start: float, end: float) -> bool:
    return start <= event.time_range.start and event.time_range.end <= end


def _union_ms(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Milliseconds within [start, end] covered by at least one of `intervals` (microseconds)."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    covered, reach = 0.0, start
    for a, b in clipped:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered / 1e3


def _exposed_ms(intervals: list[tuple[float, float]], others: list[tuple[float, float]], start: float,
                end: float) -> float:
    """Milliseconds within [start, end] covered by `intervals` while none of `others` ran."""
    return _union_ms(intervals + others, start, end) - _union_ms(others, start, end)


def step_phases(events: list) -> list[dict[str, float]]:
    """Milliseconds of each part of every profiled step (`profiler.events()`), one dict per step.

    The labelled ranges give `data_wait`, `forward`, `backward` and `optimizer`; `other` is what no label covers.
    Under DDP, all-reduces run in a background thread while the backward pass computes: `allreduce_total` is the
    time any all-reduce ran during the step, and `allreduce_wait` the part of it after the autograd engine's last
    gradient, when the step can only wait (it is taken out of `backward`). A trace with the device's activity
    (`ProfilerActivity.CUDA`) adds `device_busy`: the milliseconds of the step in which the device ran a kernel or
    a copy (NCCL's kernels too, which occupy it while they wait for the other ranks). Its share of the step is how
    busy the GPU was. With NCCL's all-reduce kernels in the trace, the all-reduce is read on the device instead:
    `allreduce_total` is the time they ran, `allreduce_wait` the part of it after the CPU's last phase when no other
    kernel ran; the CPU waits for it at the step's end, so `other` is that wait less `allreduce_wait`, and `backward`
    keeps the CPU's launches.
    """
    # With ProfilerActivity.CUDA the trace also holds the device's side: its kernels and copies, and the labels
    # again as GPU annotations. The phases are the CPU's; `device_busy` is the time the device ran anything.
    on_device = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    device = [(e.time_range.start, e.time_range.end) for e in on_device]
    device_allreduces = [(e.time_range.start, e.time_range.end) for e in on_device if DEVICE_ALLREDUCE.match(e.name)]
    device_others = [(e.time_range.start, e.time_range.end) for e in on_device if not DEVICE_ALLREDUCE.match(e.name)]
    events = [e for e in events if e.device_type == DeviceType.CPU]
    steps = sorted((e for e in events if e.name.startswith("ProfilerStep")), key=lambda e: e.time_range.start)
    if not steps:
        raise ValueError("No profiled steps: call profiler.step() after every step, inside `with profile(...)`.")
    allreduces = [(e.time_range.start, e.time_range.end) for e in events if ALLREDUCE.match(e.name)]
    rows = []
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        inside = [e for e in events if _within(e, start, end)]
        missing = [phase for phase in PHASES if not any(e.name == phase for e in inside)]
        if missing:
            raise ValueError(f"A profiled step has no {missing} range: label every phase with record_function.")
        ms = {phase: sum(e.time_range.elapsed_us() for e in inside if e.name == phase) / 1e3 for phase in PHASES}
        backward = next(e for e in inside if e.name == "backward")
        computed = [e.time_range.end for e in inside if e.name.startswith(AUTOGRAD)
                    and _within(e, backward.time_range.start, backward.time_range.end)]
        last_gradient = max(computed, default=backward.time_range.end)
        if device_allreduces:  # NCCL: the all-reduce's kernels, and their time alone on the device once the CPU
            # has launched everything (before that, a starved GPU's NCCL time overlaps the CPU's phases)
            launched = max(e.time_range.end for e in inside if e.name in PHASES)
            ms["allreduce_wait"] = _exposed_ms(device_allreduces, device_others, launched, end)
            ms["allreduce_total"] = _union_ms(device_allreduces, start, end)
        else:  # gloo: the CPU's all-reduce after the last gradient, taken out of backward
            ms["allreduce_wait"] = _union_ms(allreduces, last_gradient, backward.time_range.end)
            ms["backward"] -= ms["allreduce_wait"]
            ms["allreduce_total"] = _union_ms(allreduces, start, end)
        ms["step"] = step.time_range.elapsed_us() / 1e3
        ms["other"] = ms["step"] - sum(ms[part] for part in PARTS if part != "other")
        if device:  # the device's busy milliseconds within the CPU's step (kernels may finish after it)
            ms["device_busy"] = _union_ms(device, start, end)
        rows.append(ms)
    return rows


_kineto_started = False


def start_kineto_quietly() -> None:
    """Start Kineto, torch.profiler's library, once in this process with its stderr muted.

    Kineto prints "ERROR: External init callback must run in same thread as registerClient" when a profiler first
    starts in another thread than the one that imported torch, which is where Ray Train runs the training function.
    The callback it then skips (`LibKinetoClient::init` in torch) only starts a memory profiler for MTIA, Meta's
    accelerator: on CPUs and CUDA GPUs the line is noise. It is a `fprintf` to the stderr file, so no log level
    hides it; an empty profile with that file pointed at /dev/null starts Kineto without it.
    """
    global _kineto_started
    if _kineto_started:
        return
    # Kineto starts once per process, for the activities of its first profile: the GPU's too where there is one
    activities = [torch.profiler.ProfilerActivity.CPU]
    if has_a_gpu():  # in a Ray worker: one Ray gave it (a CPU worker on a GPU machine sees every GPU)
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with torch.profiler.profile(activities=activities):
            pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    _kineto_started = True


class StepTrace:
    """A profiler's `on_trace_ready`: keeps the profiled steps' phases (`steps`, `phases`) and the Chrome trace.

    The trace goes to `<folder>/trace-rank<rank>.json.gz` (a temporary folder unless given). Creating one starts
    Kineto quietly (`start_kineto_quietly`).
    """

    def __init__(self, folder: str | Path | None = None):
        start_kineto_quietly()
        self.folder = Path(folder or tempfile.mkdtemp(prefix="trace-"))
        self.steps: list[dict[str, float]] = []
        self.path: Path | None = None

    def __call__(self, profiler: torch.profiler.profile) -> None:
        self.steps = step_phases(profiler.events())
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.path = self.folder / f"trace-rank{rank}.json.gz"
        profiler.export_chrome_trace(str(self.path))

    @property
    def phases(self) -> dict[str, float]:
        """Mean milliseconds of each part over the profiled steps (means, so that the parts add up to the step)."""
        if not self.steps:
            raise RuntimeError("The profiler has not finished a cycle: run warmup + active steps inside it.")
        mean = {key: statistics.fmean(step[key] for step in self.steps) for key in self.steps[0]}
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "steps": len(self.steps), **mean}


def gather_ranks(value: object) -> list:
    """Every rank's `value`, in rank order, on every rank (an all-gather); `[value]` without a process group."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# --- What the lesson's runs train on ---------------------------------------------------------------------------

def build_model(name: str) -> nn.Module:
    """One of the course's models by name: `resnet18_mnist`, `vit_cifar10` (12 layers) or `vit_cifar10_small`."""
    from helpers.cifar import vit_cifar10
    from helpers.models import resnet18_mnist

    builders: dict[str, Callable[[], nn.Module]] = {
        "resnet18_mnist": resnet18_mnist, "vit_cifar10": vit_cifar10, "vit_cifar10_small": lambda: vit_cifar10(True)}
    if name not in builders:
        raise ValueError(f"Unknown model {name!r}: choose from {', '.join(builders)}.")
    return builders[name]()


class CifarImages(Dataset):
    """CIFAR-10 rows as uint8 (32, 32, 3) images, each passed through `transform` when it is read."""

    def __init__(self, root: str, transform: Callable):
        from helpers.cifar import read_split

        self.split, self.transform = read_split(root, "train"), transform

    def __len__(self) -> int:
        return len(self.split["label"])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        # a writable copy: the pixels come from Arrow's read-only memory, and torch refuses to wrap that
        return self.transform(self.split["image"][index].copy()), int(self.split["label"][index])


def per_image_recipe(trivial_augment: bool = True) -> Callable[[np.ndarray], torch.Tensor]:
    """torchvision's usual CIFAR-10 training transforms, one image at a time: crop, flip, TrivialAugment, normalise.

    `trivial_augment=False`: lesson 09's crop and flip alone, image by image (its batches pad with the mean colour,
    these with black: the same work).
    """
    from torchvision.transforms import v2

    from helpers.cifar import CROP_PADDING, MEAN, STD

    policy = [v2.TrivialAugmentWide()] if trivial_augment else []
    return v2.Compose([v2.ToImage(), v2.RandomCrop(32, padding=CROP_PADDING), v2.RandomHorizontalFlip(), *policy,
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN.tolist(), STD.tolist())])


def augment_each_image(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data's `map_batches` form of `per_image_recipe`: the same transforms, image by image, in a Ray Data task."""
    recipe = per_image_recipe()
    batch["image"] = np.stack([recipe(image.copy()).numpy() for image in batch["image"]])
    return batch


def _endless(make: Callable[[], Iterator]) -> Iterator:
    while True:
        yield from make()


def batches(config: dict) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (images, labels) batches of this worker's share, from the source `config["data"]` names.

    `mnist` (lesson 02's DataLoader), one of `CIFAR_LOADERS` (in this process unless `config["loader_workers"]`),
    or `ray_data` (this worker's shard of the trainer's "train" dataset).
    """
    import ray.train
    import ray.train.torch

    world_size = ray.train.get_context().get_world_size()
    batch_size = config["global_batch_size"] // world_size
    source = config["data"]
    if source == "ray_data":
        shard = ray.train.get_dataset_shard("train")
        return _endless(lambda: ((b["image"], b["label"]) for b in shard.iter_torch_batches(
            batch_size=batch_size, dtypes={"image": torch.float32, "label": torch.int64},
            prefetch_batches=config.get("prefetch_batches", 1))))
    if source == "mnist":
        from helpers.data import load_mnist

        loader = DataLoader(load_mnist(config["data_dir"], train=True), batch_size=batch_size, shuffle=True)
    elif source in CIFAR_LOADERS:
        loader = cifar_loader(config["root"], source, batch_size, config.get("loader_workers", 0))
    else:
        raise ValueError(f"Unknown data {source!r}: choose from mnist, {', '.join(CIFAR_LOADERS)}, ray_data.")
    loader = ray.train.torch.prepare_data_loader(loader)
    return _endless(lambda: iter(loader))


#: The CIFAR-10 DataLoaders by name: lesson 09's (normalised once, cropped and flipped per batch), and two that
#: augment image by image, section 05's recipe and lesson 09's crop and flip.
CIFAR_LOADERS = ("cifar", "cifar_per_image", "cifar_crop_flip_per_image")


def cifar_loader(root: str, source: str, batch_size: int, loader_workers: int = 0) -> DataLoader:
    """A shuffled DataLoader of CIFAR-10's training split named by `source` (`CIFAR_LOADERS`); `loader_workers`
    processes run it beside the training process (0: in it)."""
    from helpers.cifar import CifarParquet, augmented_collate

    if source == "cifar":
        dataset: Any = CifarParquet(root, "train")  # a Dataset by its methods (no torch in cifar)
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=augmented_collate,
                          num_workers=loader_workers, persistent_workers=loader_workers > 0)
    if source not in CIFAR_LOADERS:
        raise ValueError(f"Unknown CIFAR-10 loader {source!r}: choose from {', '.join(CIFAR_LOADERS)}.")
    recipe = per_image_recipe(trivial_augment=source == "cifar_per_image")
    return DataLoader(CifarImages(root, recipe), batch_size=batch_size, shuffle=True, num_workers=loader_workers,
                      persistent_workers=loader_workers > 0)


def input_images_per_s(root: str, source: str, num_batches: int, batch_size: int = 128) -> float:
    """Images per second of a CIFAR-10 loader alone, no model, in this process: `num_batches` batches after one."""
    import time

    batches_of_loader = iter(cifar_loader(root, source, batch_size))
    next(batches_of_loader)  # the first batch: the split is read and the recipe's first call warms up
    start = time.perf_counter()
    for _ in range(num_batches):
        next(batches_of_loader)
    return num_batches * batch_size / (time.perf_counter() - start)


# --- Tables --------------------------------------------------------------------------------------------------------

def median_round(rounds: list[list[dict]]) -> list[dict]:
    """The round whose step (its slowest rank's) is the median of the rounds: every rank's phases in it."""
    by_step = sorted(rounds, key=lambda ranks: max(rank["step"] for rank in ranks))
    return by_step[(len(by_step) - 1) // 2]


def phase_table(runs: dict[str, list[list[dict]]]) -> pd.DataFrame:
    """One row per variant and rank: milliseconds per step of each part, in the variant's median round.

    `runs` maps a variant to its rounds, each round the list of every rank's `StepTrace.phases`. One round's parts,
    not each part's median over the rounds: a round's parts add up to its step, medians of parts do not.
    """
    rows = {}
    for variant, rounds in runs.items():
        for phases in median_round(rounds):
            label = variant if len(rounds[0]) == 1 else f"{variant} · rank {phases['rank']}"
            keys = (*PARTS, "step", "allreduce_total", *(["device_busy"] if "device_busy" in phases else []))
            rows[label] = {key: round(phases[key], 1) for key in keys}
    return pd.DataFrame(rows).T


def hidden_share(phases: pd.Series) -> float:
    """The share of a step's all-reduce time hidden behind other work: the backward pass on CPUs, other kernels on a
    GPU (`step_phases`)."""
    return 1 - phases["allreduce_wait"] / phases["allreduce_total"]


def images_per_s(rounds: list[list[dict]], global_batch_size: int) -> list[float]:
    """Images per second of each round: the global batch over the slowest rank's mean step (`StepTrace.phases`)."""
    return [global_batch_size / (max(rank["step"] for rank in ranks) / 1e3) for ranks in rounds]


def training_flops_per_image(model: nn.Module, image_shape: tuple[int, ...]) -> float:
    """FLOPs of one training step per image: the forward pass counted by torch, times 3 (backward is about 2x).

    Attention is counted as the matmuls it is: `FlopCounterMode` has no formula for `nn.MultiheadAttention`'s fused
    inference path nor for the CPU's fused attention kernel, and would count them as 0 FLOPs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            model.eval()(torch.zeros(2, *image_shape))
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    return 3 * counter.get_total_flops() / 2

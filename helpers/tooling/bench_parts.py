"""The benchmark's measurements (`python -m helpers.tooling.bench`, see its docstring): its three parts, `device`,
`ddp` and `data`, each run in rounds and returned as figures and comparisons (helpers.rounds)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers.config import load_config
from helpers.data import load_mnist
from helpers.models import resnet18_mnist
from helpers.profiling import training_flops_per_image
from helpers.rounds import compare, run_rounds, spread
from helpers.training import seed_everything
from helpers.troubleshooting import controller_records, startup_phases

GLOBAL_BATCH_SIZE = 128


# ---- the device part ----------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def loop_images_per_s(model: nn.Module, batches: Iterator, steps: int, warmup: int = 2, *,
                      device: torch.device, bf16: bool = False, channels_last: bool = False) -> float:
    """Train `model` on `batches` ((images, labels) pairs) and return images/s over `steps` steps after `warmup`.

    `bf16` runs forward and loss under bf16 autocast; `channels_last` stores images and weights as NHWC.
    """
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format).train()  # type: ignore[call-overload]  # torch takes both
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    num_images = 0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            started, num_images = time.perf_counter(), 0
        images, labels = next(batches)
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        num_images += len(labels)
    _sync(device)
    return num_images / (time.perf_counter() - started)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """TFLOP/s of a `size` x `size` matmul in `dtype` on `device`: the most this device does per second."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    a @ b  # warm-up: kernels chosen, memory allocated
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e12


def copy_gb_per_s(device: torch.device, size_mb: int = 256, repeats: int = 5) -> float:
    """GB/s of one copy of `size_mb` MB: host memory to the GPU on CUDA, memory to memory on a CPU."""
    source = torch.empty(size_mb * 2**20, dtype=torch.uint8).fill_(1)
    if device.type == "cuda":
        source = source.pin_memory()
    target = torch.empty_like(source, device=device)
    target.copy_(source)
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source, non_blocking=True)
    _sync(device)
    return size_mb * 2**20 * repeats / (time.perf_counter() - started) / 1e9


def _cycle_on(device: torch.device, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> Iterator:
    """Batches already on `device`, round and round: the model's own speed, no input path."""
    batches = [(x.to(device), y.to(device)) for x, y in zip(images.split(batch_size), labels.split(batch_size))
               if len(y) == batch_size]
    return itertools.cycle(batches)


def _endless(make: Callable[[], Iterable]) -> Iterator:
    """Pass after pass over an iterable that `make` builds anew, as epochs do."""
    while True:
        yield from make()


def bench_device(sizes: dict, steps: tuple[int, int], num_workers: int) -> dict:
    """The device part: model speed, precision, memory layout, input path, ViT, and the device's limits."""
    from helpers import cifar, ingest
    from helpers.data import mnist_transform

    cfg = load_config()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resnet_steps, vit_steps = steps
    mnist = load_mnist(cfg.data_dir, train=True, transform=mnist_transform())
    rows = sizes["device_rows"]
    images = torch.stack([mnist[i][0] for i in range(rows)])
    labels = torch.tensor([mnist[i][1] for i in range(rows)])
    in_memory = _cycle_on(device, images, labels, GLOBAL_BATCH_SIZE)
    pin = device.type == "cuda"

    def loader(workers: int) -> Iterator:
        data = DataLoader(mnist, batch_size=GLOBAL_BATCH_SIZE, shuffle=True, drop_last=True, num_workers=workers,
                          pin_memory=pin, persistent_workers=workers > 0)
        return _endless(lambda: data)

    parquet_root = ingest.write_mnist_parquet(cfg.data_dir, cfg.storage_path)
    ray_data = ingest.mnist_datasets(parquet_root, {"train": rows, "valid": GLOBAL_BATCH_SIZE})["train"]

    def ray_data_batches(prefetch: int) -> Iterator:
        def one_pass():
            for batch in ray_data.iter_torch_batches(batch_size=GLOBAL_BATCH_SIZE, dtypes=ingest.DTYPES,
                                                     device=device, prefetch_batches=prefetch, drop_last=True):
                yield batch["image"], batch["label"]
        return _endless(one_pass)

    vit_batch = sizes["vit_batch_size"]
    vit_data = _cycle_on(device, torch.randn(vit_batch, 3, 32, 32), torch.randint(0, 10, (vit_batch,)), vit_batch)
    feeds = {"dataloader_0_workers": loader(0), f"dataloader_{num_workers}_workers": loader(num_workers),
             "ray_data_prefetch_1": ray_data_batches(1), "ray_data_prefetch_4": ray_data_batches(4)}

    def resnet(batches: Iterator, **options) -> Callable[[], float]:
        def measure() -> float:
            seed_everything(0)
            return loop_images_per_s(resnet18_mnist(), batches, resnet_steps, device=device, **options)
        return measure

    def vit(**options) -> Callable[[], float]:
        def measure() -> float:
            seed_everything(0)
            return loop_images_per_s(cifar.vit_cifar10(), vit_data, vit_steps, warmup=1, device=device, **options)
        return measure

    variants = {
        "resnet_float32": resnet(in_memory), "resnet_bf16": resnet(in_memory, bf16=True),
        "resnet_channels_last": resnet(in_memory, channels_last=True),
        "resnet_bf16_channels_last": resnet(in_memory, bf16=True, channels_last=True),
        **{name: resnet(feed) for name, feed in feeds.items()},
        "vit_float32": vit(), "vit_bf16": vit(bf16=True),
    }
    runs = run_rounds(variants, sizes["rounds"], warmup=True)
    matmul_size = 8192 if device.type == "cuda" else 2048
    limits = run_rounds({"matmul_float32_tflops": lambda: matmul_tflops(device, torch.float32, matmul_size),
                         "matmul_bf16_tflops": lambda: matmul_tflops(device, torch.bfloat16, matmul_size),
                         "copy_gb_per_s": lambda: copy_gb_per_s(device)}, sizes["rounds"])
    dl = f"dataloader_{num_workers}_workers"
    return {
        "device": str(device), "resnet_steps": resnet_steps, "vit_steps": vit_steps, "batch_size": GLOBAL_BATCH_SIZE,
        "vit_batch_size": vit_batch, "matmul_size": matmul_size,
        "images_per_s": {name: spread(values) for name, values in runs.items()},
        "limits": {name: spread(values) for name, values in limits.items()},
        "training_flops_per_image": {
            "resnet18_mnist": training_flops_per_image(resnet18_mnist(), (1, 28, 28)),
            "vit_cifar10": training_flops_per_image(cifar.vit_cifar10(), (3, 32, 32))},
        "comparisons": [
            compare(runs, "resnet_bf16", "resnet_float32"),
            compare(runs, "resnet_channels_last", "resnet_float32"),
            compare(runs, "resnet_bf16_channels_last", "resnet_float32"),
            compare(runs, "dataloader_0_workers", "resnet_float32"),
            compare(runs, dl, "dataloader_0_workers"),
            compare(runs, "ray_data_prefetch_1", "resnet_float32"),
            compare(runs, "ray_data_prefetch_4", "ray_data_prefetch_1"),
            compare(runs, "vit_bf16", "vit_float32")],
    }


# ---- the ddp part -------------------------------------------------------------------------------------------------

def plain_loop_images_per_s(data_dir: str, steps: int, warmup: int = 2) -> float:
    """Lesson 01's loop (a shuffling DataLoader, batches moved to the device) in this process: images/s."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed_everything(0)
    loader = DataLoader(load_mnist(data_dir, train=True), batch_size=GLOBAL_BATCH_SIZE, shuffle=True)
    return loop_images_per_s(resnet18_mnist(), iter(loader), steps, warmup, device=device)


def rest_of_fit(fit: dict[str, dict]) -> float:
    """The median over the rounds of the seconds a fit() spent neither starting its workers nor in training steps.

    `fit` is one Ray Train variant of the ddp part's `fit` (each figure's `rounds`, in round order). The difference is
    taken run by run: a difference of medians would mix runs from different rounds.
    """
    rests = [total - epochs - start for total, epochs, start in zip(
        fit["fit_s"]["rounds"], fit["epochs_s"]["rounds"], fit["worker_group_total"]["rounds"], strict=True)]
    return statistics.median(rests)


def ray_train_run(num_workers: int, steps: int, repeats: int, use_gpu: bool, data_dir: str, storage_path: str) -> dict:
    """One Ray Train fit of lesson 02's loop, 1 + `repeats` epochs of `steps` steps: images/s after the first epoch,
    fit()'s seconds, and its start-up phases."""
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    from helpers.cluster import course_scaling_config
    from helpers.ddp import train_loop_per_worker
    from helpers.runs import new_run_name

    name = new_run_name(f"bench-ddp-{num_workers}w")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": 1 + repeats, "global_batch_size": GLOBAL_BATCH_SIZE, "lr": 1e-3, "seed": 0,
                           "max_steps_per_epoch": steps, "max_test_batches": None,
                           "data_dir": data_dir},
        scaling_config=course_scaling_config(load_config(), num_workers, use_gpu),
        run_config=RunConfig(storage_path=storage_path, name=name),
    )
    started = time.perf_counter()
    result = trainer.fit()  # raises when the run fails
    fit_s = time.perf_counter() - started
    epochs = result.metrics_dataframe
    return {"images_per_s": statistics.median(float(x) for x in epochs["images_per_s"].iloc[1:]),  # after start-up
            "fit_s": fit_s, "epochs_s": float(epochs["epoch_s"].sum()),
            **startup_phases(controller_records(name))}


def bench_ddp(sizes: dict, num_workers: int, use_gpu: bool) -> dict:
    """The ddp part: the plain loop, Ray Train with 1 and `num_workers` workers; fit()'s start-up by phase."""
    cfg = load_config()
    data_dir, storage_path = str(cfg.data_dir), str(cfg.storage_path)
    steps, repeats = sizes["ddp_steps"], sizes["ddp_repeats"]
    details: dict[int, list] = {1: [], num_workers: []}

    def ray_train(workers: int) -> Callable[[], float]:
        def measure() -> float:
            details[workers].append(ray_train_run(workers, steps, repeats, use_gpu, data_dir, storage_path))
            return details[workers][-1]["images_per_s"]
        return measure

    variants = {"plain_loop": lambda: statistics.median(plain_loop_images_per_s(data_dir, steps)
                                                        for _ in range(repeats)),
                "ray_train_1_worker": ray_train(1), f"ray_train_{num_workers}_workers": ray_train(num_workers)}
    runs = run_rounds(variants, sizes["rounds"])
    many = f"ray_train_{num_workers}_workers"
    parameters = sum(p.numel() for p in resnet18_mnist().parameters())
    return {
        "steps_per_epoch": steps, "measured_epochs": repeats, "global_batch_size": GLOBAL_BATCH_SIZE,
        "num_workers": num_workers, "use_gpu": use_gpu,
        "images_per_s": {name: spread(values) for name, values in runs.items()},
        # fit()'s seconds, the epochs' training loops, and the start-up phases, per Ray Train variant
        "fit": {name: {key: spread(run[key] for run in details[workers]) for key in details[workers][0]
                       if key != "images_per_s"} for name, workers in (("ray_train_1_worker", 1), (many, num_workers))},
        "resnet18_parameters": parameters, "gradient_bytes_per_step": 4 * parameters,
        "comparisons": [compare(runs, "ray_train_1_worker", "plain_loop"), compare(runs, many, "plain_loop"),
                        compare(runs, many, "ray_train_1_worker")],
    }


# ---- the data part ------------------------------------------------------------------------------------------------

def whole_epochs_images_per_s(epochs) -> float:
    """All images over all epochs' time (a Result's metrics_dataframe): each epoch's start-up included."""
    return float((epochs["images_per_s"] * epochs["epoch_s"]).sum() / epochs["epoch_s"].sum())


def bench_data(sizes: dict, num_workers: int) -> dict:
    """The data part: lesson 02's DataLoader-fed run against lesson 03's Ray Data-fed runs, on the same rows."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from helpers import ddp, ingest
    from helpers.cluster import check_data_resources, plan_workers
    from helpers.runs import new_run_name

    cfg = load_config()
    rows, epochs = sizes["data_rows"], sizes["data_epochs"]
    common = {"num_epochs": epochs, "global_batch_size": GLOBAL_BATCH_SIZE, "lr": 1e-3, "seed": 0}
    parquet_root = ingest.write_mnist_parquet(cfg.data_dir, cfg.storage_path)

    def fit(name: str, loop, loop_config: dict, cpus: float, datasets: dict | None = None) -> Callable[[], float]:
        def measure() -> float:
            scaling = ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": cpus})
            if datasets:
                check_data_resources(scaling, datasets)
            result = TorchTrainer(loop, train_loop_config={**common, **loop_config}, datasets=datasets,
                                  scaling_config=scaling,
                                  run_config=RunConfig(storage_path=cfg.storage_path, name=new_run_name(name))).fit()
            return whole_epochs_images_per_s(result.metrics_dataframe)
        return measure

    whole_cpus = plan_workers(cfg, num_workers, use_gpu=False).resources_per_worker["CPU"]
    data_cpus = plan_workers(cfg, num_workers, use_gpu=False, reserve_for_data=1).resources_per_worker["CPU"]
    ray_data = {"prefetch_batches": 1, "shuffle_buffer": ingest.SHUFFLE_BUFFER_ROWS}  # lesson 03's defaults
    started = time.perf_counter()
    in_memory = ingest.mnist_datasets(parquet_root, {"train": rows})
    materialize_s = time.perf_counter() - started
    streaming = ingest.mnist_datasets(parquet_root, {"train": rows}, materialize=False)
    variants = {
        "dataloader": fit("bench-data-dataloader", ddp.train_loop_per_worker,
                          {"max_steps_per_epoch": rows // GLOBAL_BATCH_SIZE, "data_dir": str(cfg.data_dir)},
                          whole_cpus),
        "ray_data_materialized": fit("bench-data-materialized", ingest.train_loop_per_worker, ray_data, whole_cpus,
                                     in_memory),
        "ray_data_streaming": fit("bench-data-streaming", ingest.train_loop_per_worker, ray_data, data_cpus, streaming),
    }
    if sizes["data_not_shuffled"]:  # what the shuffle costs
        variants["ray_data_not_shuffled"] = fit("bench-data-not-shuffled", ingest.train_loop_per_worker,
                                                {**ray_data, "shuffle_buffer": None}, whole_cpus, in_memory)
    runs = run_rounds(variants, sizes["rounds"])
    comparisons = [compare(runs, "ray_data_materialized", "dataloader"),
                   compare(runs, "ray_data_streaming", "dataloader")]
    if "ray_data_not_shuffled" in runs:
        comparisons.append(compare(runs, "ray_data_materialized", "ray_data_not_shuffled"))
    return {"rows_per_epoch": rows, "epochs": epochs, "num_workers": num_workers,
            "global_batch_size": GLOBAL_BATCH_SIZE, "cpus_per_worker": {"whole": whole_cpus, "streaming": data_cpus},
            "materialize_s": materialize_s,
            "images_per_s": {name: spread(values) for name, values in runs.items()}, "comparisons": comparisons}

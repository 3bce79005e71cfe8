"""Benchmarks the course reports, as commands (not tests):

    python -m helpers.bench ddp [--steps 40] [--repeats 3] [--rounds 2]
    python -m helpers.bench data [--rows 6400] [--epochs 2] [--rounds 2]

`ddp` measures, in one run on this machine: images/s of lesson 01's plain loop, of Ray Train with
1 worker and with N workers (the machine's CPUs split between them, or one GPU each), and the time
from `fit()` to the first training step of each run.

`data` measures, in one run: images/s of lesson 02's DataLoader-fed loop and of lesson 03's Ray Data-fed
loop (the course default: preprocessed, materialized and shuffled in each worker; the same without the
shuffle, for its cost; and streaming, with one CPU kept for Ray Data), 2 workers on the same rows, counted
over whole epochs including each epoch's pipeline start-up; the DataLoader and materialized runs alternate
`rounds` times (medians reported; a ratio is the median of each round's ratio), streaming runs once.

Small shared machines are noisy (+-20% between two 40-step windows here, and the machine's speed
drifts over minutes), so each throughput is the median of `repeats` windows, and `ddp` runs its three
measurements `rounds` times in turn (plain loop, 1 worker, N workers) and reports each ratio as the
median of the rounds' ratios: a slow spell hits both sides of a ratio. The plain loop runs in this
process *with Ray up*, as in the lessons, and each Ray Train run trains 1 + `repeats` epochs and drops
the first (start-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers.config import load_config, load_dotenv_file
from helpers.data import load_mnist
from helpers.models import resnet18_mnist
from helpers.training import seed_everything

GLOBAL_BATCH_SIZE = 128


def plain_loop_images_per_s(data_dir: str, steps: int, warmup: int = 5) -> float:
    """Lesson 01's loop on this process's device: images/s over `steps` steps after `warmup`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed_everything(0)
    loader = DataLoader(load_mnist(data_dir, train=True), batch_size=GLOBAL_BATCH_SIZE, shuffle=True)
    model = resnet18_mnist().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    batches = iter(loader)
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        images, labels = next(batches)
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * GLOBAL_BATCH_SIZE / (time.perf_counter() - started)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ray_train_run(num_workers: int, steps: int, repeats: int, use_gpu: bool, data_dir: str, storage_path: str) -> dict:
    """One Ray Train fit of lesson 02's loop: 1 + `repeats` epochs of `steps` steps; its timings."""
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    from helpers.cluster import course_scaling_config
    from helpers.ddp import train_loop_per_worker
    from helpers.runs import new_run_name

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": 1 + repeats, "global_batch_size": GLOBAL_BATCH_SIZE, "lr": 1e-3, "seed": 0,
                           "max_steps_per_epoch": steps, "data_dir": data_dir},
        scaling_config=course_scaling_config(load_config(), num_workers, use_gpu),
        run_config=RunConfig(storage_path=storage_path, name=new_run_name(f"bench-ddp-{num_workers}w")),
    )
    fit_started = time.time()
    result = trainer.fit()  # raises when the run fails
    fit_s = time.time() - fit_started
    epochs = result.metrics_dataframe
    return {
        "images_per_s": statistics.median(float(x) for x in epochs["images_per_s"].iloc[1:]),  # after start-up
        "fit_to_first_step_s": float(epochs["epoch_started_at"].iloc[0]) - fit_started,
        "fit_s": fit_s,
    }


def bench_ddp(steps: int, num_workers: int, repeats: int, rounds: int) -> dict:
    """Plain loop, then Ray Train with 1 and `num_workers` workers, `rounds` times, in one process with Ray up."""
    import ray

    from helpers.cluster import start_autoscaling_coordinator
    from helpers.session import start_ray

    load_dotenv_file()
    cfg = load_config()
    data_dir = str(cfg.data_dir)
    report = {"steps_per_window": steps, "repeats": repeats, "rounds": rounds, "global_batch_size": GLOBAL_BATCH_SIZE}
    report["ray_init_s"] = start_ray(cfg)
    start_autoscaling_coordinator()  # as lesson 02 does
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0  # the plain loop uses a GPU when this machine has one
    runs = {"plain": [], **{workers: [] for workers in (1, num_workers)}}
    try:
        for _ in range(rounds):
            runs["plain"].append(statistics.median(plain_loop_images_per_s(data_dir, steps) for _ in range(repeats)))
            for workers in (1, num_workers):
                runs[workers].append(ray_train_run(workers, steps, repeats, use_gpu, data_dir, str(cfg.storage_path)))
    finally:
        ray.shutdown()
    report["plain_loop_images_per_s"] = _spread(runs["plain"])
    for workers in (1, num_workers):
        report[f"ray_train_{workers}w"] = {
            key: _spread([run[key] for run in runs[workers]])
            for key in ("images_per_s", "fit_to_first_step_s", "fit_s")}
        ratios = [run["images_per_s"] / plain for run, plain in zip(runs[workers], runs["plain"])]
        report[f"ratio_{workers}w_to_plain"] = {"median": round(statistics.median(ratios), 3),
                                               "rounds": [round(ratio, 3) for ratio in ratios]}
    return report


def _whole_epochs_images_per_s(result) -> float:
    """All images over all epochs' time: each epoch's start-up (iterator, pipeline) included."""
    epochs = result.metrics_dataframe
    return float((epochs["images_per_s"] * epochs["epoch_s"]).sum() / epochs["epoch_s"].sum())


def bench_data(rows: int, epochs: int, num_workers: int, rounds: int) -> dict:
    """Lesson 02's DataLoader-fed loop vs lesson 03's Ray Data-fed loop, in one process with Ray up."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from helpers import ddp, ingest
    from helpers.cluster import check_data_resources, plan_workers, start_autoscaling_coordinator
    from helpers.runs import new_run_name
    from helpers.session import start_ray

    load_dotenv_file()
    cfg = load_config()
    report = {"rows_per_epoch": rows, "epochs": epochs, "num_workers": num_workers,
              "global_batch_size": GLOBAL_BATCH_SIZE, "ray_init_s": start_ray(cfg)}
    start_autoscaling_coordinator()
    parquet_root = ingest.write_mnist_parquet(cfg.data_dir, cfg.storage_path)
    common = {"num_epochs": epochs, "global_batch_size": GLOBAL_BATCH_SIZE, "lr": 1e-3, "seed": 0}

    def fit(name: str, loop, loop_config: dict, cpus: float, datasets: dict | None = None) -> float:
        scaling = ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": cpus})
        if datasets:
            check_data_resources(scaling, datasets)
        result = TorchTrainer(loop, train_loop_config={**common, **loop_config}, datasets=datasets,
                              scaling_config=scaling,
                              run_config=RunConfig(storage_path=cfg.storage_path, name=new_run_name(name))).fit()
        return _whole_epochs_images_per_s(result)

    whole_cpus = plan_workers(cfg, num_workers, use_gpu=False).resources_per_worker["CPU"]
    ray_data = {"prefetch_batches": 1, "shuffle_buffer": ingest.SHUFFLE_BUFFER_ROWS}  # lesson 03's defaults
    unshuffled = {**ray_data, "shuffle_buffer": None}  # what the shuffle costs
    dataloader, materialized, not_shuffled = [], [], []
    try:
        started = time.perf_counter()
        in_memory = ingest.mnist_datasets(parquet_root, {"train": rows})
        report["materialize_s"] = time.perf_counter() - started
        for _ in range(rounds):  # alternate, so that a slow spell of the machine hits both
            dataloader.append(fit("bench-data-dataloader", ddp.train_loop_per_worker,
                                  {"max_steps_per_epoch": rows // GLOBAL_BATCH_SIZE, "data_dir": str(cfg.data_dir)},
                                  whole_cpus))
            materialized.append(fit("bench-data-materialized", ingest.train_loop_per_worker, ray_data, whole_cpus,
                                    in_memory))
            not_shuffled.append(fit("bench-data-not-shuffled", ingest.train_loop_per_worker, unshuffled, whole_cpus,
                                    in_memory))
        del in_memory
        streaming = ingest.mnist_datasets(parquet_root, {"train": rows}, materialize=False)
        report["ray_data_streaming_images_per_s"] = fit(
            "bench-data-streaming", ingest.train_loop_per_worker, ray_data,
            plan_workers(cfg, num_workers, use_gpu=False, reserve_for_data=1).resources_per_worker["CPU"], streaming)
    finally:
        ray.shutdown()
    report["dataloader_images_per_s"] = _spread(dataloader)
    report["ray_data_materialized_images_per_s"] = _spread(materialized)
    report["ray_data_materialized_not_shuffled_images_per_s"] = _spread(not_shuffled)
    report["ratio_shuffled_to_not_shuffled"] = round(statistics.median(
        [shuffled / plain for shuffled, plain in zip(materialized, not_shuffled)]), 3)
    ratios = [ray_data / loader for ray_data, loader in zip(materialized, dataloader)]  # each round's pair
    report["ratio_materialized_to_dataloader"] = {"median": round(statistics.median(ratios), 3),
                                                  "rounds": [round(ratio, 3) for ratio in ratios]}
    report["ratio_streaming_to_dataloader"] = round(
        report["ray_data_streaming_images_per_s"] / report["dataloader_images_per_s"]["median"], 3)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m helpers.bench", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ddp = commands.add_parser("ddp", help="plain loop vs Ray Train (1 and N workers), fit() to first step")
    ddp.add_argument("--steps", type=int, default=40, help="measured steps per epoch (default 40)")
    ddp.add_argument("--num-workers", type=int, default=2, help="the N of the N-worker run (default 2)")
    ddp.add_argument("--repeats", type=int, default=3, help="measured windows per figure (default 3)")
    ddp.add_argument("--rounds", type=int, default=2, help="plain / 1 worker / N workers, in turn (default 2)")
    data = commands.add_parser("data", help="DataLoader-fed vs Ray Data-fed training, whole epochs")
    data.add_argument("--rows", type=int, default=6400, help="training rows per epoch (default 6400)")
    data.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")
    data.add_argument("--num-workers", type=int, default=2, help="Ray Train workers (default 2)")
    data.add_argument("--rounds", type=int, default=2, help="DataLoader / Ray Data runs, alternated (default 2)")
    args = parser.parse_args(argv)
    if args.command == "ddp":
        report = bench_ddp(args.steps, args.num_workers, args.repeats, args.rounds)
    else:
        report = bench_data(args.rows, args.epochs, args.num_workers, args.rounds)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

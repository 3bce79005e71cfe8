"""Stream a synthetic image dataset larger than memory into Ray Train, and measure peak memory by kind of process.

    python notebooks/train_streaming.py --data-size-gb 1 --num-epochs 2 --num-workers 2
    python notebooks/train_streaming.py --data-size-gb 1 --object-store-mib 256   # 1 GB through a 256 MiB store
    python notebooks/train_streaming.py --smoke-test          # 0.01 GB

Writes N GB of images as Parquet under `<storage path>/datasets/` once (reused by later runs; runs started at the
same time share it safely, see `helpers.streaming.synthetic_folder`), then trains a small CNN on it for a few
epochs, reading it from disk again every epoch: nothing is materialized. While it trains,
one sampler per node records each kind of process' peak memory and the object stores' peak, and what they spilled
to disk. Peak memory should stay about the same at every size while the time grows with the size; with
`--object-store-mib`, the local Ray's object store is smaller than the dataset, and nothing should be spilled.
`helpers.streaming.remove_synthetic_images` cleans up.
Defaults come from the course configuration (environment and .env, see .env.example); flags win.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ray.train import RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import (
    check_data_resources,
    check_resources,
    check_storage_path,
    course_scaling_config,
    start_autoscaling_coordinator,
)
from helpers.config import ConfigError, load_config
from helpers.runs import new_run_name
from helpers.session import start_ray
from helpers.streaming import (
    GB,
    MIB,
    READ_TASK_BYTES,
    ROW_MULTIPLE,
    STREAM_BLOCK_BYTES,
    STREAM_OBJECT_STORE_BYTES,
    WorkerReports,
    check_every_row_once,
    check_free_disk,
    dataset_marker,
    find_synthetic_folder,
    read_worker_reports,
    streaming_data_config,
    streaming_dataset,
    synthetic_folder,
    train_loop_per_worker,
)
from helpers.tooling.memory import MemoryPeaks
from helpers.tooling.scripts import parse_streaming_args, requested_size_gb, run_script


def main(argv: list[str] | None = None) -> dict:
    args = parse_streaming_args(__doc__.split("\n")[0], argv)
    size_gb = requested_size_gb(args)
    cfg = load_config()
    start_ray(cfg, object_store_memory=None if args.object_store_mib is None else args.object_store_mib * MIB)
    storage_path = check_storage_path(args.storage_path)  # before the dataset is written there
    check_free_disk(storage_path, size_gb)
    cfg = dataclasses.replace(cfg, num_workers=args.num_workers, storage_path=storage_path)
    num_workers = course_scaling_config(cfg).num_workers
    check_resources(course_scaling_config(cfg))  # the workers fit the cluster: checked before any data is written
    if num_workers > 1 and ROW_MULTIPLE % num_workers:
        raise ConfigError(f"{num_workers} workers cannot split the dataset's rows (a multiple of "
                         f"{ROW_MULTIPLE}) exactly, and Ray Train would drop the remainder.\n"
                         "To fix it: use 1, 2, 3, 4, 6 or 8 workers (--num-workers).")

    started = time.perf_counter()
    reused = find_synthetic_folder(storage_path, size_gb) is not None
    folder = synthetic_folder(storage_path, size_gb)
    write_s = 0.0 if reused else time.perf_counter() - started
    marker = dataset_marker(folder)
    print(f"dataset: {folder} ({'reused' if reused else f'written in {write_s:.1f} s'}): {marker['rows']} images "
          f"{'x'.join(map(str, marker['image_shape']))}, {marker['bytes'] / GB:.3f} GB on disk")

    dataset = streaming_dataset(folder)  # lazy: read and normalised while training iterates it
    scaling = course_scaling_config(cfg, datasets={"train": dataset})  # it streams: CPUs kept for Ray Data
    check_resources(scaling)
    check_data_resources(scaling, {"train": dataset})
    start_autoscaling_coordinator()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": args.num_epochs, "global_batch_size": 256, "lr": 1e-3, "seed": 0,
                           "prefetch_batches": 1},
        datasets={"train": dataset},
        scaling_config=scaling,
        dataset_config=streaming_data_config(),  # a fixed object-store budget for the stream, at any data size
        run_config=RunConfig(storage_path=storage_path, name=new_run_name("train_streaming"),
                             callbacks=[WorkerReports()]),  # every worker's rows and id sums, every epoch
    )
    with MemoryPeaks() as peaks:
        started = time.perf_counter()
        result = trainer.fit()
        fit_s = time.perf_counter() - started

    reports = read_worker_reports(result)
    check_every_row_once(reports, marker["rows"], args.num_epochs)
    report = {
        "size_gb_requested": size_gb, "bytes_on_disk": marker["bytes"], "num_rows": marker["rows"],
        "image_shape": marker["image_shape"], "num_workers": scaling.num_workers, "num_epochs": args.num_epochs,
        "stream": {"budget_mib": STREAM_OBJECT_STORE_BYTES / MIB, "block_mib": STREAM_BLOCK_BYTES / MIB,
                   "read_task_mib": READ_TASK_BYTES / MIB, "object_store_mib_requested": args.object_store_mib},
        "write_s": round(write_s, 2), "fit_s": round(fit_s, 2),
        "epoch_s": [round(max(rank["epoch_s"] for rank in ranks), 2) for ranks in reports],
        "rows_per_epoch": [sum(rank["rows"] for rank in ranks) for ranks in reports],
        "peak_mib": peaks.mib, "object_store": peaks.store, "processes": peaks.processes,
    }
    print(f"trained {args.num_epochs} epoch(s) on {scaling.num_workers} worker(s) in {fit_s:.1f} s "
          f"(epochs: {', '.join(f'{s:.1f} s' for s in report['epoch_s'])}); every epoch saw every row once")
    print("peak memory (MiB): " + ", ".join(f"{kind} {mib:.0f}" for kind, mib in peaks.mib.items()))
    store = peaks.store
    print(f"object store: peak {peaks.mib['object_store']:.0f} MiB of {store['capacity_mib']:.0f} MiB; spilled to "
          f"disk {store['spilled_bytes']} bytes, in fallback files {store['fallback_mib']:.0f} MiB at most")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {args.json}")
    return report


if __name__ == "__main__":
    run_script(main)

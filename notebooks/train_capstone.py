"""Train lesson 09's ViT on CIFAR-10 with Ray Train fed by Ray Data, keeping the best checkpoints: lesson 09 as a job.

    python notebooks/train_capstone.py --epochs 3 --smoke-test
    python notebooks/train_capstone.py --name my-run --epochs 5   # again after a failure: continues my-run

Defaults come from the course configuration (environment and .env, see .env.example); flags win.
The data pipeline and the training loop are lesson 09's step 3 (`helpers.capstone`): the loop resumes from the run's
latest checkpoint, Ray Train restarts the workers after 2 of their failures at most, and the run keeps the 2 checkpoints
with the best test accuracy, and the latest (Ray Train never deletes it: a restart resumes from it). On a cluster
without GPUs it trains on a cut of the data (`helpers.capstone.run_rows`).
"""

from __future__ import annotations

import dataclasses
import time

import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, Result, RunConfig
from ray.train.torch import TorchTrainer

from helpers.capstone import cifar10_datasets, run_rows, train_loop_per_worker_ray_data
from helpers.cifar import cifar10_parquet_root
from helpers.cluster import check_data_resources, check_resources, check_storage_path, course_scaling_config
from helpers.config import load_config
from helpers.results import MetricsHistory
from helpers.runs import new_run_name
from helpers.session import start_ray
from helpers.storage import uri
from helpers.tooling.scripts import parse_args, run_script


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(__doc__.split("\n")[0], argv, resumable=True)
    cfg = load_config()
    start_ray(cfg)
    storage_path = check_storage_path(args.storage_path)
    cfg = dataclasses.replace(cfg, num_workers=args.num_workers, storage_path=storage_path,
                              use_gpu=cfg.use_gpu if args.use_gpu is None else args.use_gpu)
    rows = run_rows(args.smoke_test, ray.cluster_resources().get("GPU", 0))  # all of them with GPUs, a cut without
    datasets = cifar10_datasets(cifar10_parquet_root(cfg.data_dir), rows)
    scaling = course_scaling_config(cfg, datasets=datasets)  # CPUs kept for Ray Data's augmentation
    check_resources(scaling)
    check_data_resources(scaling, datasets)
    trainer = TorchTrainer(
        train_loop_per_worker_ray_data,
        train_loop_config={"num_epochs": args.epochs, "global_batch_size": 128 if args.smoke_test else 512,
                           "lr": 1e-3, "weight_decay": 1e-2, "seed": 0, "smoke_test": args.smoke_test,
                           "prefetch_batches": 1, "shuffle_buffer": 5_000, "started_at": time.time()},
        datasets=datasets,
        scaling_config=scaling,
        run_config=RunConfig(storage_path=storage_path, name=args.name or new_run_name("train_capstone"),
                             checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="test_acc",
                                                                checkpoint_score_order="max"),
                             failure_config=FailureConfig(max_failures=2),
                             callbacks=[MetricsHistory()],  # every report and failure, in the run folder
                             logging_config=LoggingConfig(log_level="WARNING")),
    )
    result = trainer.fit()
    print(f"epochs: {args.epochs}, on {rows or 'all the rows'}, {scaling.num_workers} worker(s)")
    print(f"test_acc={result.metrics['test_acc']:.4f} after epoch {result.metrics['epoch']}")
    best, metrics = max(result.best_checkpoints, key=lambda kept: kept[1]["test_acc"])  # of those kept
    print(f"best checkpoint: epoch {metrics['epoch']}, test_acc={metrics['test_acc']:.4f}, "
          f"{uri(best.path, best.filesystem)}")
    return result


if __name__ == "__main__":
    run_script(main)

"""Train ResNet-18 on MNIST with Ray Train DDP fed by Ray Data: lesson 03 as a command-line script.

    python notebooks/train_ray_ddp_with_ray_data.py --num-workers 2 --epochs 1 --smoke-test

Defaults come from the course configuration (environment and .env, see .env.example); flags win.
The data pipeline and the training loop are `helpers.ingest`'s, the ones lesson 03 teaches.
"""

from __future__ import annotations

from ray.train import Result, RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import (
    check_data_resources,
    check_resources,
    check_storage_path,
    scaling_config,
    start_autoscaling_coordinator,
)
from helpers.config import load_config
from helpers.ingest import SMOKE_ROWS, mnist_datasets, train_loop_per_worker, write_mnist_parquet
from helpers.runs import new_run_name
from helpers.scripts import parse_args, print_result, run_script
from helpers.session import start_ray


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(__doc__.split("\n")[0], argv)
    cfg = load_config()
    start_ray(cfg)
    scaling = scaling_config(cfg, args.num_workers, args.use_gpu)
    check_resources(scaling)
    check_storage_path(args.storage_path)
    start_autoscaling_coordinator()
    parquet_root = write_mnist_parquet(cfg.data_dir, args.storage_path)  # once; later runs reuse it
    datasets = mnist_datasets(parquet_root, SMOKE_ROWS if args.smoke_test else None)  # preprocessed, in memory
    check_data_resources(scaling, datasets)  # a dataset still to compute needs CPUs beside the workers
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": args.epochs, "global_batch_size": 128, "lr": 1e-3, "seed": 0,
                           "prefetch_batches": 1, "shuffle_buffer": None},
        datasets=datasets,
        scaling_config=scaling,
        run_config=RunConfig(storage_path=args.storage_path, name=new_run_name("train_ray_ddp_with_ray_data")),
    )
    result = trainer.fit()
    print_result(result)
    return result


if __name__ == "__main__":
    run_script(main)

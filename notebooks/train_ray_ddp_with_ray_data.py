"""Train ResNet-18 on MNIST with Ray Train DDP fed by Ray Data: lessons 03 and 05 as a command-line script.

    python notebooks/train_ray_ddp_with_ray_data.py --num-workers 2 --epochs 1 --smoke-test
    python notebooks/train_ray_ddp_with_ray_data.py --name my-run   # again after Ctrl-C: continues my-run

Defaults come from the course configuration (environment and .env, see .env.example); flags win.
The data pipeline is lesson 03's (`helpers.ingest`); the training loop is lesson 05's resumable one
(`helpers.fault_tolerance`): a run started again under its `--name` continues from its latest checkpoint.
"""

from __future__ import annotations

import dataclasses

from ray.train import DataConfig, Result, RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import check_storage_path
from helpers.config import load_config
from helpers.fault_tolerance import train_loop_per_worker
from helpers.ingest import SHUFFLE_BUFFER_ROWS, prepare_ray_data_training
from helpers.results import MetricsHistory
from helpers.runs import new_run_name
from helpers.session import start_ray
from helpers.sizes import sized
from helpers.tooling.scripts import parse_args, print_result, run_script


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(__doc__.split("\n")[0], argv, resumable=True)
    cfg = load_config()
    start_ray(cfg)
    storage_path = check_storage_path(args.storage_path)  # before the Parquet files are written there
    cfg = dataclasses.replace(cfg, num_workers=args.num_workers, storage_path=storage_path,
                              use_gpu=cfg.use_gpu if args.use_gpu is None else args.use_gpu)
    _, datasets, scaling = prepare_ray_data_training(cfg, sized("mnist_rows", args.smoke_test))  # as lesson 04
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": args.epochs, "global_batch_size": 128, "lr": 1e-3, "seed": 0,
                           "prefetch_batches": 1, "shuffle_buffer": SHUFFLE_BUFFER_ROWS},
        datasets=datasets,
        dataset_config=DataConfig(enable_shard_locality=False),  # the same rows per rank in every run (lesson 05)
        scaling_config=scaling,
        run_config=RunConfig(storage_path=storage_path, name=args.name or new_run_name("train_ray_ddp_with_ray_data"),
                             callbacks=[MetricsHistory()]),  # every report, with the node of each worker
    )
    result = trainer.fit()
    print_result(result)
    return result


if __name__ == "__main__":
    run_script(main)

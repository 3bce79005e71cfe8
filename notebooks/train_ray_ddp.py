"""Train ResNet-18 on MNIST with Ray Train DDP: lesson 02 as a command-line script.

    python notebooks/train_ray_ddp.py --num-workers 2 --epochs 1 --smoke-test

Defaults come from the course configuration (environment and .env, see .env.example); flags win.
The training loop is `helpers.ddp.train_loop_per_worker`, the one lesson 02 teaches.
"""

from __future__ import annotations

import argparse

import ray
from ray.train import Result, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import ResourceRequestError, check_resources, start_autoscaling_coordinator
from helpers.config import ConfigError, load_config, load_dotenv_file
from helpers.data import DataNotFoundError
from helpers.ddp import train_loop_per_worker
from helpers.runs import new_run_name
from helpers.session import start_ray


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    load_dotenv_file()
    cfg = load_config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=cfg.num_workers, help="Ray Train workers")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs")
    parser.add_argument("--use-gpu", action="store_true", default=cfg.use_gpu is True, help="one GPU per worker")
    parser.add_argument("--smoke-test", action="store_true", default=cfg.smoke_test, help="25 steps per epoch")
    parser.add_argument("--storage-path", default=str(cfg.storage_path), help="where results and checkpoints go")
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.epochs < 1:
        parser.error("--num-workers and --epochs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    cfg = load_config()
    start_ray(cfg)
    cpus_per_worker = 1 if args.use_gpu else max(1, int(ray.cluster_resources()["CPU"]) // args.num_workers)
    scaling_config = ScalingConfig(
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        resources_per_worker={"CPU": cpus_per_worker, **({"GPU": 1} if args.use_gpu else {})},
        accelerator_type=cfg.accelerator_type,
    )
    check_resources(scaling_config)  # fail now, not after waiting forever for resources
    start_autoscaling_coordinator()  # saves the first fit() a 5 s time-out (see helpers.cluster)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "num_epochs": args.epochs,
            "global_batch_size": 128,
            "lr": 1e-3,
            "seed": 0,
            "max_steps_per_epoch": 25 if args.smoke_test else None,
            "data_dir": str(cfg.data_dir),
        },
        scaling_config=scaling_config,
        run_config=RunConfig(storage_path=args.storage_path, name=new_run_name("train_ray_ddp")),
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    metrics = result.metrics
    print(f"test_acc={metrics['test_acc']:.4f} test_loss={metrics['test_loss']:.4f} "
          f"images_per_s={metrics['images_per_s']:.0f}")
    print(f"checkpoint: {result.checkpoint.path}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataNotFoundError, ResourceRequestError) as error:
        raise SystemExit(f"error: {error}") from None
    finally:
        ray.shutdown()

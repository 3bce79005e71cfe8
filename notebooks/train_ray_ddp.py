"""Train ResNet-18 on MNIST with Ray Train DDP: lesson 02 as a command-line script.

    python notebooks/train_ray_ddp.py --num-workers 2 --epochs 1 --smoke-test

Defaults come from the course configuration (environment and .env, see .env.example); flags win.
The training loop is `helpers.ddp.train_loop_per_worker`, the one lesson 02 teaches.
"""

from __future__ import annotations

from ray.train import Result, RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import check_resources, check_storage_path, course_scaling_config
from helpers.config import load_config
from helpers.ddp import train_loop_per_worker
from helpers.results import MetricsHistory
from helpers.runs import new_run_name
from helpers.session import start_ray
from helpers.sizes import sized
from helpers.tooling.scripts import parse_args, print_result, run_script


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(__doc__.split("\n")[0], argv)
    cfg = load_config()
    start_ray(cfg)
    scaling = course_scaling_config(cfg, args.num_workers, args.use_gpu)  # sized for this cluster's nodes
    check_resources(scaling)  # fail now: fit() would retry every minute for resources that never come
    check_storage_path(args.storage_path)  # ... or after starting Ray Train, on a folder it cannot write
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "num_epochs": args.epochs,
            "global_batch_size": 128,
            "lr": 1e-3,
            "seed": 0,
            "max_steps_per_epoch": sized("ddp_script_steps", args.smoke_test),
            "max_test_batches": sized("ddp_script_test_batches", args.smoke_test),
            "data_dir": str(cfg.data_dir),
        },
        scaling_config=scaling,
        run_config=RunConfig(storage_path=args.storage_path, name=new_run_name("train_ray_ddp"),
                             callbacks=[MetricsHistory()]),  # every report, with the node of each worker
    )
    result = trainer.fit()
    print_result(result)
    return result


if __name__ == "__main__":
    run_script(main)

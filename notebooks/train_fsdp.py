"""Train a residual MLP on MNIST sharded with FSDP2 (or replicated with DDP), fed by Ray Data: lesson 12 as a script.

    python notebooks/train_fsdp.py --num-workers 2 --epochs 1 --smoke-test
    python notebooks/train_fsdp.py --bf16 --checkpoint-activations --memory-budget-mb 600 --name my-run
    python notebooks/train_fsdp.py --name my-run --epochs 4   # again after Ctrl-C, or for more epochs: continues

Defaults come from the course configuration (environment and .env, see .env.example); flags win.
The data pipeline is lesson 03's (`helpers.ingest`); the training loop is lesson 12's (`helpers.sharding`): each
block of the model and its root sharded with `fully_shard` (or, with --ddp, lesson 02's DDP), every epoch a sharded
checkpoint (torch.distributed.checkpoint: each rank writes its own shard), from which a run started again under its
`--name` continues. `helpers.sharding.load_unsharded` reads such a checkpoint into one plain model.
"""

from __future__ import annotations

import dataclasses

from ray.train import DataConfig, FailureConfig, Result, RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import check_storage_path, course_scaling_config
from helpers.config import ConfigError, load_config
from helpers.ingest import SHUFFLE_BUFFER_ROWS, prepare_ray_data_training
from helpers.results import MetricsHistory
from helpers.runs import new_run_name
from helpers.session import start_ray
from helpers.sharding import COMPONENTS, train_loop_per_worker
from helpers.sizes import sized
from helpers.tooling.scripts import parse_fsdp_args, print_result, run_script

#: Images per optimizer step, over all workers and micro-batches: lesson 02's.
GLOBAL_BATCH_SIZE = 128


def main(argv: list[str] | None = None) -> Result:
    args = parse_fsdp_args(__doc__.split("\n")[0], argv)
    cfg = load_config()
    start_ray(cfg)
    storage_path = check_storage_path(args.storage_path)  # before the Parquet files are written there
    cfg = dataclasses.replace(cfg, num_workers=args.num_workers, storage_path=storage_path,
                              use_gpu=cfg.use_gpu if args.use_gpu is None else args.use_gpu)
    num_workers = course_scaling_config(cfg).num_workers  # sized for this cluster's nodes when not given
    if GLOBAL_BATCH_SIZE % (num_workers * args.accumulation_steps):  # checked before any data work
        raise ConfigError(f"{num_workers} workers x {args.accumulation_steps} accumulation steps do not divide a "
                          f"step's {GLOBAL_BATCH_SIZE} images into equal micro-batches: choose --num-workers and "
                          "--accumulation-steps whose product divides it (1, 2, 4, 8, ...)")
    _, datasets, scaling = prepare_ray_data_training(cfg, sized("mnist_rows", args.smoke_test))  # as lesson 04
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"model": {**sized("fsdp_model", args.smoke_test),
                                     "checkpoint_activations": args.checkpoint_activations},
                           "fsdp": not args.ddp, "bf16": args.bf16, "accumulation_steps": args.accumulation_steps,
                           "global_batch_size": GLOBAL_BATCH_SIZE, "lr": 1e-4, "seed": 0,
                           "shuffle_buffer": SHUFFLE_BUFFER_ROWS, "num_epochs": args.epochs,
                           "steps_per_epoch": args.steps_per_epoch, "memory_budget_mb": args.memory_budget_mb},
        datasets=datasets,
        dataset_config=DataConfig(enable_shard_locality=False),  # the same rows per rank in every run (lesson 05)
        scaling_config=scaling,
        run_config=RunConfig(storage_path=storage_path, name=args.name or new_run_name("train_fsdp"),
                             failure_config=FailureConfig(max_failures=args.max_failures),  # from the last checkpoint
                             callbacks=[MetricsHistory()]),  # every report
    )
    result = trainer.fit()
    print_result(result)
    metrics = result.metrics
    print(f"epoch {metrics['epoch']} (this run started at epoch {metrics['start_epoch']}): "
          f"train_loss={metrics['train_loss']:.4f}, {'DDP' if args.ddp else 'FSDP2'} on {scaling.num_workers} workers")
    print("MiB per worker (the largest): " + ", ".join(f"{name} {metrics[name]:.1f}" for name in COMPONENTS))
    return result


if __name__ == "__main__":
    run_script(main)

"""Search the learning rate and batch size of ResNet-18 on MNIST with Ray Tune over Ray Train runs: lesson 11.

    python notebooks/tune_ray_ddp.py --num-samples 4 --max-concurrent-trials 2 --smoke-test
    python notebooks/tune_ray_ddp.py --name my-search   # again after Ctrl-C: continues my-search

Every trial is a whole Ray Train run (`helpers.tuning.train_driver`, lesson 05's resumable loop on `--num-workers`
workers), ASHA stops the weak ones early, and `--max-concurrent-trials` trials train at once. A trial whose driver
dies is started again once; its run continues from its latest checkpoint. Defaults come from the course
configuration (environment and .env, see .env.example); flags win. A search started again under its `--name`
continues from its storage path: finished trials are kept, the others go on from their latest checkpoint.
"""

from __future__ import annotations

import dataclasses

import ray.tune as tune
from ray.train import ScalingConfig
from ray.tune import ResultGrid, TuneConfig, Tuner
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import BasicVariantGenerator

from helpers import storage
from helpers.cluster import check_storage_path
from helpers.config import load_config
from helpers.ingest import SHUFFLE_BUFFER_ROWS, mnist_datasets, write_mnist_parquet
from helpers.runs import new_run_name
from helpers.session import start_ray
from helpers.sizes import sized
from helpers.tooling.scripts import parse_tune_args, run_script
from helpers.tuning import (
    DRIVER_RESOURCES,
    ResultOrder,
    check_search_resources,
    plan_search,
    print_search,
    train_driver,
)


def main(argv: list[str] | None = None) -> ResultGrid:
    args = parse_tune_args(__doc__.split("\n")[0], argv)
    cfg = load_config()
    start_ray(cfg)
    storage_path = check_storage_path(args.storage_path)  # every node must reach it: each trial's workers write there
    cfg = dataclasses.replace(cfg, num_workers=args.num_workers, storage_path=storage_path)
    plan = plan_search(cfg, args.max_concurrent_trials or 2)
    print(f"search: {plan.describe()}")
    scaling_config = ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                                   resources_per_worker=plan.resources_per_worker)
    check_search_resources(scaling_config, plan.max_concurrent_trials, flags=True)  # fail now, not queue with errors
    parquet_root = write_mnist_parquet(cfg.data_dir, storage_path)
    datasets = mnist_datasets(parquet_root, sized("search_rows", args.smoke_test))
    trainable = tune.with_resources(
        tune.with_parameters(train_driver, datasets=datasets, scaling_config=scaling_config, storage_path=storage_path),
        DRIVER_RESOURCES)  # the driver reserves no CPU: it only waits for its run
    name = args.name or new_run_name("tune_ray_ddp")
    path = storage.join(storage_path, name)
    if Tuner.can_restore(path):
        print(f"continuing the search {name}: its finished trials are kept")
        tuner = Tuner.restore(path, trainable=trainable)
    else:
        tuner = Tuner(
            trainable,
            param_space={"lr": tune.loguniform(1e-4, 1e-1), "global_batch_size": tune.choice([64, 128, 256]),
                         "num_epochs": args.epochs, "seed": 0, "prefetch_batches": 1,
                         "shuffle_buffer": SHUFFLE_BUFFER_ROWS},
            tune_config=TuneConfig(metric="test_acc", mode="max", num_samples=args.num_samples,
                                   search_alg=BasicVariantGenerator(  # lesson 05's configuration first, seeded
                                       points_to_evaluate=[{"lr": 1e-3, "global_batch_size": 128}], random_state=0,
                                       max_concurrent=plan.max_concurrent_trials),  # the limit goes on the search_alg
                                   scheduler=ASHAScheduler(time_attr="epoch", grace_period=1, reduction_factor=2,
                                                           max_t=args.epochs - 1)),
            run_config=tune.RunConfig(storage_path=storage_path, name=name, callbacks=[ResultOrder()],
                                      failure_config=tune.FailureConfig(max_failures=1)),  # a trial whose driver died
        )
    results = tuner.fit()
    if not print_search(results, path):
        raise SystemExit(1)  # interrupted (Ctrl-C): the search's state is saved, --name continues it
    return results


if __name__ == "__main__":
    run_script(main)

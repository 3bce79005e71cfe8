"""Shared code for the course 'Scaling PyTorch training with Ray'.

Notebooks start with `from helpers import setup; cfg = setup()`. The modules here are the ones lessons import or
show; `helpers.tooling` holds the code the course runs but does not teach.

Which lesson imports which module (besides `setup` from this package; lesson 07 also ships the whole package to its
jobs). tests/test_lesson_map.py fails when a lesson imports a module its row does not list, or no longer imports one
it lists:

    00_ray_core                           exercises, session
    01_single_gpu_pytorch                 data, display, exercises, models, plots, runs, storage, training
    02_ray_train_ddp                      cluster, data, exercises, models, plots, runs, training
    03_ray_data_ingest                    cluster, data, display, exercises, ingest, models, plots, runs, storage,
                                          tooling.bench, training
    04_checkpoints_and_results            display, exercises, inference, ingest, models, plots, results, runs, training
    05_fault_tolerance                    exercises, fault_tolerance, ingest, models, results, runs
    06_observability_and_troubleshooting  cluster, display, exercises, ingest, models, runs, session, sharding,
                                          storage, troubleshooting
    07_ray_jobs                           data, exercises, logs, storage, tooling.local_cluster
    08_kuberay                            config, data, exercises, tooling.kuberay
    09_capstone_cifar10_vit               capstone, cifar, cluster, config, display, exercises, fault_tolerance, ingest,
                                          plots, results, runs, session, sizes, storage, training
    10_performance                        cifar, cluster, config, display, exercises, models, plots, profiling, rounds,
                                          runs, storage, streaming, tooling.bench
    11_hyperparameter_search              cluster, display, exercises, fault_tolerance, inference, ingest, plots, runs,
                                          storage, tuning
    12_fsdp                               display, exercises, fault_tolerance, ingest, results, runs, sharding, sizes,
                                          storage, training
    train_capstone.py                     capstone, cifar, cluster, config, results, runs, session, storage,
                                          tooling.scripts
    train_fsdp.py                         cluster, config, ingest, results, runs, session, sharding, sizes,
                                          tooling.scripts
    train_ray_ddp.py                      cluster, config, ddp, results, runs, session, sizes, tooling.scripts
    train_ray_ddp_with_ray_data.py        cluster, config, fault_tolerance, ingest, results, runs, session, sizes,
                                          tooling.scripts
    train_streaming.py                    cluster, config, runs, session, streaming, tooling.memory, tooling.scripts
    tune_ray_ddp.py                       cluster, config, ingest, runs, session, sizes, storage, tooling.scripts,
                                          tuning

The scripts (notebooks/*.py) are the training runs lessons start from a cell or submit as jobs. Below the lesson
modules is the foundation every layer may use: config, storage, auth, logs, sizes (each mode's sizes), rounds (rounds
statistics), data_stats (Ray Data's stats text), system (waiting, ports, the environment) and tooling.ray_internals.
The rest of helpers.tooling drives lessons and sits above them (pyproject.toml's import contract, `lint-imports`).
"""

from helpers.config import ConfigError, CourseConfig, load_config
from helpers.session import setup

__all__ = ["ConfigError", "CourseConfig", "load_config", "setup"]

"""What reaches the notebook from Ray: log levels, warning filters and quiet output, in the driver and in every worker.

`setup()` (helpers.session) applies them: `quiet_driver_logs` once Ray runs in this process, `WORKER_ENV_DEFAULTS`
and `worker_warning_filters` through the runtime env, `quiet_worker_loggers` in each worker as it starts.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator

from helpers.system import wait_until
from helpers.tooling import ray_internals

#: Warnings Ray's own code raises in worker processes, about nothing the learner wrote or can change: Ray Train
#: 2.60 sets a deprecated Ray Data option itself, and every Ray Data-fed fit() printed this warning; and Ray Data's
#: `iter_torch_batches` hands torch a read-only view of a block when a batch lies within one block (small datasets,
#: lesson 11), and torch warns that the array is not writable (ray/data/util/torch_utils.py).
RAY_INTERNAL_WARNINGS = ("ignore:`ExecutionOptions.exclude_resources` is deprecated:DeprecationWarning",
                         "ignore:The given NumPy array is not writable:UserWarning")

#: Set in every worker unless your environment sets them. RAY_DATA_LOG_LEVEL: Ray Data's info lines (each pass over a
#: dataset shard logs its start, its plan and its end, every epoch) stay out of the notebook and out of its log files.
#: RAY_TRAIN_ENABLE_PRINT_PATCH: with Ray Train's print patch on, a print() in the training loop reaches the
#: notebook twice, once as output and once as a log record. KINETO_LOG_LEVEL: torch.profiler's library (Kineto) logs
#: every profiler start and stop to stderr, and torch's CUDA build without a GPU adds "gpuGetDeviceCount failed";
#: 6 is above its highest level (set 4 on a GPU to see Kineto's errors).
WORKER_ENV_DEFAULTS = {"RAY_DATA_LOG_LEVEL": "WARNING", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "KINETO_LOG_LEVEL": "6"}


#: The Jobs SDK's loggers (ray/dashboard/modules/), which log at INFO whatever the "ray" logger's level.
JOB_SDK_LOGGERS = ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk")


def worker_warning_filters() -> str:
    """PYTHONWARNINGS for every worker: this process's own filters, then `RAY_INTERNAL_WARNINGS`."""
    return ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *RAY_INTERNAL_WARNINGS]))


def quiet_worker_loggers() -> None:
    """In a worker process: Ray's per-epoch info lines stay in its log files.

    Ray Train's workers log every `report` as a "Reporting training result ..." line with the whole metrics dict,
    Ray Data warns, once per process, that its progress bars are off (`setup()` turns them off: they change
    on every run), and Ray Train's placement group cleaner warns each time it frees a stopped run's resources.
    Other warnings and errors still reach the notebook.
    """
    logging.getLogger(ray_internals.ray_train_report_logger()).setLevel(logging.WARNING)
    logging.getLogger(ray_internals.RAY_DATA_PROGRESS_LOGGER).setLevel(logging.ERROR)
    logging.getLogger(ray_internals.TRAIN_PLACEMENT_GROUP_CLEANER_LOGGER).addFilter(_not_a_routine_cleanup)


@contextlib.contextmanager
def logger_level(name: str, level: int) -> Iterator[None]:
    """Inside: the logger `name` keeps records below `level` out; its own level comes back afterwards."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _not_a_routine_cleanup(record: logging.LogRecord) -> bool:
    """False for Ray Train's routine warning that it frees the resources of a run whose controller ended: Ray Tune
    ends the controller of every trial it stops (lesson 11). A failed cleanup still reaches the notebook."""
    return not record.getMessage().startswith(ray_internals.TRAIN_PLACEMENT_GROUP_CLEANUP)


def quiet_driver_logs() -> None:
    """Once Ray runs in this process: Ray's warnings (not its info chatter) reach the notebook.

    Ray Data has its own logger, and progress bars that change on every run: `ds.stats()` tells the same story after
    the fact.
    """
    import ray.data  # its import configures its loggers: set the levels after it

    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger(ray_internals.RAY_DATA_PROGRESS_LOGGER).setLevel(logging.ERROR)  # "Progress bars disabled"
    logging.getLogger("ray.data.dataset").addFilter(_drop_cpu_race_warning)
    for name in JOB_SDK_LOGGERS:  # Ray sets them to INFO: "Uploading package ..." for every job this kernel submits
        importlib.import_module(name)  # its import sets the level: set ours after it
        logging.getLogger(name).setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False


#: How long `_drop_cpu_race_warning` waits for a CPU to come back before it lets Ray Data's warning through.
CPU_RACE_WAIT_S = 5.0


def _drop_cpu_race_warning(record: logging.LogRecord) -> bool:
    """Keep Ray Data's "no available CPUs" warning out when it is a race, not a shortage.

    Ray Data warns that "the Ray cluster currently does not have any available CPUs" and that the dataset "will hang"
    when a dataset starts in this process (`materialize()`, `take_batch()`) while the workers of a `fit()` that just
    returned are still handing their CPUs back. If a CPU is free within `CPU_RACE_WAIT_S`, that was the race and the
    warning is dropped; otherwise it is a real shortage and the warning reaches the notebook.
    """
    import ray

    if "does not have any available CPUs" not in record.getMessage():
        return True
    try:
        wait_until(lambda: ray.available_resources().get("CPU", 0) > 0, CPU_RACE_WAIT_S, 0.2, "a free CPU")
    except TimeoutError:
        return True  # a real shortage
    return False


def job_output(log: str) -> list[str]:
    """What the latest job under a submission id printed itself, from its log (`client.get_job_logs(id)`): the lines
    after the job manager's last start line, without Ray's own lines and those Ray forwarded from other processes
    ("(RayTrainWorker pid=...) ...", "(raylet) ...")."""
    lines = log.splitlines()
    starts = [number for number, line in enumerate(lines) if ray_internals.JOB_START_LINE.search(line)]
    latest = lines[starts[-1] + 1:] if starts else lines
    return [line for line in latest
            if not ray_internals.JOB_RAY_LINE.match(line) and not ray_internals.RAY_LOG_LINE.match(line)]

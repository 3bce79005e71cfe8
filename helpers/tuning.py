"""Lesson 11's hyperparameter search: Ray Tune trials that are whole Ray Train runs.

- `train_driver` is the function lesson 11 teaches: one Tune trial, which builds a `TorchTrainer` running lesson 05's
  loop and calls `fit()`. The notebook defines the same code in a cell the learner edits; `tune_ray_ddp.py` imports
  this copy, and tests/test_lesson_code.py fails when the two differ.
- `plan_search` and `check_search_resources` size a search for the cluster: every trial's workers, times the trials
  that train at once, must fit.
- `ResultOrder` stamps every result with the moment Tune's scheduler saw it, so that `asha_decisions` can replay
  ASHA's rule and say why each trial stopped where it did.
- `InterruptMidSearch` stops a search as Ctrl-C or JupyterLab's interrupt button would, mid-search.
- `KillTrialDriver` kills a trial's driver process mid-run, as a lost node would, for Tune's `FailureConfig`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import ray
import ray.tune
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, LoggingConfig, Result, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback
from ray.util.state import list_actors

from helpers import storage
from helpers.cluster import (
    WORKER_GROUP_START_TIMEOUT_VAR,
    Capacity,
    ResourceRequestError,
    cluster_capacity,
    plan_workers,
    resources_per_worker,
    worker_slots,
)
from helpers.config import CourseConfig
from helpers.fault_tolerance import sigkill_on_its_node, train_loop_per_worker
from helpers.logs import logger_level
from helpers.sizes import SIZES
from helpers.tooling import ray_internals

#: What each trial's driver reserves: no CPU, since it only waits for its Ray Train run, and some memory, since Tune
#: refuses a trial that reserves nothing ("Cannot initialize a ResourceRequest with an empty head and zero worker
#: bundles"). Tune's default, 1 CPU per trial, would take CPUs the training workers need.
DRIVER_RESOURCES = {"cpu": 0, "memory": 1024**3}
#: The rows of MNIST every trial trains and validates on: a cut, so that a search of 8 whole runs takes minutes on a
#: laptop. Smoke mode's cut is smaller still.
SEARCH_ROWS = SIZES["full"]["search_rows"]
SMOKE_SEARCH_ROWS = SIZES["smoke"]["search_rows"]


def train_driver(config: dict, datasets: dict, scaling_config: ScalingConfig, storage_path: str,
                 train_loop: Callable[[dict], None] = train_loop_per_worker) -> None:
    """One Tune trial: a whole Ray Train run, with the hyperparameters Tune sampled into `config`."""
    trial = ray.tune.get_context()  # [1] which search, which trial
    trainer = TorchTrainer(
        train_loop,  # [2] lesson 05's loop, unchanged: the workers never see Tune
        train_loop_config=config,  # [3] this trial's lr and global_batch_size, and the settings every trial shares
        datasets=datasets,  # [4] the materialized datasets, the same for every trial
        scaling_config=scaling_config,
        run_config=RunConfig(
            storage_path=storage_path,
            name=f"{trial.get_experiment_name()}-{trial.get_trial_id()}",  # [5] the same name when the trial restarts
            callbacks=[TuneReportCallback()],  # [6] rank 0's metrics and the checkpoint's path, to Tune, every report
            failure_config=FailureConfig(max_failures=1),  # [7] a failed worker: Ray Train restarts the group
            checkpoint_config=CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="test_acc",
                                               checkpoint_score_order="max"),  # [8] its best epoch, and the latest
            logging_config=LoggingConfig(log_level="WARNING"),  # [9] Ray Train's info lines: to its log files
        ),
    )
    trainer.fit()  # [10] returns when the run ends; raises if it fails for good, and Tune marks the trial ERROR


# --- Sizing -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SearchPlan:
    """How many trials train at once, with how many workers each, reserving what, and why."""

    max_concurrent_trials: int
    num_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]
    why: str

    def describe(self) -> str:
        """'2 trials at once x 2 workers x (0.5 CPU) = 4 workers at the peak: <why>'."""
        ask = ", ".join(f"{amount:g} {key}" for key, amount in self.resources_per_worker.items())
        peak = self.max_concurrent_trials * self.num_workers
        return (f"{self.max_concurrent_trials} trial(s) at once x {self.num_workers} worker(s) x ({ask}) = {peak} "
                f"workers at the peak: {self.why}")


def plan_search(cfg: CourseConfig, max_concurrent_trials: int = 2, capacity: Capacity | None = None) -> SearchPlan:
    """Size a search for this cluster: each trial trains setup()'s workers, and at most `max_concurrent_trials` train
    at once, as many as fit.

    On GPUs each worker keeps its GPU, so fewer trials train at once when the GPUs run out. On CPUs the trials share
    the CPUs: each worker gets its share of a node once every trial's workers are placed, a fraction of a CPU if need
    be (a worker still trains with one thread). `capacity` defaults to the running Ray's.
    """
    capacity = cluster_capacity() if capacity is None else capacity
    single = plan_workers(cfg, capacity=capacity)
    if single.use_gpu:
        gpus = worker_slots(ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"GPU": 1.0}), capacity)
        trials = max(1, min(max_concurrent_trials, gpus // single.num_workers))
        peak = plan_workers(cfg, num_workers=trials * single.num_workers, use_gpu=True, capacity=capacity)
        why = f"one GPU per worker, {gpus} GPU(s) in the cluster"
        return SearchPlan(trials, single.num_workers, True, dict(peak.resources_per_worker), why)
    peak_workers = max_concurrent_trials * single.num_workers
    share = plan_workers(cfg, num_workers=peak_workers, use_gpu=False, capacity=capacity).resources_per_worker["CPU"]
    hosts = [node.get("CPU", 0.0) for node in capacity.nodes if node.get("CPU", 0.0) > 0]
    if sum(math.floor(cpus / share + 1e-9) for cpus in hosts) < peak_workers:  # no whole CPU each: share them
        share = max(0.25, math.floor(sum(hosts) / peak_workers * 4) / 4)  # quarters of a CPU: exact fractions for Ray
    why = f"the trials share the cluster's {sum(hosts):g} CPUs"
    return SearchPlan(max_concurrent_trials, single.num_workers, False, {"CPU": share}, why)


def check_search_resources(scaling_config: ScalingConfig, max_concurrent_trials: int,
                           capacity: Capacity | None = None, flags: bool = False) -> None:
    """Raise ResourceRequestError unless `max_concurrent_trials` trials' workers fit the cluster at once.

    Tune starts that many trials, and each trial's Ray Train run asks for all its workers. Runs that do not fit wait:
    Ray Train waits 60 s for the workers' resources, logs WorkerGroupStartupTimeoutError, and asks again, until other
    trials end and free their workers. The search finishes, no faster, with a log full of those errors.
    `capacity` defaults to the running Ray's. The fix names the API (`TuneConfig(...)`), or with `flags` the
    flags of tune_ray_ddp.py (`--max-concurrent-trials`, `--num-workers`).
    """
    capacity = cluster_capacity() if capacity is None else capacity
    per_trial = scaling_config.num_workers
    slots = worker_slots(scaling_config, capacity)
    fit = slots // per_trial
    if fit >= max_concurrent_trials:
        return
    ask = ", ".join(f"{amount:g} {key}" for key, amount in resources_per_worker(scaling_config).items())
    if fit == 0:
        raise ResourceRequestError(
            f"No trial can ever start: each asks for {per_trial} workers x ({ask}), and the cluster holds {slots} "
            f"such worker(s).\nTo fix it: fewer workers per trial{' (--num-workers)' if flags else ''}, or less for "
            "each worker.")
    raise ResourceRequestError(
        f"{max_concurrent_trials} trials at once ask for {max_concurrent_trials} x {per_trial} workers x ({ask}), "
        f"and the cluster holds {slots} such worker(s): the workers of only {fit} trial(s) fit at once. The other "
        f"trials would start and wait for theirs, Ray Train logging WorkerGroupStartupTimeoutError every "
        f"{os.environ.get(WORKER_GROUP_START_TIMEOUT_VAR, '60')} s until a trial ends.\n"
        f"To fix it: {f'--max-concurrent-trials {fit}' if flags else _limit_trials(fit)}.")


def _limit_trials(trials: int) -> str:
    """Where a notebook's search sets how many trials run at once (Ray 2.60, ray/tune/tune.py: beside a search_alg
    that is no Searcher, TuneConfig's max_concurrent_trials is ignored with a warning)."""
    return (f"at most {trials} trial(s) at once: max_concurrent={trials} on your BasicVariantGenerator, or "
            f"TuneConfig(max_concurrent_trials={trials}) without a search_alg")


# --- The order in which Tune's scheduler saw the results -----------------------------------------------------------

#: A trial's id in the name of its folder, as Tune 2.60 names it: "<trainable>_<trial id>_<index>_<config>_<date>",
#: the id being 5 hex digits of the search and the trial's number.
TRIAL_ID_IN_FOLDER = re.compile(r"_([0-9a-f]{5}_\d{5})_")
#: The keys `ResultOrder` adds to every result: when the driver's scheduler saw it, and which `fit()` saw it.
ARRIVED_AT, SEARCH_SESSION = "arrived_at", "search_session"


class ResultOrder(ray.tune.Callback):
    """Stamps every result with the time Tune's scheduler saw it and the `fit()` it belongs to (a restored search
    is a new one), so that the order of results across trials can be read back from the results themselves.

    Tune calls its callbacks in the driver, one result after another, after the scheduler's decision and before
    its loggers write the result to the trial's folder (Ray 2.60, TuneController._process_trial_result).
    """

    def setup(self, **info: Any) -> None:
        self._session = time.time()

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        result[ARRIVED_AT] = time.time()
        result[SEARCH_SESSION] = getattr(self, "_session", 0.0)


# --- Reading a search's results ------------------------------------------------------------------------------------

def trial_histories(grid: ray.tune.ResultGrid) -> pd.DataFrame:
    """Every result of every trial, one row each, in the order the driver saw them: `trial_id`, the sampled `lr`
    and `global_batch_size`, and the reported metrics."""
    frames = []
    for result in grid:
        frame = result.metrics_dataframe
        if frame is None or frame.empty:
            continue
        frame = frame.copy()
        frame["trial_id"] = result.metrics.get("trial_id") if result.metrics else None
        frame["lr"] = result.config["lr"]
        frame["global_batch_size"] = result.config["global_batch_size"]
        frames.append(frame)
    history = pd.concat(frames, ignore_index=True)
    order = ARRIVED_AT if ARRIVED_AT in history else "timestamp"
    return history.sort_values(order, kind="stable").reset_index(drop=True)


def asha_decisions(history: pd.DataFrame, metric: str, mode: str, time_attr: str, grace_period: int,
                   reduction_factor: float, max_t: int) -> pd.DataFrame:
    """Replay ASHA (one bracket) on `trial_histories`' rows, in order: at each rung a result reaches, the cutoff it
    met and the decision. A restored search starts with empty rungs, as Tune does not save its scheduler's state.

    ASHA's rule (Ray 2.60, ray/tune/schedulers/async_hyperband.py): rungs at `grace_period * reduction_factor**k`
    up to `max_t`; a result that reaches a rung first records its value there; it stops when the value is below
    the `1 - 1/reduction_factor` quantile of the values recorded at that rung before it. At `max_t` every trial stops,
    unrecorded. When a trial ends (its result says `done`), Tune hands its last result to ASHA once more, which
    records it at the highest rung it reached without a value there: a trial that resumed past a rung (its epoch
    there ended while the search stopped) counts at that rung from then on.
    """
    num_rungs = int(np.log(max_t / grace_period) / np.log(reduction_factor) + 1)
    milestones = sorted((grace_period * reduction_factor**k for k in range(num_rungs)), reverse=True)
    sign = 1.0 if mode == "max" else -1.0

    def reached_rung(rungs: dict, trial: str, time_value: float) -> float | None:
        """The rung this result records at, as ASHA's bracket picks it: the highest it reached, unless the trial has
        a value there already (then no new cutoff: None). None too below the lowest rung."""
        for milestone in milestones:
            if time_value >= milestone:
                return None if trial in rungs[milestone] else milestone
        return None

    rows: list[dict[str, Any]] = []
    rungs: dict[float, dict[str, float]] = {}  # per rung (milestone): each trial's value there, signed
    session = None
    for _, result in history.iterrows():
        if result.get(SEARCH_SESSION, None) != session:
            session, rungs = result.get(SEARCH_SESSION, None), {milestone: {} for milestone in milestones}
        time_value, value, trial = result[time_attr], result[metric], result["trial_id"]
        if time_value >= max_t:
            rows.append({"trial_id": trial, time_attr: time_value, metric: value, "rung": None, "cutoff": None,
                         "decision": "end (max_t)"})
        elif (milestone := reached_rung(rungs, trial, time_value)) is not None:
            recorded = rungs[milestone]
            cutoff = np.nanpercentile(list(recorded.values()), (1 - 1 / reduction_factor) * 100) if recorded else None
            stop = cutoff is not None and sign * value < cutoff
            recorded[trial] = sign * value
            rows.append({"trial_id": trial, time_attr: time_value, metric: value, "rung": milestone,
                         "cutoff": None if cutoff is None else sign * cutoff, "compared_with": len(recorded) - 1,
                         "earlier": [sign * earlier for name, earlier in recorded.items() if name != trial],
                         "decision": "stop" if stop else "continue"})
        if result.get("done", False) and (milestone := reached_rung(rungs, trial, time_value)) is not None:
            rungs[milestone][trial] = sign * value  # the trial's end: recorded, no decision
    return pd.DataFrame(rows, columns=["trial_id", time_attr, metric, "rung", "cutoff", "compared_with", "earlier",
                                       "decision"])


def trial_table(history: pd.DataFrame, decisions: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """One row per trial: its sampled config, the epochs it trained, its last `metric`, and, for a trial ASHA
    stopped, why (its value at the rung against the rung's cutoff then)."""
    rows = []
    stops = decisions[decisions["decision"] == "stop"].set_index("trial_id")
    for trial_id, results in history.groupby("trial_id", sort=True):
        last = results.iloc[-1]
        row = {"trial_id": trial_id, "lr": last["lr"], "global_batch_size": last["global_batch_size"],
               "epochs": int(results["epoch"].max()) + 1, metric: last[metric], "stopped early": trial_id in stops.index,
               "why": ""}
        if trial_id in stops.index:
            stop = stops.loc[trial_id]
            row["why"] = (f"after epoch {int(stop['epoch'])}: {stop[metric]:.3f} < {stop['cutoff']:.3f}, the cutoff of "
                          f"the {int(stop['compared_with'])} trial(s) there before it")
        rows.append(row)
    return pd.DataFrame(rows).set_index("trial_id")


def print_search(results: ray.tune.ResultGrid, experiment_path: str, metric: str = "test_acc") -> bool:
    """Print a search's trials, its best trial and that trial's checkpoint, and the nodes the trials trained on;
    when it was interrupted, say how to continue it. Returns whether every trial finished."""
    history = trial_histories(results)
    table = history.groupby("trial_id").agg(lr=("lr", "last"), global_batch_size=("global_batch_size", "last"),
                                            epochs=("epoch", lambda epochs: int(epochs.max()) + 1),
                                            **{metric: (metric, "last")})
    print(table.to_string())
    best = results.get_best_result(metric=metric, mode="max")
    print(f"best trial: {best.metrics['trial_id']}, lr={best.config['lr']:.2e}, "
          f"global_batch_size={best.config['global_batch_size']}, {metric}={best.metrics[metric]:.4f}")
    # From the trial's run, not from Tune's last result: an epoch that ended while Tune stopped the trials (Ctrl-C)
    # is in the run's checkpoints only, and the checkpoint Tune last saw may be deleted since (num_to_keep).
    checkpoint, metrics = best_kept_checkpoint(f"{experiment_path}-{best.metrics['trial_id']}", metric)
    print(f"its best checkpoint: epoch {metrics['epoch']}, {metric}={metrics[metric]:.4f}, "
          f"{storage.uri(checkpoint.path, checkpoint.filesystem)}")
    nodes = sorted(set(history["node_id"].dropna()))
    print(f"the trials' rank 0 ran on {len(nodes)} node(s): {', '.join(node[:8] for node in nodes)}")
    statuses = trial_statuses(experiment_path)
    done = sum(status in ("TERMINATED", "ERROR") for status in statuses.values())
    if done < len(statuses):
        print(f"interrupted: {done} of {len(statuses)} trials finished. To continue, run the same command with "
              f"--name {storage.basename(experiment_path)}")
    return done == len(statuses)


def best_kept_checkpoint(run_path: str, metric: str) -> tuple[Checkpoint, dict[str, Any]]:
    """The checkpoint of a Ray Train run, among those still kept, with the highest `metric`, and its metrics."""
    filesystem, path = storage.resolve(run_path)
    with logger_level(ray_internals.TRAIN_CHECKPOINT_MANAGER_LOGGER, logging.WARNING):  # not "will resume from it"
        run = Result.from_path(path, storage_filesystem=filesystem)
    return max(run.best_checkpoints, key=lambda kept: kept[1][metric])


@contextlib.contextmanager
def trial_errors_in_files_only() -> Iterator[None]:
    """Inside: a failed trial's traceback stays in its `error.txt` (in the trial's folder) instead of being logged
    into the notebook by Tune's driver as well; `Result.error` still holds the exception."""
    with logger_level("ray.tune", logging.CRITICAL):
        yield


# --- Interrupting a search ---------------------------------------------------------------------------------------

def trial_progress(experiment_path: str) -> dict[str, dict]:
    """Each trial of a search so far, read from its `result.json` under the experiment folder: how many results it
    has, and whether its last one says `done` (stopped by the scheduler, or at its end)."""
    progress: dict[str, dict] = {}
    if not storage.is_dir(experiment_path):
        return progress
    for entry in storage.list_dir(experiment_path):
        results = storage.join(experiment_path, entry.base_name, "result.json")
        if not storage.is_file(results):
            continue
        lines = storage.read_text(results).strip().splitlines()
        try:
            last = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:  # Tune is writing the line: count the others
            lines, last = lines[:-1], {}
        named = TRIAL_ID_IN_FOLDER.search(entry.base_name)  # "<trainable>_<trial id>_<index>_<config>_<date>"
        trial_id = last.get("trial_id") or (named.group(1) if named else entry.base_name)
        progress[trial_id] = {"results": len(lines), "done": bool(last.get("done"))}
    return progress


def trial_statuses(experiment_path: str) -> dict[str, str]:
    """Each trial's status in the search's latest saved state (TERMINATED: finished), as `Tuner.restore` reads it."""
    states = sorted(entry.base_name for entry in storage.list_dir(experiment_path)
                    if fnmatch.fnmatch(entry.base_name, ray_internals.TUNE_STATE_FILES))
    if not states:
        return {}
    return ray_internals.tune_trial_statuses(json.loads(storage.read_text(storage.join(experiment_path, states[-1]))))


def search_state(experiment_path: str) -> pd.DataFrame:
    """One row per trial of a search, from its storage path: its status in the state Tune saved last, and how many
    results it had reported."""
    progress = trial_progress(experiment_path)
    rows = {trial: {"status": status, "results": progress.get(trial, {}).get("results", 0)}
            for trial, status in trial_statuses(experiment_path).items()}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("trial_id").sort_index()


class KillTrialDriver(ray.tune.Callback):
    """SIGKILLs the process of a trial's driver once Tune has the trial's result of `epoch` (which came with its
    checkpoint), as the loss of the driver's node would: its Ray Train run, whose controller and workers the driver
    owns, dies with it. Kills once; the copy Tune saves with the search never does. `killed` says whose process."""

    def __init__(self, epoch: int = 0) -> None:
        self._epoch, self._armed = epoch, True
        self.killed: dict | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_armed": False}

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if not (self._armed and result.get("epoch") == self._epoch):
            return
        self._armed = False
        actor_id = ray_internals.tune_trial_actor_id(trial)
        if actor_id is None:  # Tune hands a result over only from a running trial, which has its actor
            raise RuntimeError(f"trial {trial.trial_id} has no actor")
        (driver,) = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("actor_id", "=", actor_id)])
        if driver.pid is None or driver.node_id is None:  # an actor that reported a result has both
            raise RuntimeError(f"the driver of trial {trial.trial_id} has no process or node")
        sigkill_on_its_node(driver.pid, driver.node_id)
        self.killed = {"trial_id": trial.trial_id, "pid": driver.pid, "epoch": self._epoch}


class InterruptMidSearch(ray.tune.Callback):
    """Sends this process SIGINT, what Ctrl-C or JupyterLab's interrupt button sends, at a moment that shows every
    case `Tuner.restore` handles: once a trial has finished and another has just reported its first epoch (`epoch`
    0, with its checkpoint), that trial stops in the middle of its run; trials Tune has not started yet stay so.

    Tune calls it in the driver, after the scheduler's decision on the result (ASHA never stops a trial at epoch 0
    with `grace_period=1`), and stops the search when the signal arrives. It presses once. Tune saves its callbacks
    with the search when `fit()` starts, and the copy that `Tuner.restore` brings back never presses.
    """

    def __init__(self) -> None:
        self._armed = True

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_armed": False}  # the saved copy: a restored search runs to its end

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        finished = any(other.status == "TERMINATED" for other in trials)
        if self._armed and finished and result.get("epoch") == 0:
            self._armed = False
            os.kill(os.getpid(), signal.SIGINT)

"""A record of every Ray Train run a process starts: when each phase of its start-up ended, and every report.

Ray Train 2.60 builds the callbacks named in RAY_TRAIN_CALLBACKS (`module.Class`, comma-separated) at each `fit()`,
in the process that calls it, and hands them to the run's controller, which runs on that process's node
(train/v2/_internal/callbacks/env_callback.py, api/data_parallel_trainer.py). With
`RAY_TRAIN_CALLBACKS=helpers.tooling.run_recorder.RunRecorder` and COURSE_RUN_RECORD naming a file, every run, from a
notebook's cell, a script or a Tune trial, appends JSON lines to that file on the node that called `fit()`, untouched
code and all: `setup()` passes both variables on to every Ray worker (`helpers.session.runtime_env`). Local mode
(`num_workers=0`) builds no callbacks and records nothing. A recorder that cannot write stops recording with one
warning: it never fails a run. The GPU lane (`helpers.tooling.gpu_lane`) reads the records to split each run's
start-up between Ray and the course:

| event | when (the controller's clock; one machine) |
| --- | --- |
| `fit` | `fit()` was called (the callback is built then) |
| `controller_started` | Ray Train's controller actor runs, its resource request registered |
| `workers_started` | the worker actors are up (placement group, processes, `import`s, the datasets' split coordinator) |
| `training_started` | the process group set up, Ray Data's context sent, the training function launched |
| `report` | every worker reported; the metrics of the lowest reporting rank (rank 0, unless a preemption narrowed it) |
| `finished` | the controller has the run's result |

What happens between `training_started` and the first epoch (reading data, building loaders and the model; a
dataset's shard is split at the loop's first `get_dataset_shard`) is the course's part; a loop that reports
`epoch_started_at` (lessons 02-05) or `start_s` (lesson 09) says when that was.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from typing import Any

from helpers.session import RUN_RECORD_VAR
from helpers.tooling import ray_internals

#: The file every RunRecorder appends to (unset: it records nothing). `setup()` passes it on to every Ray worker.
RECORD_VAR = RUN_RECORD_VAR
CALLBACK_PATH = "helpers.tooling.run_recorder.RunRecorder"


def recording_env(record_file: str) -> dict[str, str]:
    """The variables that make every Ray Train run of a process (and of the Ray it starts) append to `record_file`."""
    return {ray_internals.TRAIN_CALLBACKS_VAR: CALLBACK_PATH, RECORD_VAR: str(record_file)}


def _plain(value: Any) -> Any:
    """A metric as JSON holds it: numbers and strings as they are, anything else as its text."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return value if math.isfinite(value) else str(value)
    return str(value)


class RunRecorder(*ray_internals.train_run_callback_bases()):  # type: ignore[misc]  # bases found at run time
    """Appends one JSON line per start-up phase and per report of a Ray Train run to the file RUN_RECORD names."""

    def __init__(self):
        self.path = os.environ.get(RECORD_VAR) or None
        self.fit_at = time.time()
        self.run = None

    def _write(self, event: str, at: float | None = None, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"run": self.run, "event": event, "t": time.time() if at is None else at, **fields})
        try:  # one write of a short line to a file opened for appending: lines of several runs never interleave
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(descriptor, (line + "\n").encode())
            finally:
                os.close(descriptor)
        except OSError as error:  # an exception in a callback would fail the run (Ray Train's controller raises it)
            warnings.warn(f"The run recorder stops recording run {self.run}: {error}", RuntimeWarning, stacklevel=2)
            self.path = None

    def after_controller_start(self, train_run_context) -> None:
        self.run = train_run_context.run_config.name
        self._write("fit", at=self.fit_at)
        self._write("controller_started")

    def after_worker_group_start(self, worker_group) -> None:
        self._write("workers_started", num_workers=len(worker_group.get_workers()))

    def after_worker_group_training_start(self, worker_group) -> None:
        self._write("training_started")

    def after_report(self, training_report, metrics: list[dict[str, Any]]) -> None:
        first = metrics[0] if metrics else {}
        self._write("report", metrics={key: _plain(value) for key, value in first.items()})

    def after_controller_finish(self, result) -> None:
        self._write("finished", error=None if result.error is None else type(result.error).__name__)


def read_records(path: str) -> list[dict[str, Any]]:
    """The records in `path`, in the order they were written (none when the file is missing)."""
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _first_epoch_at(fit_at: float, metrics: dict[str, Any]) -> float | None:
    """When the first epoch began, from what the loop reported: `epoch_started_at` (wall clock) or `start_s`
    (seconds after the driver launched the run, as lesson 09 counts them)."""
    if isinstance(metrics.get("epoch_started_at"), int | float):
        return float(metrics["epoch_started_at"])
    if isinstance(metrics.get("start_s"), int | float):
        return fit_at + float(metrics["start_s"])
    return None


def summarize_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per recorded run: its start-up split into Ray's part and the course's, and its reported figures.

    Seconds, each between two events of the run: `controller_s` (fit() to the controller running), `workers_s`
    (to the worker actors up), `process_group_s` (to the training function launched: process group and datasets),
    then the course's `data_and_model_s` (to the first epoch's start, when the loop reports it) and
    `to_first_report_s` (training launched to the first report). Metrics are rank 0's: the last report's
    `test_acc`, the median `images_per_s` of the reports.
    """
    runs: dict[str, dict[str, Any]] = {}
    for record in records:
        run = runs.setdefault(record["run"], {"run": record["run"], "events": {}, "reports": []})
        if record["event"] == "report":
            run["reports"].append(record)
        else:
            run["events"].setdefault(record["event"], record)  # the first worker group: a restart adds more
    rows = []
    for name, run in runs.items():
        at = {event: record["t"] for event, record in run["events"].items()}
        row: dict[str, Any] = {"run": name, "num_workers": run["events"].get("workers_started", {}).get("num_workers"),
                               "reports": len(run["reports"]), "finished": "finished" in at,
                               "error": run["events"].get("finished", {}).get("error")}
        phases = (("controller_s", "fit", "controller_started"), ("workers_s", "controller_started", "workers_started"),
                  ("process_group_s", "workers_started", "training_started"))
        for key, start, end in phases:
            row[key] = round(at[end] - at[start], 2) if start in at and end in at else None
        row["ray_startup_s"] = round(at["training_started"] - at["fit"], 2) if {"fit", "training_started"} <= set(at) \
            else None
        first = run["reports"][0] if run["reports"] else None
        epoch_at = _first_epoch_at(at["fit"], first["metrics"]) if first and "fit" in at else None
        started = at.get("training_started")
        row["data_and_model_s"] = round(epoch_at - started, 2) if epoch_at is not None and started else None
        row["to_first_report_s"] = round(first["t"] - started, 2) if first and started else None
        metrics = [report["metrics"] for report in run["reports"]]
        accuracies = [m["test_acc"] for m in metrics if isinstance(m.get("test_acc"), int | float)]
        rates = [m["images_per_s"] for m in metrics if isinstance(m.get("images_per_s"), int | float)]
        row["test_acc"] = round(accuracies[-1], 4) if accuracies else None
        row["images_per_s"] = round(statistics.median(rates), 1) if rates else None
        row["device"] = next((m["device"] for m in metrics if isinstance(m.get("device"), str)), None)
        rows.append(row)
    return rows

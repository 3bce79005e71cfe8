"""Reading what a Ray Train run leaves behind: every report's metrics, and the run folder on disk.

`Result.metrics_dataframe` has one row per checkpoint in `Result.best_checkpoints` (the best `num_to_keep` by score):
reports without a checkpoint, deleted checkpoints and a latest checkpoint outside the best are not in it.
`MetricsHistory` records every report (and every worker failure) as it happens.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pandas as pd
import pyarrow.fs as pafs
from ray.train import Result, UserCallback

from helpers import storage

#: The file `MetricsHistory` appends to, inside the run folder (`storage_path/name`).
HISTORY_FILE = "metrics_history.jsonl"
#: Ray Train's own record of the run's checkpoints, inside the run folder (Ray 2.60).
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"


def run_path(storage_path: str, name: str) -> str:
    """The run folder Ray Train uses for `RunConfig(storage_path=..., name=...)`: a local path or a URI."""
    return storage.join(storage_path, name)


def run_folder(run: str | Result) -> str:
    """A run folder given as a path or URI, or the folder of a `Result` (whose `.path` has no scheme on S3)."""
    return storage.uri(run.path, run.filesystem) if isinstance(run, Result) else str(run)


class MetricsHistory(UserCallback):
    """Appends every report (rank 0's metrics) and every worker failure to the run folder's history file.

    Ray Train calls it in the controller process after each `ray.train.report` of all workers, and after
    worker errors; it survives worker restarts, and a re-run of the same run name appends to the same file.
    `worker_nodes` lists the node each rank ran on, when the loop reports a `node_id`.
    """

    def _append(self, run_context, row: dict[str, Any]) -> None:
        run_config = run_context.get_run_config()
        path = storage.join(run_path(run_config.storage_path, run_config.name), HISTORY_FILE)
        line = json.dumps({"event": row.pop("event"), "time": time.time(), **row}, default=str)
        storage.append_line(path, line)  # an object store (s3://) cannot append: there, the file is rewritten

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        nodes = [rank_metrics.get("node_id") for rank_metrics in metrics]
        self._append(run_context, {"event": "report", **metrics[0],
                                   "checkpoint": storage.basename(checkpoint.path) if checkpoint else None,
                                   **({"worker_nodes": nodes} if any(nodes) else {})})

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for rank, error in sorted(worker_exceptions.items()):
            message = str(error).strip().splitlines()
            self._append(run_context, {"event": "failure", "rank": rank,
                                       "error": f"{type(error).__name__}: {message[-1] if message else ''}"})


def read_history(run: str | Result) -> pd.DataFrame:
    """The history `MetricsHistory` wrote for a run (its folder, or its `Result`), one row per event, oldest first.

    A `kept` column says whether each report's checkpoint is still in the run folder.
    """
    folder = run_folder(run)
    file = storage.join(folder, HISTORY_FILE)
    if not storage.is_file(file):
        raise FileNotFoundError(f"No {HISTORY_FILE} in {folder}: pass RunConfig(callbacks=[MetricsHistory()]) to fit().")
    history = pd.read_json(io.StringIO(storage.read_text(file)), lines=True)
    if "checkpoint" in history:
        checkpoints = {entry.base_name for entry in storage.list_dir(folder) if entry.type == pafs.FileType.Directory}
        history["kept"] = [name in checkpoints for name in history["checkpoint"]]
    return history


def latest_checkpoint_metrics(run: str | Result) -> dict[str, Any] | None:
    """The metrics of the latest checkpoint Ray Train has registered for a run (folder or `Result`), or None.

    Read from Ray Train's snapshot file: a checkpoint listed there is the one a restart resumes from.
    """
    file = storage.join(run_folder(run), SNAPSHOT_FILE)
    if not storage.is_file(file):
        return None
    latest = json.loads(storage.read_text(file)).get("latest_checkpoint_result")
    return latest["metrics"] if latest else None


#: What each file of a Ray Train run folder is (Ray 2.60), by name.
RUN_FOLDER_FILES = {
    SNAPSHOT_FILE: "Ray Train's index of the kept checkpoints and their metrics: what a restart resumes from",
    HISTORY_FILE: "every report and failure, written by the course's MetricsHistory callback",
    ".validate_storage_marker": "written by Ray Train to check that every node can reach the storage path",
}
CHECKPOINT_FOLDER = "a checkpoint: the folder rank 0 passed to ray.train.report, copied here"


def describe_run_folder(run: str | Result) -> pd.DataFrame:
    """The entries of a run folder (or a `Result`'s) with their size and what each one is; checkpoint folders
    list their files."""
    folder = run_folder(run)
    rows = []
    for entry in storage.list_dir(folder):
        path = storage.join(folder, entry.base_name)
        if entry.type == pafs.FileType.Directory:
            what = CHECKPOINT_FOLDER if entry.base_name.startswith("checkpoint_") else ""
            files = ", ".join(item.base_name for item in storage.list_dir(path))
        else:
            what, files = RUN_FOLDER_FILES.get(entry.base_name, ""), ""
        rows.append({"entry": entry.base_name + ("/" if entry.type == pafs.FileType.Directory else ""), "files": files,
                     "size_mb": round(storage.size(path) / 1e6, 1), "what it is": what})
    return pd.DataFrame(rows)

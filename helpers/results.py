"""Reading what a Ray Train run leaves behind: every report's metrics, and the run folder on disk.

`Result.metrics_dataframe` has one row per checkpoint Ray Train *kept*; with `CheckpointConfig(num_to_keep=...)`
the others are gone from it. `MetricsHistory` records every report (and every worker failure) as it happens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
from ray.train import UserCallback

#: The file `MetricsHistory` appends to, inside the run folder (`storage_path/name`).
HISTORY_FILE = "metrics_history.jsonl"
#: Ray Train's own record of the run's checkpoints, inside the run folder (Ray 2.60).
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"


def run_path(storage_path: str | Path, name: str) -> Path:
    """The run folder Ray Train uses for `RunConfig(storage_path=..., name=...)`."""
    return Path(storage_path) / name


class MetricsHistory(UserCallback):
    """Appends every report (rank 0's metrics) and every worker failure to the run folder's history file.

    Ray Train calls it in the controller process after each `ray.train.report` of all workers, and after
    worker errors; it survives worker restarts, and a re-run of the same run name appends to the same file.
    """

    def _append(self, run_context, row: dict[str, Any]) -> None:
        run_config = run_context.get_run_config()
        path = run_path(run_config.storage_path, run_config.name) / HISTORY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as history:
            history.write(json.dumps({"event": row.pop("event"), "time": time.time(), **row}, default=str) + "\n")

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self._append(run_context, {"event": "report", **metrics[0],
                                   "checkpoint": Path(checkpoint.path).name if checkpoint else None})

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for rank, error in sorted(worker_exceptions.items()):
            message = str(error).strip().splitlines()
            self._append(run_context, {"event": "failure", "rank": rank,
                                       "error": f"{type(error).__name__}: {message[-1] if message else ''}"})


def read_history(path: str | Path) -> pd.DataFrame:
    """The history `MetricsHistory` wrote for the run folder `path`, one row per event, oldest first.

    A `kept` column says whether each report's checkpoint is still on disk.
    """
    file = Path(path) / HISTORY_FILE
    if not file.is_file():
        raise FileNotFoundError(f"No {HISTORY_FILE} in {path}: pass RunConfig(callbacks=[MetricsHistory()]) to fit().")
    history = pd.read_json(file, lines=True)
    if "checkpoint" in history:
        history["kept"] = [bool(name) and (Path(path) / name).is_dir() if isinstance(name, str) else False
                           for name in history["checkpoint"]]
    return history


def latest_checkpoint_metrics(path: str | Path) -> dict[str, Any] | None:
    """The metrics of the latest checkpoint Ray Train has registered for the run folder `path`, or None.

    Read from Ray Train's snapshot file: a checkpoint listed there is the one a restart resumes from.
    """
    file = Path(path) / SNAPSHOT_FILE
    if not file.is_file():
        return None
    latest = json.loads(file.read_text()).get("latest_checkpoint_result")
    return latest["metrics"] if latest else None


def _size(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file()) if path.is_dir() else path.stat().st_size


#: What each file of a Ray Train run folder is (Ray 2.60), by name.
RUN_FOLDER_FILES = {
    SNAPSHOT_FILE: "Ray Train's index of the kept checkpoints and their metrics: what a restart resumes from",
    HISTORY_FILE: "every report and failure, written by the course's MetricsHistory callback",
    ".validate_storage_marker": "written by Ray Train to check that every node can reach the storage path",
}
CHECKPOINT_FOLDER = "a checkpoint: the folder rank 0 passed to ray.train.report, copied here"


def describe_run_folder(path: str | Path) -> pd.DataFrame:
    """The entries of a run folder with their size and what each one is; checkpoint folders list their files."""
    rows = []
    for entry in sorted(Path(path).iterdir()):
        if entry.is_dir():
            what = CHECKPOINT_FOLDER if entry.name.startswith("checkpoint_") else ""
            files = ", ".join(sorted(item.name for item in entry.iterdir()))
        else:
            what, files = RUN_FOLDER_FILES.get(entry.name, ""), ""
        rows.append({"entry": entry.name + ("/" if entry.is_dir() else ""), "files": files,
                     "size_mb": round(_size(entry) / 1e6, 1), "what it is": what})
    return pd.DataFrame(rows)

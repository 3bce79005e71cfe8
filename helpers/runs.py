"""Where lessons keep what they produce: one new folder per run, and a summary per lesson."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


def new_run_dir(storage_path: str | Path, lesson: str) -> Path:
    """Create and return a fresh `<storage_path>/<lesson>/<timestamp>` folder.

    Never reuses a folder, so re-running a lesson cannot overwrite an earlier run's files.
    """
    parent = Path(storage_path) / lesson
    parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("run-%Y%m%d-%H%M%S")
    for suffix in range(1000):
        run_dir = parent / (stamp if suffix == 0 else f"{stamp}-{suffix}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir
    raise RuntimeError(f"Could not create a new run folder under {parent}: clean up old runs there.")


def summary_path(storage_path: str | Path, lesson: str) -> Path:
    """Where a lesson's latest summary lives: `<storage_path>/summaries/<lesson>.json`."""
    return Path(storage_path) / "summaries" / f"{lesson}.json"


def save_summary(storage_path: str | Path, lesson: str, summary: dict) -> Path:
    """Record a lesson's headline numbers (time, accuracy, ...) for later lessons to compare."""
    path = summary_path(storage_path, lesson)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


def load_summary(storage_path: str | Path, lesson: str) -> dict | None:
    """A lesson's latest summary, or None when that lesson has not been run here yet."""
    path = summary_path(storage_path, lesson)
    return json.loads(path.read_text()) if path.is_file() else None


def new_run_name(lesson: str) -> str:
    """A Ray Train run name that is new each time: `<lesson>-run-<timestamp>`.

    Ray Train resumes a run whose name already exists under the storage path, so a fresh
    name keeps re-runs of a lesson from continuing (or mixing with) an earlier run.
    """
    return f"{lesson}-{datetime.now().strftime('run-%Y%m%d-%H%M%S-%f')}"

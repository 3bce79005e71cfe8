"""Where lessons keep what they produce: one new folder per run, and a summary per lesson.

Every path here is under the storage path, a local folder or a URI (see `helpers.storage`).
"""

from __future__ import annotations

import json
from datetime import datetime

from helpers import storage


def new_run_dir(storage_path: str, lesson: str) -> str:
    """Create and return a fresh `<storage_path>/<lesson>/run-<timestamp>` folder.

    Never reuses a folder, so re-running a lesson cannot overwrite an earlier run's files. The name carries
    microseconds, since an object store has no atomic "create this folder only if it is new".
    """
    for _ in range(100):
        run_dir = storage.join(storage_path, lesson, datetime.now().strftime("run-%Y%m%d-%H%M%S-%f"))
        if not storage.exists(run_dir):
            storage.makedirs(run_dir)
            return run_dir
    raise RuntimeError(f"Could not create a new run folder under {storage.join(storage_path, lesson)}.")


def summary_path(storage_path: str, lesson: str) -> str:
    """Where a lesson's latest summary lives: `<storage_path>/summaries/<lesson>.json`."""
    return storage.join(storage_path, "summaries", f"{lesson}.json")


def save_summary(storage_path: str, lesson: str, summary: dict) -> str:
    """Record a lesson's headline numbers (time, accuracy, ...) for later lessons to compare."""
    path = summary_path(storage_path, lesson)
    storage.write_text(path, json.dumps(summary, indent=2, default=str) + "\n")
    return path


def load_summary(storage_path: str, lesson: str) -> dict | None:
    """A lesson's latest summary, or None when that lesson has not been run here yet."""
    path = summary_path(storage_path, lesson)
    return json.loads(storage.read_text(path)) if storage.is_file(path) else None


def new_run_name(lesson: str) -> str:
    """A Ray Train run name that is new each time: `<lesson>-run-<timestamp>`.

    Ray Train resumes a run whose name already exists under the storage path, so a fresh
    name keeps re-runs of a lesson from continuing (or mixing with) an earlier run.
    """
    return f"{lesson}-{datetime.now().strftime('run-%Y%m%d-%H%M%S-%f')}"

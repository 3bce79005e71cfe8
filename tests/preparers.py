"""The preparers of tests/test_shared_datasets.py and tests/test_shared_datasets_ray.py, and their race.

A preparer is a process of its own that prepares one dataset as the course does (`python -m tests.preparers SPEC`,
SPEC as JSON) and prints what it read; `killed_then_concurrent` kills one half-way through its write, then releases
CONCURRENT others together, and checks that each got a whole copy and that the leftover was left as it was.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from helpers import storage
from helpers.system import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Preparers released together: three, as lessons 03, 05 and 11 were (two suffice to clobber a copy).
CONCURRENT = 3
#: Files the mechanism test's writer writes, one every WRITE_PAUSE_S: the writes overlap.
FILES = 4
WRITE_PAUSE_S = 0.1
#: CIFAR-10 rows per split in the publish test.
CIFAR_ROWS = {"train": 50, "test": 20}


# --- One preparer (a process of its own) --------------------------------------------------------------------------

def _slow_writer(hang: bool):
    """A writer for `write_once` that takes its time: FILES files, each saying which process wrote it."""
    def write(copy: str) -> dict:
        for index in range(FILES):
            storage.write_text(storage.join(copy, f"part-{index}.txt"), f"{os.getpid()}\n")
            time.sleep(3600 if hang and index == 1 else WRITE_PAUSE_S)  # hang: killed with 2 of the files written
        return {"files": FILES, "pid": os.getpid()}
    return write


def cifar_split(train: bool) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in for CIFAR-10's split (the download needs the internet): the same images in every process."""
    rows = CIFAR_ROWS["train" if train else "test"]
    images = np.random.default_rng(int(train)).integers(0, 256, (rows, 32, 32, 3), dtype=np.uint8)
    return images, np.arange(rows) % 10


def _prepare(spec: dict) -> dict:
    """Prepare `spec["dataset"]` as the course does, then read what that returned: the folder and its rows."""
    dataset, hang = spec["dataset"], spec.get("hang", False)
    # Imports first: they take seconds, and the preparers should reach the dataset at the same moment.
    if dataset == "cifar":
        from helpers.cifar import read_split, write_cifar10_parquet
    elif dataset != "mechanism":
        import ray
        import ray.data

        import helpers
        from helpers.ingest import write_mnist_parquet
        from helpers.streaming import synthetic_folder

        env_vars = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
        ray.init(address=spec["ray"], runtime_env={"py_modules": [str(Path(helpers.__file__).parent)],
                                                   "env_vars": env_vars}, logging_level=logging.ERROR)
        ray.data.DataContext.get_current().enable_progress_bars = False
    if spec.get("go"):  # ready: wait for the others, so that every preparer looks for a copy at the same moment
        Path(spec["go"]).with_name(f"ready-{os.getpid()}").touch()
        wait_until(lambda: Path(spec["go"]).exists(), 120, 0.02, "the go file")

    if dataset == "mechanism":
        folder = storage.write_once(spec["root"], _slow_writer(hang))
        parts = [storage.read_text(storage.join(folder, f"part-{index}.txt")) for index in range(FILES)]
        return {"folder": folder, "rows": {"parts": len(parts), "writers": len(set(parts))}}
    if dataset == "cifar":
        def load(train: bool) -> tuple[np.ndarray, np.ndarray]:
            if hang and not train:
                time.sleep(3600)  # killed with the training split written, the test split not
            return cifar_split(train)

        folder = write_cifar10_parquet(spec["root"], load)
        return {"folder": folder, "rows": {split: len(read_split(folder, split)["label"]) for split in CIFAR_ROWS}}
    if dataset == "mnist":  # each split counted by Ray Data, as the lessons read it
        folder = write_mnist_parquet(spec["data_dir"], spec["root"])
        return {"folder": folder, "rows": {split: ray.data.read_parquet(storage.join(folder, split)).count()
                                           for split in ("train", "test")}}
    folder = synthetic_folder(spec["root"], spec["size_gb"])
    ids = ray.data.read_parquet(folder).select_columns(["id"]).to_pandas()["id"]
    return {"folder": folder, "rows": {"rows": len(ids), "distinct": ids.nunique()}}


# --- The race ------------------------------------------------------------------------------------------------------

def _start(spec: dict, logs: Path) -> subprocess.Popen:
    """A preparer process running `spec`, its output in files under `logs` (a pipe could fill and block it)."""
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{spec['dataset']}-{time.monotonic_ns()}"
    with (logs / f"{name}.out").open("w") as out, (logs / f"{name}.err").open("w") as err:
        process = subprocess.Popen([sys.executable, "-m", "tests.preparers", json.dumps(spec)],
                                   cwd=REPO_ROOT, stdout=out, stderr=err)
    process.logs = logs / name
    return process


def _result(process: subprocess.Popen, timeout_s: float = 240.0) -> dict:
    """What a preparer printed last, once it exited with 0 (else its error output)."""
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    out = process.logs.with_suffix(".out").read_text()
    assert returncode == 0, f"a preparer failed ({returncode}):\n{process.logs.with_suffix('.err').read_text()[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _listing(folder: str) -> list[tuple[str, int, object]]:
    """Every file under `folder`: path, bytes, modification time."""
    return [(entry.path, entry.size, entry.mtime) for entry in storage.list_dir(folder, recursive=True)
            if entry.type == pafs.FileType.File]


def _kill_while_writing(process: subprocess.Popen, root: str, data_suffix: str) -> tuple[str, list]:
    """SIGKILL `process` once its copy under `root` holds a data file; its leftover copy, and that copy's files once
    they stopped changing (a Ray driver's tasks go on for a moment after it died)."""
    def writing() -> str | None:
        if process.poll() is not None:
            raise AssertionError(f"the preparer to kill exited first:\n{process.logs.with_suffix('.err').read_text()}")
        return next((copy for copy in storage.incomplete_copies(root)
                     if any(path.endswith(data_suffix) for path, _, _ in _listing(copy))), None)

    leftover = wait_until(writing, 120, 0.01, "the first preparer's first data file")
    process.kill()
    process.wait()
    listings = [_listing(leftover)]
    while len(listings) < 3 or listings[-1] != listings[-3]:  # the same for 1 s
        time.sleep(0.5)
        listings.append(_listing(leftover))
        assert len(listings) < 60, "the killed preparer's copy is still changing after 30 s"
    assert storage.read_marker(leftover) is None, "killed too late: the copy was complete"
    return leftover, listings[-1]


def killed_then_concurrent(spec: dict, root: str, logs: Path, data_suffix: str, expected_rows: dict) -> list[str]:
    """A preparer killed half-way, then CONCURRENT preparers released together: each succeeds and reads every row of
    a complete copy under `root`, and the leftover is ignored and untouched. Returns the folders they read."""
    go = logs / "barrier" / "go"
    go.parent.mkdir(parents=True)
    doomed = _start({**spec, "hang": True}, logs)
    others = [_start({**spec, "go": str(go)}, logs) for _ in range(CONCURRENT)]  # they start Ray meanwhile
    try:
        leftover, files = _kill_while_writing(doomed, root, data_suffix)
        wait_until(lambda: len(list(go.parent.glob("ready-*"))) == CONCURRENT, 120, 0.02, "every preparer ready")
        go.touch()
        results = [_result(process) for process in others]
    finally:
        for process in (doomed, *others):
            if process.poll() is None:
                process.kill()
                process.wait()
    complete = storage.complete_copies(root)
    for result in results:
        assert result["rows"] == expected_rows, result
        assert result["folder"] in complete and result["folder"] != leftover
    assert len(complete) >= 2, "the preparers did not race: no two of them wrote"
    assert storage.incomplete_copies(root) == [leftover] and leftover < complete[0], "it started first"
    assert _listing(leftover) == files, "the killed preparer's copy was changed"
    return [result["folder"] for result in results]



if __name__ == "__main__":  # one preparer: its spec as JSON; prints what it read, as JSON
    print(json.dumps(_prepare(json.loads(sys.argv[1]))))

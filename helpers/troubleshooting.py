"""Measurements lesson 06's troubleshooting labs use: a rank's stack, a data iterator's own clock, memory limits and use."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

from helpers.data_stats import ITERATOR_LINES as ITERATOR_LINES  # lesson 06 (and its tests) import them from here
from helpers.data_stats import iterator_times as iterator_times
from helpers.rounds import ranges_verdict
from helpers.system import wait_until

# --- Lab A: the stack of each rank ---------------------------------------------------------------------------

def worker_stack(pid: int) -> str:
    """The Python stack of every thread of process `pid`, as `py-spy dump` prints it (py-spy ships with ray[default]).

    It is what the dashboard's *Stack Trace* button and `ray stack` run on the worker's node. Ray's own threads
    show up too; `training_thread` picks the one that runs your loop.
    """
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"py-spy could not read process {pid}: {done.stderr.strip() or done.stdout.strip()}")
    return _ANSI_CODES.sub("", done.stdout)  # py-spy colours its output under CLICOLOR_FORCE, which Jupyter sets


#: Terminal colour codes, e.g. "\x1b[32m".
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")


def training_thread(stack: str) -> list[str]:
    """The frames of the thread that runs the training function in a `worker_stack`, innermost first; [] if none.

    Ray Train runs your loop in a thread named "TrainingThread(...)" inside each `RayTrainWorker`; once the loop has
    returned, that thread is gone.
    """
    blocks = re.split(r"^(?=Thread \d+)", stack, flags=re.M)
    for block in blocks:
        if block.startswith("Thread") and "TrainingThread(" in block.splitlines()[0]:
            return [line.strip() for line in block.splitlines()[1:] if line.strip()]
    return []


def native_stack(dump: str, until: str) -> list[str]:
    """The training thread of a `py-spy dump --native` (`dump`, colour codes and all), innermost frame first, up to
    the frame of the function `until` (your loop): its Python frames, and torch's and the collective library's C++
    frames (`c10d::`, `gloo::`, NCCL) with their argument and template lists cut off. The C library's, pybind11's and
    torch's dispatcher frames between them are left out, as are repeats of one function."""
    frames = training_thread(_ANSI_CODES.sub("", dump))
    if not frames:
        raise RuntimeError(f"no training thread in this dump: did py-spy read a RayTrainWorker whose loop still runs?\n"
                           f"{dump[-2000:]}")
    kept: list[str] = []
    for frame in frames:
        name, _, where = frame.rpartition(" (")
        if ".py:" not in where:  # a native frame, "name (library.so)"
            name = re.split(r"[(<]", name.replace("(anonymous namespace)::", ""), maxsplit=1)[0]
            if not name.startswith(("c10d::", "gloo::")) and "nccl" not in name.lower():
                continue
        entry = f"{name} ({where}"
        if not kept or kept[-1] != entry:
            kept.append(entry)
        if name == until:
            break
    return kept


def run_workers(run_name: str) -> list[dict]:
    """The workers of the latest attempt of the Train run `run_name`, by rank, from the dashboard's Train API.

    Each has `world_rank`, `pid`, `node_id` and `actor_id`. Needs `RAY_TRAIN_ENABLE_STATE_TRACKING=1` (section 02).
    """
    from helpers.session import dashboard_get

    status, body = dashboard_get("/api/train/v2/runs/v1")
    runs = [run for run in (body or {}).get("train_runs", []) if run["name"] == run_name] if status == 200 else []
    if not runs or not runs[-1]["attempts"]:
        return []
    return sorted(runs[-1]["attempts"][-1]["workers"], key=lambda worker: worker["world_rank"])


def wait_until_in(run_name: str, rank: int, function: str, timeout_s: float = 300) -> list[dict]:
    """Wait until rank `rank` of the Train run `run_name` runs `function` (a frame of its training thread's stack).

    Returns the run's workers by rank, as `run_workers` does. Raises TimeoutError after `timeout_s`, and RuntimeError
    at once if the rank's process ends first (the run finished or failed before reaching `function`).
    """
    def reached() -> list[dict] | None:
        workers = run_workers(run_name)
        if len(workers) <= rank:
            return None
        pid = workers[rank]["pid"]
        try:
            frames = training_thread(worker_stack(pid))
        except RuntimeError:
            if not Path(f"/proc/{pid}").exists():
                raise RuntimeError(f"rank {rank} of {run_name} ended before it reached {function}()") from None
            return None  # py-spy could not read it this time: try again
        return workers if any(frame.startswith(f"{function} (") for frame in frames) else None

    try:
        return wait_until(reached, timeout_s, 1, what=f"rank {rank} of {run_name} reaching {function}()")
    except TimeoutError:
        raise TimeoutError(f"rank {rank} of {run_name} did not reach {function}() in {timeout_s:.0f} s; is "
                           "RAY_TRAIN_ENABLE_STATE_TRACKING=1 set (run_workers needs it)?") from None


# --- Lab E: memory ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def memory_limit(megabytes: int) -> Iterator[None]:
    """Inside the block, this process may take at most `megabytes` MB more memory; past that, allocations fail.

    Stands for a GPU (or a container) with that much memory free: the allocation that fails raises a RuntimeError
    that says so ("can't allocate memory", "Cannot allocate memory"), as "CUDA out of memory" does on a GPU. Linux
    only: it lowers the soft RLIMIT_AS of the process to its current address space plus `megabytes`, and restores it
    on exit. It also turns oneDNN off inside the block: oneDNN's kernels report a failed allocation of their own
    buffers as "could not execute a primitive", which does not say what ran out.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    onednn = torch.backends.mkldnn.enabled
    resource.setrlimit(resource.RLIMIT_AS, (_status_bytes("VmSize") + megabytes * 2**20, hard))
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # torch types it as its descriptor
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = onednn
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def process_memory_mb() -> float:
    """This process's resident memory (RSS) in MB, after handing freed memory back to the system.

    `gc.collect()` and glibc's `malloc_trim(0)` first, so that memory freed earlier does not hide what is kept now.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_bytes("VmRSS") / 1e6


def _status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmSize, VmRSS, ...), in bytes."""
    if not Path("/proc/self/status").exists():
        raise RuntimeError("Lab E's memory measurements read /proc, which only Linux has: run it on Linux, "
                           "in WSL or in a Linux container")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# --- Lab C: one change at a time -------------------------------------------------------------------------------

def compare_rounds(rounds: pd.DataFrame, baseline: str, value: str = "waiting share") -> pd.DataFrame:
    """Per condition: the median of `value` over rounds, its range, and the change from `baseline`, with a verdict.

    `rounds` has one row per condition and round. A change counts as measured only when the ranges of the two
    conditions do not overlap; otherwise it is "no measurable difference".
    """
    stats = rounds.groupby("condition", sort=False)[value].agg(["median", "min", "max"])
    low, high = stats.loc[baseline, "min"], stats.loc[baseline, "max"]
    stats["change vs " + baseline] = stats["median"] - stats.loc[baseline, "median"]
    stats["verdict"] = ["baseline" if name == baseline else ranges_verdict(row["min"], row["max"], low, high)
                        for name, row in stats.iterrows()]
    return stats

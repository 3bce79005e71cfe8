"""Measurements lesson 06 uses: a run's start-up phases, a rank's stack, an iterator's clock, memory limits and use."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import torch

from helpers.data_stats import ITERATOR_LINES as ITERATOR_LINES  # lesson 06 (and its tests) import them from here
from helpers.data_stats import iterator_times as iterator_times
from helpers.rounds import ranges_verdict
from helpers.system import wait_until
from helpers.tooling import ray_internals

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


# --- Section 02: the numbers behind Ray's Train dashboard in Grafana -------------------------------------------

#: Ray Train's metrics that the *Train Metrics* row of Ray's Grafana dashboard plots (Ray 2.60,
#: ray/train/v2/_internal/metrics/), by what each adds up: seconds, per run (and per rank for a worker's), set back
#: to 0 when the run's controller or worker shuts down. The time in report() includes the sync and the transfer.
TRAIN_METRICS = {
    "ray_train_worker_group_start_total_time_s": "starting the worker group",
    "ray_train_worker_group_shutdown_total_time_s": "shutting the worker group down",
    "ray_train_report_total_blocked_time_s": "inside ray.train.report()",
    "ray_train_checkpoint_sync_total_time_s": "  of which agreeing on the checkpoint's folder",
    "ray_train_checkpoint_transfer_total_time_s": "  of which copying the checkpoint to storage",
}
#: Each Ray process sends the metric values it set to its node's metrics agent every 10 s (Ray 2.60's
#: metrics_report_interval_ms), and the agent serves a value it was sent for 2 intervals more.
METRICS_EXPORT_INTERVAL_S = 10


def metrics_endpoints() -> list[str]:
    """The Prometheus endpoint of every alive node of the Ray this process joined, what Prometheus scrapes for
    Grafana: each node's metrics agent serves it on the node's address and `MetricsExportPort`, without a token."""
    import ray

    from helpers.tooling.ray_internals import host_port_address

    return [f"http://{host_port_address(node['NodeManagerAddress'], node['MetricsExportPort'])}/metrics"
            for node in ray.nodes() if node["Alive"] and (node.get("MetricsExportPort") or 0) > 0]  # -1: no metrics


#: A sample line of Prometheus' text format, `name{label="value",...} value [timestamp]`, and one of its labels.
PROMETHEUS_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
PROMETHEUS_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def train_metric_samples(run_name: str, text: str) -> dict[tuple[str, str], float]:
    """The samples of TRAIN_METRICS for the run `run_name` in `text`, a Prometheus endpoint's page, by (metric,
    rank): the rank a worker's metric is tagged with, "controller" for the controller's."""
    samples = {}
    for line in text.splitlines():
        sample = PROMETHEUS_SAMPLE.match(line)
        if sample and sample["name"] in TRAIN_METRICS:
            labels = {key: value for key, value in PROMETHEUS_LABEL.findall(sample["labels"] or "")}
            if labels.get("ray_train_run_name") == run_name:
                samples[(sample["name"], labels.get("ray_train_worker_world_rank", "controller"))] = float(sample["value"])
    return samples


def train_metrics_table(seen: dict[tuple[str, str], float]) -> pd.DataFrame:
    """TRAIN_METRICS' values by (metric, rank) as a table: a row per metric, in TRAIN_METRICS' order, a column for
    the controller and one per rank, in rank order; "" where a metric has no value for that column."""
    ranks = sorted({rank for _, rank in seen if rank != "controller"}, key=int)
    columns = (["controller"] if any(rank == "controller" for _, rank in seen) else []) + ranks
    rows = {what: [seen.get((name, column)) for column in columns]
            for name, what in TRAIN_METRICS.items() if any(metric == name for metric, _ in seen)}
    table = pd.DataFrame.from_dict(rows, orient="index",
                                   columns=[column if column == "controller" else f"rank {column}" for column in columns])
    table.index.name = "seconds"
    return table.map(lambda value: "" if value is None or pd.isna(value) else f"{value:.2f} s")


def watch_train_metrics(run_name: str, until: Callable[[], bool], interval_s: float = 1.0,
                        timeout_s: float = 600) -> pd.DataFrame:
    """Read every node's Prometheus endpoint every `interval_s` seconds until `until()` is true (the run ended),
    and keep the highest value of each of the run's TRAIN_METRICS: see train_metrics_table.

    A value shows on an endpoint from the next export of the process that set it (METRICS_EXPORT_INTERVAL_S) for
    about two intervals: what a run set in its last seconds (its last report, its shutdown) may never show, and a
    run shorter than one interval may show nothing. Values of 0, sent before a first record or after the reset at
    the end, are left out. Raises TimeoutError after `timeout_s` (a run that hangs).
    """
    import urllib.request

    seen: dict[tuple[str, str], float] = {}
    unreachable: set[str] = set()

    def read_until_ended() -> bool:
        ended = until()  # read once more after the run ended: values it sent last are served a while longer
        for url in metrics_endpoints():
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    text = response.read().decode()
            except OSError as error:
                if url not in unreachable:
                    print(f"warning: cannot read {url} ({error}); its node's values are left out")
                    unreachable.add(url)
                continue
            for key, value in train_metric_samples(run_name, text).items():
                if value > 0:
                    seen[key] = max(value, seen.get(key, 0.0))
        return ended

    try:
        wait_until(read_until_ended, timeout_s, interval_s, what=f"the end of {run_name}")
    except TimeoutError as error:
        raise TimeoutError(f"{error}; its metrics so far: {seen}") from None
    if not seen:
        print(f"no metric of {run_name} was on the endpoints while it ran: it ended within "
              f"{METRICS_EXPORT_INTERVAL_S} s of the values it set")
    return train_metrics_table(seen)


# --- Section 02: where a fit()'s start-up went, from Ray Train's controller log ------------------------------------

def controller_records(run_name: str, log_dir: str | None = None) -> list[dict]:
    """Ray Train's controller log records (JSON lines, DEBUG included) of the run `run_name`, in order.

    The controller writes them on its node, under the session's `logs/train/` (`ray-train-sys-controller-*.log`, every
    level): run this on that node, the driver's, where Ray Train always places the controller.
    """
    if log_dir is None:
        log_dir = ray_internals.train_log_dir()
    records = []
    for path in glob.glob(os.path.join(log_dir, ray_internals.TRAIN_CONTROLLER_LOGS)):
        with open(path) as lines:
            records += [record for record in map(json.loads, lines) if record.get("run_name") == run_name]
    return sorted(records, key=lambda record: record["timestamp_ns"])


def startup_phases(records: list[dict]) -> dict[str, float]:
    """Seconds of each phase of the first worker group's start-up, as the controller measured them.

    `controller_setup` is the controller's own time from its first record to asking for the worker group; every
    figure comes from one process' clock, so none mixes the clocks of two hosts.
    """
    phases = {}
    for record in records:
        message = record["message"]
        if "controller_setup" not in phases and message.startswith(ray_internals.TRAIN_WORKER_GROUP_REQUESTED):
            phases["controller_setup"] = (record["timestamp_ns"] - records[0]["timestamp_ns"]) / 1e9
        for phase, pattern in ray_internals.TRAIN_STARTUP_PHASES.items():
            if phase not in phases and (match := re.search(pattern, message)):
                phases[phase] = float(match.group(1))
    missing = {"controller_setup", *ray_internals.TRAIN_STARTUP_PHASES} - set(phases)
    if missing:
        raise RuntimeError(f"Ray Train's controller log has no record of {sorted(missing)}: is this Ray 2.60, with "
                           "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING unset or 1?")
    return phases


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

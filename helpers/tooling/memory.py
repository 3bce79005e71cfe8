"""Peak memory by kind of process (Ray Train workers, Ray Data's tasks and actors, the rest of Ray, the driver) on
every node of the Ray cluster this process joined, and what its object stores held and spilled.

`MemoryPeaks` starts one sampler per node while a run goes; `notebooks/train_streaming.py` reports what they saw,
to show whether memory stays flat as the streamed data grows, and that nothing went to disk. Sizes are in MiB.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray

from helpers.tooling import ray_internals

#: Bytes in a MiB (the unit of every size reported here).
MIB = 2**20

#: Kinds of process the samplers tell apart, by process title (Ray sets each worker's title to what it runs).
DRIVER, TRAIN_WORKER, DATA, OTHER = "driver", "train_worker", "data", "other"
#: A Ray Train worker: "ray::RayTrainWorker.run_train_fn" (ray::<actor class>.<method>, or just the class when idle).
_TRAIN_TITLE = re.compile(r"^ray::RayTrainWorker\b")
#: Ray Data's tasks and actors: fused operators ("ray::ReadParquet->MapBatches(normalize_images)"), single ones
#: ("ray::MapBatches(make_images)", "ray::Write"), the actor that splits a dataset between Ray Train's workers
#: ("ray::SplitCoordinator"), the tasks that cut a block in two to give each worker as many rows
#: ("ray::_split_single_block"), its statistics actor ("ray::_StatsActor") and the actors that read Parquet footers
#: while Ray Data lists the files ("ray::FooterReader").
_DATA_TITLE = re.compile(
    r"^ray::(SplitCoordinator|_split_single_block|_StatsActor|FooterReader|MapWorker|Read\w*|Write\w*|ListFiles\w*|"
    r"(MapBatches|MapRows|Map|FlatMap|Filter|Project|Limit|Repartition|Split\w*)\b)|^ray::\w+(\(.*\))?->")
#: The samplers' own title: they are not part of the run they measure.
_SAMPLER_TITLE = re.compile(r"^ray::MemorySampler\b")
#: The kinds of `MemoryPeaks.mib`, in the order the report and the figure list them.
PEAK_KINDS = ("driver", "train_worker_max", "data_max", "data_sum", "other_sum", "object_store")


def process_kind(title: str) -> str | None:
    """TRAIN_WORKER, DATA or OTHER for a Ray worker's process title (its command line); None for a sampler."""
    if _TRAIN_TITLE.match(title):
        return TRAIN_WORKER
    if _DATA_TITLE.match(title):
        return DATA
    return None if _SAMPLER_TITLE.match(title) else OTHER


def own_bytes(pid: int) -> int:
    """The memory a process holds for itself: its resident anonymous pages (heap, stacks, Arrow's and numpy's buffers).

    Not RSS, and not USS either: both count the object store's shared-memory pages the process has touched. A Ray
    Data task that writes a block into the object store maps its pages, and until another process reads the block
    they are in the writer's USS: measured here, a normalising task's USS was 592 MiB, of which 359 MiB were pages of
    the object store. The object store is measured on its own (`object_store`).
    On Linux this is RssAnon (/proc/<pid>/status); macOS has no /proc, and there it is USS, with those pages.
    """
    if not Path("/proc").is_dir():
        return psutil.Process(pid).memory_full_info().uss
    try:
        found = re.search(r"^RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    except (FileNotFoundError, ProcessLookupError) as error:
        raise psutil.NoSuchProcess(pid) from error
    if found is None:  # a process that has exited and not yet been reaped (a zombie) has no memory left
        raise psutil.NoSuchProcess(pid)
    return int(found.group(1)) * 1024


def _own_raylet() -> psutil.Process:
    """The raylet of the node this Ray worker runs on: its parent (a raylet starts every worker process of its node)."""
    raylet = psutil.Process(os.getppid())
    if raylet.name() != "raylet":
        raise RuntimeError(f"Expected to run in a Ray worker started by a raylet, but the parent is {raylet.name()!r}.")
    return raylet


class MemorySampler:
    """Samples one node's Ray worker processes every `interval_s` in a thread, and keeps each kind's peak (bytes).

    Runs as a Ray actor pinned to its node (`MemoryPeaks` starts one per alive node). It looks only at the worker
    processes of its own raylet: another Ray on the same machine (another user's, another notebook's) is not counted.
    """

    def __init__(self, raylet_address: str, raylet_port: int, interval_s: float = 0.25):
        self._raylet_process = _own_raylet()
        self._raylet = (raylet_address, raylet_port)
        self._interval_s = interval_s
        self._peaks = {f"{TRAIN_WORKER}_max": 0, f"{DATA}_max": 0, f"{DATA}_sum": 0, f"{OTHER}_sum": 0,
                       "object_store": 0, "object_store_fallback": 0}
        self._processes: dict[int, dict[str, Any]] = {}  # pid -> its peak (bytes), kind and titles
        self._store_at_start = ray_internals.object_store_stats(*self._raylet)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Read every worker process of this node once, and raise the peaks they pass."""
        sums = {TRAIN_WORKER: 0, DATA: 0, OTHER: 0}
        largest = {TRAIN_WORKER: 0, DATA: 0, OTHER: 0}
        for process in self._raylet_process.children():
            try:
                title = " ".join(process.cmdline()).strip()  # Ray pads titles with spaces
                held = own_bytes(process.pid)
            except psutil.Error:  # gone meanwhile, e.g. a task's worker that just exited
                continue
            if (kind := process_kind(title)) is None:
                continue
            seen = self._processes.setdefault(process.pid, {"peak": 0, "kind": kind, "titles": []})
            if kind == OTHER:  # idle between two tasks ("ray::IDLE"): it still holds what it ran
                kind = seen["kind"]
            seen["kind"] = kind  # a worker Ray started idle belongs to the first task it runs
            seen["peak"] = max(seen["peak"], held)
            if title[:80] not in seen["titles"]:  # one process runs many tasks: Ray Data reuses its workers
                seen["titles"].append(title[:80])
            sums[kind] += held
            largest[kind] = max(largest[kind], held)
        store = ray_internals.object_store_stats(*self._raylet)
        for key, value in ((f"{TRAIN_WORKER}_max", largest[TRAIN_WORKER]), (f"{DATA}_max", largest[DATA]),
                           (f"{DATA}_sum", sums[DATA]), (f"{OTHER}_sum", sums[OTHER]),
                           ("object_store", store["used"]), ("object_store_fallback", store["fallback"])):
            self._peaks[key] = max(self._peaks[key], value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample must not end the sampling
                pass

    def started(self) -> bool:
        """True once sampling runs (an actor's methods run after its __init__, which reads the store's start)."""
        return True

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the peaks (bytes), each process seen, and what the object store spilled meanwhile."""
        self._stop.set()
        self._thread.join()
        self.sample()
        store = ray_internals.object_store_stats(*self._raylet)
        moved = {key: store[key] - self._store_at_start[key] for key in ("spilled", "restored", "created")}
        return {**self._peaks, "object_store_capacity": store["capacity"], **moved,
                "processes": [{"pid": pid, **seen} for pid, seen in self._processes.items()]}


class _DriverSampler(threading.Thread):
    """The driver's own peak memory (`own_bytes`), sampled in a thread of the driver (it may run on no node of the cluster)."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s, self.peak, self.stopped = interval_s, 0, threading.Event()
        self.pid = os.getpid()

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, own_bytes(self.pid))
            if self.stopped.wait(self.interval_s):
                return


@dataclass
class MemoryPeaks:
    """Peak memory by kind of process while a run goes, on every node: `with MemoryPeaks() as peaks: ...`.

    Afterwards, `peaks.mib` holds, in MiB: `driver` (this process), `train_worker_max` (the largest Ray Train
    worker), `data_max` (the largest Ray Data process), `data_sum` (Ray Data's processes together), `other_sum`
    (every other Ray worker process of the cluster: Ray Train's controller, Ray's own actors, idle workers) and
    `object_store` (bytes in the object stores). Each node reports its own peaks; across nodes the maxima are
    maxima and the sums add up each node's peak (the nodes peak at different moments: an upper bound).
    `peaks.store` has the object stores' capacity and what went to disk during the run (`spilled_bytes`,
    `restored_bytes`, and `fallback_mib`, the peak of objects Ray wrote to disk-backed files when the store was
    full); `peaks.processes` each process seen, largest first.
    """

    interval_s: float = 0.25

    def __enter__(self) -> MemoryPeaks:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(num_cpus=0)(MemorySampler)  # no CPU: it must not take one from training or Ray Data
        nodes = [node for node in ray.nodes() if node["Alive"]]
        self._samplers: list[Any] = [  # actor handles (Ray types `ray.remote(...)(cls)` as the class)
            actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            .remote(node["NodeManagerAddress"], node["NodeManagerPort"], self.interval_s)
            for node in nodes
        ]
        # Wait until every sampler samples: a run started before would go partly unseen (its first tasks' peaks, the
        # objects they created before the sampler read the store's start).
        ray.get([sampler.started.remote() for sampler in self._samplers], timeout=120)
        self._node_names = [node["NodeName"] for node in nodes]
        self._driver = _DriverSampler(self.interval_s)
        self._driver.start()
        self.mib: dict[str, float] = {}
        self.store: dict[str, float] = {}
        self.processes: list[dict[str, Any]] = []
        return self

    def __exit__(self, *exc_info) -> None:
        self._driver.stopped.set()
        self._driver.join()
        per_node = ray.get([sampler.stop.remote() for sampler in self._samplers], timeout=60)
        for sampler in self._samplers:
            ray.kill(sampler)
        for node_name, node in zip(self._node_names, per_node, strict=True):
            self.processes += [{"node": node_name, "pid": seen["pid"], "kind": seen["kind"],
                                "peak_mib": round(seen["peak"] / MIB, 1), "titles": seen["titles"]}
                               for seen in node.pop("processes")]
        self.processes.sort(key=lambda seen: -seen["peak_mib"])
        self.mib = merge_peaks(self._driver.peak, per_node)
        self.store = merge_store(per_node)


def merge_peaks(driver_bytes: int, per_node: list[dict[str, int]]) -> dict[str, float]:
    """The peaks of all nodes together, in MiB (keys in PEAK_KINDS' order): maxima of the `_max` keys, sums of the rest."""
    merged = {"driver": driver_bytes}
    for key in PEAK_KINDS[1:]:
        values = [node[key] for node in per_node]
        merged[key] = max(values, default=0) if key.endswith("_max") else sum(values)
    return {key: round(value / MIB, 1) for key, value in merged.items()}


def merge_store(per_node: list[dict[str, int]]) -> dict[str, float]:
    """The object stores of all nodes together: capacity and fallback peak in MiB, bytes spilled, restored, created."""
    def total(key: str) -> int:
        return sum(node[key] for node in per_node)

    return {"capacity_mib": round(total("object_store_capacity") / MIB, 1),
            "fallback_mib": round(total("object_store_fallback") / MIB, 1),
            "spilled_bytes": total("spilled"), "restored_bytes": total("restored"), "created_bytes": total("created")}

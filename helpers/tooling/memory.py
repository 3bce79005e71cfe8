"""Peak memory by kind of process (Ray Train workers, Ray Data's tasks and actors, the driver) on every node.

`MemoryPeaks` starts one sampler per node while a run goes; `notebooks/train_streaming.py` reports what they saw,
to show that memory stays flat as the streamed data grows. Sizes are in MiB.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import psutil
import ray

from helpers.streaming import MIB
from helpers.tooling import ray_internals

#: Kinds of process the samplers tell apart, by process title (Ray sets each worker's title to what it runs).
DRIVER, TRAIN_WORKER, DATA = "driver", "train_worker", "data"
#: A Ray Train worker: "ray::RayTrainWorker.run_train_fn" (ray::<actor class>.<method>, or just the class when idle).
_TRAIN_TITLE = re.compile(r"^ray::RayTrainWorker\b")
#: Ray Data's tasks and actors: fused operators ("ray::ReadParquet->MapBatches(normalize_images)"), single ones
#: ("ray::MapBatches(make_images)", "ray::Write"), the actor that splits a dataset between Ray Train's workers
#: ("ray::SplitCoordinator") and its statistics actor ("ray::_StatsActor").
_DATA_TITLE = re.compile(
    r"^ray::(SplitCoordinator|_StatsActor|MapWorker|Read\w*|Write\w*|ListFiles\w*|"
    r"(MapBatches|MapRows|Map|FlatMap|Filter|Project|Limit|Repartition|Split\w*)\b)|^ray::\w+(\(.*\))?->")


def process_kind(title: str) -> str | None:
    """TRAIN_WORKER or DATA for a Ray process title (its command line), else None."""
    if _TRAIN_TITLE.match(title):
        return TRAIN_WORKER
    if _DATA_TITLE.match(title):
        return DATA
    return None


def _uss(process: psutil.Process) -> int:
    """Bytes only this process holds (its unique set size).

    Not RSS: RSS also counts the object store's shared-memory pages a process has mapped, so every process
    that reads a block would count that block again, and the sum over processes would count it many times.
    The object store is measured on its own.
    """
    return process.memory_full_info().uss


class MemorySampler:
    """Samples one node's processes every `interval_s` in a thread, and keeps each kind's peak (bytes).

    Runs as a Ray actor pinned to its node (`MemoryPeaks` starts one per alive node).
    """

    def __init__(self, raylet_address: str, raylet_port: int, interval_s: float = 0.25):
        self._raylet = (raylet_address, raylet_port)
        self._interval_s = interval_s
        self._peaks = {f"{TRAIN_WORKER}_max": 0, f"{DATA}_max": 0, f"{DATA}_sum": 0, "object_store": 0}
        self._titles: dict[str, int] = {}  # the largest USS seen under each title counted (bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Read every process of this node once, and raise the peaks they pass."""
        train_max = data_max = data_sum = 0
        for process in psutil.process_iter(["cmdline"]):
            kind = process_kind(" ".join(process.info["cmdline"] or []))
            if kind is None:
                continue
            try:
                uss = _uss(process)
            except psutil.Error:  # gone meanwhile, e.g. a task's worker that just exited
                continue
            title = " ".join(process.info["cmdline"]).strip()[:80]  # Ray pads titles with spaces
            self._titles[title] = max(self._titles.get(title, 0), uss)
            if kind == TRAIN_WORKER:
                train_max = max(train_max, uss)
            else:
                data_max, data_sum = max(data_max, uss), data_sum + uss
        for key, value in ((f"{TRAIN_WORKER}_max", train_max), (f"{DATA}_max", data_max), (f"{DATA}_sum", data_sum),
                           ("object_store", ray_internals.object_store_bytes_used(*self._raylet))):
            self._peaks[key] = max(self._peaks[key], value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample must not end the sampling
                pass

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the peaks (bytes), and the largest process under each title counted (bytes)."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return {**self._peaks, "titles": self._titles}


class _DriverSampler(threading.Thread):
    """The driver's own peak USS, sampled in a thread of the driver (it may run on no node of the cluster)."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s, self.peak, self.stopped = interval_s, 0, threading.Event()
        self.process = psutil.Process(os.getpid())

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, _uss(self.process))
            if self.stopped.wait(self.interval_s):
                return


@dataclass
class MemoryPeaks:
    """Peak memory by kind of process while a run goes, on every node: `with MemoryPeaks() as peaks: ...`.

    Afterwards, `peaks.mib` holds, in MiB: `driver` (this process), `train_worker_max` (the largest Ray Train
    worker), `data_max` (the largest Ray Data process) and `data_sum` (Ray Data's processes together), and
    `object_store` (bytes in the object stores). Each node reports its own peaks; across nodes the maxima are
    maxima and the sums add up each node's peak (the nodes peak at different moments: an upper bound).
    """

    interval_s: float = 0.25

    def __enter__(self) -> MemoryPeaks:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(num_cpus=0)(MemorySampler)  # no CPU: it must not take one from training or Ray Data
        self._samplers = [
            actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            .remote(node["NodeManagerAddress"], node["NodeManagerPort"], self.interval_s)
            for node in ray.nodes() if node["Alive"]
        ]
        self._driver = _DriverSampler(self.interval_s)
        self._driver.start()
        self.mib: dict[str, float] = {}
        self.titles: dict[str, float] = {}  # the largest process under each title counted, MiB
        return self

    def __exit__(self, *exc_info) -> None:
        self._driver.stopped.set()
        self._driver.join()
        per_node = ray.get([sampler.stop.remote() for sampler in self._samplers], timeout=60)
        for sampler in self._samplers:
            ray.kill(sampler)
        for node in per_node:
            for title, uss in node.pop("titles").items():
                self.titles[title] = max(self.titles.get(title, 0.0), round(uss / MIB, 1))
        self.mib = merge_peaks(self._driver.peak, per_node)


def merge_peaks(driver_bytes: int, per_node: list[dict[str, int]]) -> dict[str, float]:
    """The peaks of all nodes together, in MiB: maxima of the `_max` keys, sums of the others."""
    merged = {"driver": driver_bytes}
    for key in (f"{TRAIN_WORKER}_max", f"{DATA}_max", f"{DATA}_sum", "object_store"):
        values = [node[key] for node in per_node]
        merged[key] = max(values, default=0) if key.endswith("_max") else sum(values)
    return {key: round(value / MIB, 1) for key, value in merged.items()}

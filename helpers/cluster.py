"""Preflight checks: fail at once when a training run could never be scheduled or could not keep its results.

Ray keeps an unsatisfiable request pending (a node might join later), so `TorchTrainer.fit()`
asking for 64 workers on a 2-CPU laptop, or for a GPU on a CPU-only cluster, waits forever.
`check_resources` compares the request with the nodes that exist and says what to change;
`check_data_resources` does the same for Ray Data beside the workers, and `check_storage_path`
checks that the run's storage path is writable and shared by every node.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

import ray
from ray.data.dataset import Dataset, MaterializedDataset
from ray.train import ScalingConfig

from helpers.config import CourseConfig

#: Ray's prefix for accelerator-type resources, e.g. "accelerator_type:T4".
ACCELERATOR_PREFIX = "accelerator_type:"


class ResourceRequestError(RuntimeError):
    """The cluster can never satisfy what a ScalingConfig asks for."""


class StoragePathError(RuntimeError):
    """The storage path cannot hold a run's results: not writable here, or not shared by every node."""


def resources_per_worker(scaling_config: ScalingConfig) -> dict[str, float]:
    """What one Ray Train worker reserves, by the same rules as Ray Train itself.

    Default one CPU (one GPU and no CPU with `use_gpu=True`); `resources_per_worker`
    replaces the default; `accelerator_type` adds a tiny amount of that accelerator's resource.
    """
    if scaling_config.resources_per_worker is None:
        needs = {"GPU": 1.0} if scaling_config.use_gpu else {"CPU": 1.0}
    else:
        needs = {key: float(value) for key, value in scaling_config.resources_per_worker.items() if value}
    if scaling_config.use_gpu:
        needs.setdefault("GPU", 1.0)
    if scaling_config.accelerator_type:
        needs.setdefault(f"{ACCELERATOR_PREFIX}{scaling_config.accelerator_type}", 0.001)
    return needs


def _workers_that_fit(node: dict[str, float], needs: dict[str, float]) -> int:
    return min(math.floor(node.get(key, 0.0) / amount + 1e-9) for key, amount in needs.items())


def check_resources(scaling_config: ScalingConfig, nodes: list[dict[str, float]] | None = None) -> None:
    """Raise ResourceRequestError unless the cluster's nodes can host every requested worker.

    `nodes` are the total resources of each alive node (default: read from the running Ray).
    A worker must fit on one node; workers are packed onto nodes the way Ray can place them.
    """
    if nodes is None:
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    needs = resources_per_worker(scaling_config)
    num_workers = scaling_config.num_workers
    fits = sum(_workers_that_fit(node, needs) for node in nodes)
    if fits >= num_workers:
        return
    totals = {key: sum(node.get(key, 0.0) for node in nodes) for key in needs}
    have = ", ".join(f"{totals[key]:g} {key}" for key in needs)
    ask = ", ".join(f"{amount:g} {key}" for key, amount in needs.items())
    hints = []
    if fits:
        hints.append(f"use at most {fits} workers (COURSE_NUM_WORKERS={fits})")
    if "GPU" in needs and not totals["GPU"]:
        hints.append("train on CPU (COURSE_USE_GPU=auto or false), or connect to a cluster with GPUs (RAY_ADDRESS)")
    accelerators = [key for key in needs if key.startswith(ACCELERATOR_PREFIX)]
    if accelerators and not all(totals[key] for key in accelerators):
        hints.append("drop the accelerator type (unset COURSE_ACCELERATOR_TYPE) or pick one the cluster has")
    if not hints:
        hints.append("ask for fewer resources per worker, or add nodes to the cluster")
    raise ResourceRequestError(
        f"This run can never start: it asks for {num_workers} workers x ({ask}), "
        f"and the cluster's {len(nodes)} node(s) have {have} in all, room for {fits} such worker(s).\n"
        f"To fix it: {'; or '.join(hints)}."
    )


def cpus_per_worker(num_workers: int, total_cpus: float, reserve_for_data: float = 0.0) -> float:
    """Each CPU worker's share of the cluster's CPUs, after keeping `reserve_for_data` of them for Ray Data.

    Whole CPUs, at least one (Ray sets the worker's torch threads to that number); a fraction only when
    keeping CPUs for Ray Data leaves less than one each.
    """
    share = (total_cpus - reserve_for_data) / num_workers
    if share >= 1 or not reserve_for_data:
        return float(max(1, math.floor(share)))
    return round(max(share, 0.1), 2)


def scaling_config(cfg: CourseConfig, num_workers: int | None = None, use_gpu: bool | None = None,
                   reserve_for_data: float = 0.0) -> ScalingConfig:
    """Lesson 02's ScalingConfig, from the course configuration (the arguments override it).

    One GPU per worker, or the cluster's CPUs split between the workers after keeping `reserve_for_data`
    of them for Ray Data; the accelerator type from COURSE_ACCELERATOR_TYPE.
    """
    num_workers = cfg.num_workers if num_workers is None else num_workers
    use_gpu = cfg.use_gpu if use_gpu is None else use_gpu
    if use_gpu == "auto":
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    cpus = 1 if use_gpu else cpus_per_worker(num_workers, ray.cluster_resources()["CPU"], reserve_for_data)
    return ScalingConfig(
        num_workers=num_workers,
        use_gpu=use_gpu,
        resources_per_worker={"CPU": cpus, **({"GPU": 1} if use_gpu else {})},
        accelerator_type=cfg.accelerator_type,
    )


def check_data_resources(
    scaling_config: ScalingConfig, datasets: dict[str, Dataset], nodes: list[dict[str, float]] | None = None
) -> None:
    """Raise ResourceRequestError when the training workers leave Ray Data no CPU for the datasets' work.

    While training iterates a dataset, Ray Data runs its reads and maps as Ray tasks of 1 CPU each.
    If the workers reserve every CPU, those tasks never start and `fit()` waits forever (Ray Data only
    logs "The job may hang forever"). A materialized dataset has no work left, so it needs no CPU.
    """
    pending = sorted(name for name, dataset in datasets.items() if not isinstance(dataset, MaterializedDataset))
    if not pending:
        return
    if nodes is None:
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    total_cpus = sum(node.get("CPU", 0.0) for node in nodes)
    training_cpus = resources_per_worker(scaling_config).get("CPU", 0.0) * scaling_config.num_workers
    if total_cpus - training_cpus >= 1:
        return
    workers = scaling_config.num_workers
    hints = ["materialize() the datasets before fit() if they fit in memory (lesson 03 does)"]
    if total_cpus > 1:
        share = cpus_per_worker(workers, total_cpus, reserve_for_data=1)
        hints.append(f"give each worker less CPU, resources_per_worker={{'CPU': {share:g}}}, to keep 1 CPU for Ray Data")
    hints.append("or use fewer workers, or a bigger cluster")
    raise ResourceRequestError(
        f"Ray Data would never get a CPU: the {workers} training workers reserve {training_cpus:g} of the "
        f"cluster's {total_cpus:g} CPUs, and the datasets {pending} still have reads and maps to run "
        "(1 CPU per task) while training iterates them, so training would wait forever.\n"
        f"To fix it: {'; '.join(hints)}."
    )


def start_autoscaling_coordinator() -> None:
    """Start, without waiting, the actor Ray Train asks for resources on every `fit()`.

    Ray Train (2.60) sends its resource request to a detached `AutoscalingCoordinator` actor and
    waits 5 s for the answer. The first `fit()` in a Ray session also has to start that actor,
    which takes longer than 5 s on a small machine: the request times out, logs a warning with a
    traceback, and the run loses those seconds. Starting the actor ahead of time avoids both.
    """
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    get_or_create_autoscaling_coordinator()


#: Where to keep runs so every node of a cluster sees them (the README's advice).
SHARED_STORAGE_HINT = "shared storage every node mounts (NFS, /mnt/cluster_storage on Anyscale)"


@ray.remote(num_cpus=0)
def _sees(path: str) -> bool:
    return os.path.exists(path)


def _nodes_missing(probe: Path, timeout_s: float = 30.0) -> list[str]:
    """The alive nodes on which `probe` does not exist (a task pinned to each node looks)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_ids = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    checks = [_sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(str(probe))
              for node_id in node_ids]
    return [node_id for node_id, seen in zip(node_ids, ray.get(checks, timeout=timeout_s)) if not seen]


def check_storage_path(storage_path: str | Path) -> Path:
    """Raise StoragePathError unless runs can be written to `storage_path` and every node sees it; return it.

    Ray Train fails only after `fit()` has started its controller, with a pyarrow traceback, on a folder it
    cannot create; and on a multi-node cluster a folder local to one machine breaks checkpointing later.
    This writes a probe file (creating the folder) and has a task on every node look for it.
    """
    path = Path(storage_path)
    probe = path / f".course-storage-check-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("written by helpers.cluster.check_storage_path\n")
    except OSError as error:
        raise StoragePathError(
            f"Runs cannot be written to the storage path {path}: {error.strerror or error}.\n"
            f"To fix it: set COURSE_STORAGE_PATH (or a script's --storage-path) to a folder you can write to; "
            f"on a cluster, on {SHARED_STORAGE_HINT}."
        ) from None
    try:
        missing = _nodes_missing(probe)
    finally:
        probe.unlink(missing_ok=True)
    if missing:
        raise StoragePathError(
            f"The storage path {path} is local to this machine: {len(missing)} node(s) of the cluster do not see "
            f"it ({', '.join(node[:8] for node in missing)}), so their checkpoints would be lost or unreadable.\n"
            f"To fix it: set COURSE_STORAGE_PATH to {SHARED_STORAGE_HINT}."
        )
    return path

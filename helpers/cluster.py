"""Sizing a run for the cluster, and preflight checks that fail at once when it could never start.

`TorchTrainer.fit()` asking for 64 workers on a 2-CPU laptop, or for a GPU on a CPU-only cluster, never returns:
Ray Train (2.60) waits 60 s for the workers' resources (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), gives up with a
logged WorkerGroupStartupTimeoutError, and tries again, without limit (FailureConfig's controller_failure_limit
is -1), in case a node joins. It fails at once (InsufficientClusterResourcesError) only where Ray reports the
autoscaler's node limits. Here:

- `cluster_capacity` reads the nodes a run can use: the alive ones, and the node types an autoscaler can add;
- `plan_workers` sizes the workers from the nodes that will host them (never from cluster totals), leaving CPUs for
  Ray Data on every node when the run's datasets stream, and `course_scaling_config` turns that plan into lesson
  02's `ScalingConfig`;
- `check_resources` compares a request with the nodes and says what to change, or, on a cluster that can
  grow, what the run will wait for; `check_data_resources` does the same for Ray Data beside the workers;
- `check_storage_path` checks that the run's storage path is writable and reachable from every node.
"""

from __future__ import annotations

import math
import os
import re
import uuid
import warnings
from dataclasses import dataclass, field

import ray
from ray.data.dataset import Dataset, MaterializedDataset
from ray.train import ScalingConfig

from helpers import storage
from helpers.config import ConfigError, CourseConfig
from helpers.tooling import ray_internals

#: Ray's prefix for accelerator-type resources, e.g. "accelerator_type:T4".
ACCELERATOR_PREFIX = "accelerator_type:"
#: Workers on CPU when COURSE_NUM_WORKERS is unset (on GPUs: one per GPU).
DEFAULT_CPU_WORKERS = 2
#: CPUs a GPU worker reserves when its datasets stream: its training loop, and the thread in which Ray Data's iterator
#: prefetches. Ray Data's reads and maps are tasks of 1 CPU each that need CPUs no worker reserves, so the rest of its
#: node's CPUs stay for them. At most half of a worker's share of its node, so that every GPU node keeps some.
GPU_WORKER_CPUS_WHEN_STREAMING = 2.0
#: CPUs kept for Ray Data on CPU nodes when the datasets stream: at least one of its tasks runs at a time.
DATA_CPUS_WHEN_STREAMING = 1.0
#: How long Ray Train waits for its workers' resources before it asks again (Ray 2.60's default).
WORKER_GROUP_START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


class ResourceRequestError(RuntimeError):
    """The cluster can never satisfy what a ScalingConfig asks for."""


class ResourceWaitWarning(UserWarning):
    """The cluster cannot host the request now, but its autoscaler can add nodes: the run will wait for them."""


class StoragePathError(RuntimeError):
    """The storage path cannot hold a run's results: not writable, or not reachable from every node."""


@dataclass(frozen=True)
class NodeGroup:
    """A node type an autoscaler can add: one node's resources, and at most how many such nodes (-1: no limit)."""

    resources: dict[str, float]
    max_count: int


@dataclass(frozen=True)
class Capacity:
    """The nodes a run can use: the alive ones, and whether (and with what) an autoscaler can add more.

    `groups` lists the node types when Ray reports them (Anyscale does); a Ray autoscaler that does not
    report them still makes `can_grow` true, with `groups` empty. A run may use `largest()`: the alive nodes
    and the ones the autoscaler can still add.
    """

    nodes: list[dict[str, float]]
    groups: list[NodeGroup] = field(default_factory=list)
    can_grow: bool = False

    def largest(self, num_needed: int) -> list[dict[str, float]]:
        """The alive nodes plus, for each known node type, as many more as its limit allows (up to `num_needed`)."""
        nodes = list(self.nodes)
        for group in self.groups:
            existing = sum(1 for node in self.nodes if _same_shape(node, group.resources))
            limit = num_needed if group.max_count == -1 else group.max_count
            nodes += [dict(group.resources)] * max(0, limit - existing)
        return nodes

    def describe(self) -> str:
        """One line: the nodes, their CPUs and GPUs, and whether the cluster can grow."""
        cpus = sum(node.get("CPU", 0.0) for node in self.nodes)
        gpus = sum(node.get("GPU", 0.0) for node in self.nodes)
        line = f"{cpus:g} CPUs, {gpus:g} GPUs, {len(self.nodes)} node(s)"
        if len(self.nodes) > 1:  # smallest first: Ray lists nodes in no fixed order
            shapes = sorted((node.get("GPU", 0.0), node.get("CPU", 0.0), _shape(node)) for node in self.nodes)
            line += " with " + ", ".join(shape for _, _, shape in shapes)
        if self.groups and self.can_grow:
            line += "; its autoscaler can add " + ", ".join(
                f"{'any number' if group.max_count == -1 else f'up to {group.max_count}'} x {_shape(group.resources)}"
                for group in self.groups)
        elif self.can_grow:
            line += "; an autoscaler can add nodes"
        return line


def _same_shape(node: dict[str, float], resources: dict[str, float]) -> bool:
    return all(node.get(key, 0.0) == resources.get(key, 0.0) for key in ("CPU", "GPU"))


def _shape(resources: dict[str, float]) -> str:
    gpus = resources.get("GPU", 0.0)
    return f"({resources.get('CPU', 0.0):g} CPU{f', {gpus:g} GPU' if gpus else ''})"


def _node_groups_from_cluster_config() -> tuple[list[NodeGroup], bool]:
    """The node types Ray's cluster config lists (Anyscale's autoscaler reports them), and whether any can grow.

    A group grows when its `max_count` is above its `min_count`, or -1 (no limit): Ray Data's own rule
    (ray/data/_internal/cluster_autoscaler/util.py). No config reported: no groups.
    """
    groups = [group for group in ray_internals.reported_node_groups() if group["max_count"] != 0 and group["resources"]]
    can_grow = any(group["max_count"] == -1 or group["max_count"] > group["min_count"] for group in groups)
    return [NodeGroup(resources=group["resources"], max_count=group["max_count"]) for group in groups], can_grow


def _autoscaler_running() -> bool:
    """True when Ray's autoscaler runs with a real node provider (`ray up`, KubeRay), not in read-only mode.

    It writes its status to Ray's key-value store every few seconds; in read-only mode (a laptop, nodes
    started by hand with `ray start`) every node's type is named `node_<node id>`.
    """
    mapping = (ray_internals.autoscaler_report() or {}).get("node_type_mapping") or {}
    return any(node_type != f"node_{node_id}" for node_id, node_type in mapping.items())


def cluster_capacity() -> Capacity:
    """The running Ray cluster's capacity: its alive nodes, and what an autoscaler can add."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    groups, can_grow = _node_groups_from_cluster_config()
    if groups:
        return Capacity(nodes, groups, can_grow)
    # Anyscale scales its worker groups (from zero nodes); a Ray autoscaler can add nodes of its types.
    return Capacity(nodes, can_grow=bool(os.environ.get("ANYSCALE_CLUSTER_ID")) or _autoscaler_running())


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


@dataclass(frozen=True)
class WorkerPlan:
    """How many Ray Train workers, on what, and why."""

    num_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]
    why: str

    def describe(self) -> str:
        """'2 x (1 CPU): <why>'."""
        return f"{self.num_workers} x {_shape(self.resources_per_worker)}: {self.why}"


def _cpus_each(hosts: list[dict[str, float]], num_workers: int, one_gpu_each: bool, reserve_for_data: float) -> float:
    """The most CPUs each worker can have with all `num_workers` placed on `hosts` (with `one_gpu_each`, at most one
    per GPU of a node) and `reserve_for_data` CPUs kept for the input.

    Where the nodes allow it, every node that hosts a worker keeps the reserve, so the input's processes (a
    DataLoader's, or Ray Data's placed near the worker) find CPUs beside it: whole CPUs first, then a fraction. Nodes
    too small for that (say two 1-CPU nodes and a reserve of 1) keep it over the cluster instead, where Ray Data's
    tasks can run on any node. On several nodes this is a count, not a placement: Ray Train places the workers
    itself (PACK by default) and may put more of them on a node than the count assumes.
    """
    def placed(cpus: float, reserve: float) -> int:
        return sum(min(math.floor(node.get("GPU", 0.0)) if one_gpu_each else num_workers,
                       math.floor((node.get("CPU", 0.0) - reserve) / cpus + 1e-9)) for node in hosts
                   if node.get("CPU", 0.0) - reserve >= cpus)

    for cpus in range(math.floor(max(node.get("CPU", 0.0) for node in hosts)), 0, -1):
        if placed(cpus, reserve_for_data) >= num_workers:
            return float(cpus)
    if not reserve_for_data:
        return 1.0  # more workers than these nodes hold: check_resources says what to change
    # A fraction: a node's spare CPUs shared by k workers, the largest that still places them all.
    shares = [math.floor((node.get("CPU", 0.0) - reserve_for_data) / k * 100) / 100 for node in hosts
              for k in range(1, num_workers + 1)]
    fitting = [share for share in shares if share >= 0.1 and placed(share, reserve_for_data) >= num_workers]
    if fitting:
        return max(fitting)
    total = sum(node.get("CPU", 0.0) for node in hosts)  # no node can keep the reserve: keep it over the cluster
    if total > reserve_for_data:
        share = math.floor(max((total - reserve_for_data) / num_workers, 0.1) * 100) / 100
        if placed(share, 0.0) >= num_workers:
            return share
    return 1.0


def _streaming_cpus(hosts: list[dict[str, float]], num_workers: int, gpu: bool) -> float:
    """CPUs per worker that leave Ray Data its CPUs while datasets stream: on GPU nodes GPU_WORKER_CPUS_WHEN_STREAMING
    (at most half of a worker's share of its node), on CPU nodes the share after DATA_CPUS_WHEN_STREAMING."""
    if gpu:
        return min(GPU_WORKER_CPUS_WHEN_STREAMING, _cpus_each(hosts, num_workers, True, 0.0) / 2)
    return _cpus_each(hosts, num_workers, False, DATA_CPUS_WHEN_STREAMING)


def streaming(datasets: dict[str, Dataset] | None) -> list[str]:
    """The names of the datasets that still have reads or maps to run while training iterates them (not
    materialized, or with a lazy step after `materialize()`), sorted."""
    return sorted(name for name, dataset in (datasets or {}).items() if not isinstance(dataset, MaterializedDataset))


def plan_workers(cfg: CourseConfig, num_workers: int | None = None, use_gpu: bool | str | None = None,
                 reserve_for_data: float = 0.0, capacity: Capacity | None = None,
                 datasets: dict[str, Dataset] | None = None) -> WorkerPlan:
    """Size the Ray Train workers for the nodes that will host them (the arguments override the configuration).

    On GPUs: one worker per GPU, each with its node's CPUs per GPU, for its DataLoader's worker processes. On CPUs:
    COURSE_NUM_WORKERS (default 2), each with the most whole CPUs that still place every worker on the nodes with
    CPUs, after keeping `reserve_for_data` CPUs for the input (beside each worker where the nodes allow it, see
    `_cpus_each`). When `datasets` stream (see `streaming`), Ray Data's tasks need CPUs while training runs: a GPU
    worker then reserves GPU_WORKER_CPUS_WHEN_STREAMING and leaves the rest of its node to Ray Data; CPU workers
    leave at least DATA_CPUS_WHEN_STREAMING. Materialized datasets need no CPU, and none is kept.
    COURSE_CPUS_PER_WORKER fixes the CPUs instead. Nodes an autoscaler can add count when Ray reports their types.
    Raises ConfigError when GPUs are required and the cluster has none and cannot add any.
    """
    capacity = cluster_capacity() if capacity is None else capacity
    types_unknown = capacity.can_grow and not capacity.groups  # an autoscaler whose node types Ray does not report
    accelerator = f"{ACCELERATOR_PREFIX}{cfg.accelerator_type}" if cfg.accelerator_type else None
    usable = [node for node in capacity.largest(num_needed=64) if not accelerator or node.get(accelerator)]
    gpu_nodes = [node for node in usable if node.get("GPU", 0.0) >= 1]

    wanted = cfg.use_gpu if use_gpu is None else use_gpu
    if wanted == "auto":
        gpu = bool(gpu_nodes)
        has_gpus_now = any(node.get("GPU", 0.0) >= 1 for node in capacity.nodes)
        device_why = ("the cluster has GPUs" if has_gpus_now else "its autoscaler can add GPU nodes") if gpu \
            else "no GPU in the cluster"
    else:
        gpu = bool(wanted)
        device_why = f"COURSE_USE_GPU={'true' if gpu else 'false'}" if use_gpu is None else "as asked"
        if gpu and not gpu_nodes and not types_unknown:
            raise ConfigError(
                "GPUs were asked for (COURSE_USE_GPU=true, or a script's --use-gpu), but the Ray cluster has no GPU "
                "and no autoscaler can add one.\nTo fix it: train on CPU (COURSE_USE_GPU=auto or false, --no-use-gpu), "
                "or connect to a cluster with GPUs through RAY_ADDRESS.")
    cpu_only = [node for node in usable if node.get("CPU", 0.0) > 0 and not node.get("GPU")]
    # CPU workers stay off GPU nodes when there are others: an autoscaler would otherwise start GPU nodes for them.
    hosts = gpu_nodes if gpu else cpu_only or [node for node in usable if node.get("CPU", 0.0) > 0]

    workers = num_workers or cfg.num_workers
    if workers:
        count_why = "COURSE_NUM_WORKERS" if num_workers is None else "as asked"
    elif gpu:
        gpus_now = sum(math.floor(node.get("GPU", 0.0)) for node in capacity.nodes
                       if not accelerator or node.get(accelerator))
        workers = gpus_now or math.floor(min((node["GPU"] for node in gpu_nodes), default=1))
        count_why = "one per GPU" if gpus_now else "one per GPU of the first GPU node to join"
    else:
        workers, count_why = DEFAULT_CPU_WORKERS, "the default"

    streams = streaming(datasets)
    if streams and not gpu:
        reserve_for_data = max(reserve_for_data, DATA_CPUS_WHEN_STREAMING)
    if cfg.cpus_per_worker is not None:
        cpus, cpus_why = cfg.cpus_per_worker, "COURSE_CPUS_PER_WORKER CPUs"
    elif not hosts:
        cpus, cpus_why = 1.0, "1 CPU until a node joins (COURSE_CPUS_PER_WORKER sets it)"
    elif streams and gpu:
        cpus = _streaming_cpus(hosts, workers, gpu=True)
        cpus_why = (f"{cpus:g} of its {_cpus_each(hosts, workers, True, 0.0):g} CPUs per GPU; the rest of each GPU "
                    f"node's CPUs stay for Ray Data, since the datasets {streams} stream")
    else:
        cpus = _cpus_each(hosts, workers, gpu, reserve_for_data)
        cpus_why = "its share of a node's CPUs"
        if reserve_for_data:
            cpus_why += f" after {reserve_for_data:g} for Ray Data"
        if streams:
            cpus_why += f", since the datasets {streams} stream"
        elif datasets:
            cpus_why += " (the datasets are materialized: Ray Data needs no CPU while training runs)"
    return WorkerPlan(workers, gpu, {"CPU": cpus, **({"GPU": 1.0} if gpu else {})},
                      f"{count_why}{'' if 'per GPU' in count_why else ' on GPU' if gpu else ' on CPU'} ({device_why}), "
                      f"each with {cpus_why}")


def gpus_hold(cfg: CourseConfig, num_workers: int, capacity: Capacity | None = None) -> bool:
    """Whether `num_workers` Ray Train workers get a GPU each here: the course trains on GPUs (`plan_workers`, from
    COURSE_USE_GPU) and the alive nodes, with those an autoscaler can add, hold that many GPU workers at once.
    Raises ConfigError, as `plan_workers` does, where GPUs are required and the cluster has none and cannot add any."""
    capacity = cluster_capacity() if capacity is None else capacity
    plan = plan_workers(cfg, num_workers, capacity=capacity)
    if not plan.use_gpu:
        return False
    needs = resources_per_worker(ScalingConfig(num_workers=num_workers, use_gpu=True,
                                               resources_per_worker=plan.resources_per_worker,
                                               accelerator_type=cfg.accelerator_type))
    return sum(_workers_that_fit(node, needs) for node in capacity.largest(num_workers)) >= num_workers


def course_scaling_config(cfg: CourseConfig, num_workers: int | None = None, use_gpu: bool | None = None,
                          reserve_for_data: float = 0.0, datasets: dict[str, Dataset] | None = None) -> ScalingConfig:
    """The course's ScalingConfig: `plan_workers`' sizing for this cluster (the arguments override the configuration);
    pass the run's `datasets` to keep CPUs for Ray Data on every node when they stream."""
    plan = plan_workers(cfg, num_workers, use_gpu, reserve_for_data, datasets=datasets)
    return ScalingConfig(
        num_workers=plan.num_workers,  # [1] COURSE_NUM_WORKERS, or one worker per GPU
        use_gpu=plan.use_gpu,  # [2] one GPU each, and NCCL between them; gloo on CPU
        resources_per_worker=plan.resources_per_worker,  # [3] CPUs: its node's share, less Ray Data's if it streams
        accelerator_type=cfg.accelerator_type,  # [4] only on nodes of that GPU type (COURSE_ACCELERATOR_TYPE)
    )


def worker_slots(scaling_config: ScalingConfig, capacity: Capacity | None = None) -> int:
    """How many workers of `scaling_config`'s size the cluster's alive nodes hold at once, each on one node."""
    capacity = cluster_capacity() if capacity is None else capacity
    needs = resources_per_worker(scaling_config)
    return sum(_workers_that_fit(node, needs) for node in capacity.nodes)


def check_resources(scaling_config: ScalingConfig, capacity: Capacity | None = None) -> None:
    """Raise ResourceRequestError unless the cluster's nodes can host every requested worker.

    `capacity` defaults to the running Ray's. A worker must fit on one node; workers are packed onto nodes
    the way Ray can place them. On a cluster that can grow, a request that fits what the autoscaler can add
    (or whose node types Ray does not report) only warns (ResourceWaitWarning): the run waits for the nodes.
    """
    capacity = cluster_capacity() if capacity is None else capacity
    needs = resources_per_worker(scaling_config)
    num_workers = scaling_config.num_workers
    fits_now = sum(_workers_that_fit(node, needs) for node in capacity.nodes)
    if fits_now >= num_workers:
        return
    ask = ", ".join(f"{amount:g} {key}" for key, amount in needs.items())
    largest = capacity.largest(num_workers)
    fits = sum(_workers_that_fit(node, needs) for node in largest)
    if capacity.can_grow and (fits >= num_workers or not capacity.groups):
        timeout = os.environ.get(WORKER_GROUP_START_TIMEOUT_VAR, "60")
        warnings.warn(
            f"The cluster has room for {fits_now} of the {num_workers} workers x ({ask}) now. Its autoscaler can add "
            f"nodes, so fit() will wait for them: Ray Train asks again every {timeout} s "
            f"({WORKER_GROUP_START_TIMEOUT_VAR}) until the workers start.\n"
            "To stop waiting: interrupt it (Kernel > Interrupt in JupyterLab, Ctrl-C in a script), then ask for "
            "less (COURSE_NUM_WORKERS, COURSE_CPUS_PER_WORKER) or for other nodes.",
            ResourceWaitWarning, stacklevel=2)
        return
    nodes = largest if capacity.groups else capacity.nodes
    totals = {key: sum(node.get(key, 0.0) for node in nodes) for key in needs}
    have = ", ".join(f"{totals[key]:g} {key}" for key in needs)
    where = (f"the cluster's {len(nodes)} node(s) at most (its autoscaler's limits included)" if capacity.can_grow
             else f"the cluster's {len(nodes)} node(s)")
    cpu_bound = "CPU" in needs and sum(_workers_that_fit(node, {"CPU": needs["CPU"]}) for node in nodes) < num_workers
    hints = []
    if fits:
        hints.append(f"use at most {fits} workers (COURSE_NUM_WORKERS={fits})")
    if "GPU" in needs and not totals["GPU"]:
        hints.append("train on CPU (COURSE_USE_GPU=auto or false), or connect to a cluster with GPUs (RAY_ADDRESS)")
    accelerators = [key for key in needs if key.startswith(ACCELERATOR_PREFIX)]
    if accelerators and not all(totals[key] for key in accelerators):
        hints.append("drop the accelerator type (unset COURSE_ACCELERATOR_TYPE) or pick one the cluster has")
    if not hints or (cpu_bound and not fits):
        hints.append("ask for fewer CPUs per worker (COURSE_CPUS_PER_WORKER), or add nodes to the cluster")
    raise ResourceRequestError(
        f"This run can never start: it asks for {num_workers} workers x ({ask}), "
        f"and {where} have {have} in all, room for {fits} such worker(s).\n"
        f"To fix it: {'; or '.join(hints)}."
    )


def check_data_resources(
    scaling_config: ScalingConfig, datasets: dict[str, Dataset], capacity: Capacity | None = None
) -> None:
    """Raise ResourceRequestError when the training workers leave Ray Data no CPU for the datasets' work.

    While training iterates a dataset, Ray Data runs its reads and maps as Ray tasks of 1 CPU each.
    If the workers reserve every CPU, those tasks never start and `fit()` waits forever (Ray Data only
    logs "The job may hang forever"). A materialized dataset has no work left, so it needs no CPU.
    On a cluster that can grow, Ray Data asks the autoscaler for CPUs too: no error.
    """
    pending = streaming(datasets)
    if not pending:
        return
    capacity = cluster_capacity() if capacity is None else capacity
    total_cpus = sum(node.get("CPU", 0.0) for node in capacity.nodes)
    training_cpus = resources_per_worker(scaling_config).get("CPU", 0.0) * scaling_config.num_workers
    if total_cpus - training_cpus >= 1 or capacity.can_grow:
        return
    workers = scaling_config.num_workers
    hints = ["materialize() the datasets before fit() if they fit in memory (lesson 03 does)"]
    gpu = "GPU" in resources_per_worker(scaling_config)
    hosts = [node for node in capacity.nodes if node.get("CPU", 0.0) > 0 and (node.get("GPU", 0.0) >= 1 or not gpu)]
    if total_cpus > 1 and hosts:
        share = _streaming_cpus(hosts, workers, gpu)
        hints.append(f"size the workers with course_scaling_config(cfg, datasets=...), which keeps CPUs for Ray Data "
                     f"(the rest of each GPU node beyond 2 per worker, at least 1 over the CPU nodes): here "
                     f"resources_per_worker={{'CPU': {share:g}}}")
    hints.append("or use fewer workers, or a bigger cluster")
    raise ResourceRequestError(
        f"Ray Data would never get a CPU: the {workers} training workers reserve {training_cpus:g} of the "
        f"cluster's {total_cpus:g} CPUs, and the datasets {pending} still have reads and maps to run "
        "(1 CPU per task) while training iterates them, so training would wait forever.\n"
        f"To fix it: {'; '.join(hints)}."
    )


def start_autoscaling_coordinator() -> None:
    """Start, without waiting, the actor Ray Train asks for resources on every `fit()` (`setup()` and
    `helpers.session.start_ray` already do it: this is for code that starts Ray some other way).

    Ray Train (2.60) sends its resource request to a detached `AutoscalingCoordinator` actor and
    waits 5 s for the answer. The first `fit()` in a Ray session also has to start that actor,
    which takes longer than 5 s on a small machine: the request times out, logs a warning with a
    traceback, and the run loses those seconds. Starting the actor ahead of time avoids both.
    """
    ray_internals.autoscaling_coordinator()


#: Where to keep runs so every node of a cluster sees them (the README's advice).
SHARED_STORAGE_HINT = "storage every node reaches (an NFS mount, /mnt/cluster_storage on Anyscale, or s3://...)"


@ray.remote(num_cpus=0)
def _reaches(path: str) -> str | None:
    """None when this node sees the file `path`, else why not."""
    try:
        return None if storage.is_file(path) else "not there"
    except OSError as error:  # e.g. no credentials for the bucket on this node
        return str(error).splitlines()[0]


def _nodes_missing(probe: str, timeout_s: float = 60.0) -> dict[str, str]:
    """The alive nodes that do not see `probe`, and why (a task pinned to each node looks)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_ids = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    checks = [_reaches.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(probe)
              for node_id in node_ids]
    return {node_id: why for node_id, why in zip(node_ids, ray.get(checks, timeout=timeout_s)) if why}


def check_storage_path(storage_path: str) -> str:
    """Raise StoragePathError unless runs can be written to `storage_path` and every node reaches it; return it.

    Ray Train fails only after `fit()` has started its controller, with a pyarrow traceback, on a folder it
    cannot create; and on a multi-node cluster a folder local to one machine breaks checkpointing later.
    This writes a probe file (creating the folder, or the prefix of a URI) and has a task on every node look
    for it, through the same `pyarrow.fs` layer as Ray Train: a node without the bucket's credentials fails too.
    """
    storage_path = str(storage_path)
    probe = storage.join(storage_path, f".course-storage-check-{uuid.uuid4().hex[:8]}")
    try:
        storage.write_text(probe, "written by helpers.cluster.check_storage_path\n")
    except OSError as error:  # pyarrow's: "Cannot create directory '...'. Detail: [errno 20] Not a directory"
        found = re.search(r"\[errno \d+\] ([^\n]+)", str(error))
        reason = found.group(1) if found else str(error).splitlines()[0]
        raise StoragePathError(
            f"Runs cannot be written to the storage path {storage_path}: {reason}.\n"
            f"To fix it: set COURSE_STORAGE_PATH (or a script's --storage-path) to a folder or bucket you can write "
            f"to; on a cluster, to {SHARED_STORAGE_HINT}."
        ) from None
    try:
        missing = _nodes_missing(probe)
    finally:
        storage.delete_file(probe)
    if missing:
        details = "; ".join(f"{node_id[:8]}: {why}" for node_id, why in missing.items())
        raise StoragePathError(
            f"The storage path {storage_path} is not reachable from {len(missing)} node(s) of the cluster "
            f"({details}), so their checkpoints would be lost or unreadable.\n"
            f"To fix it: set COURSE_STORAGE_PATH to {SHARED_STORAGE_HINT}, and give every node access to it."
        )
    return storage_path

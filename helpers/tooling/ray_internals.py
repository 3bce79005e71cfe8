"""Every private Ray API the course relies on, in one place, written for Ray 2.60.0.

Ray may change or drop any of these in any release. Each function names, in a comment, the public API that is
missing; `PRIVATE_APIS` lists what they import, and tests/test_ray_internals.py fails when the installed Ray lacks
one, or when code elsewhere in the course uses a private Ray API instead of this module. The formats of Ray 2.60's
logs that the course reads (Ray Train's controller log, the lines Ray forwards to a notebook) are here too.

Private modules are imported inside the functions: importing this module imports no Ray.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from helpers.system import environ

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.train import ScalingConfig

#: Every (module, attribute) this module relies on; an attribute may be a dotted path (class, then attribute).
PRIVATE_APIS = (
    ("ray._private.state", "state.get_cluster_config"),
    ("ray._raylet", "GCS_AUTOSCALER_CLUSTER_CONFIG_KEY"),
    ("ray._raylet", "GCS_AUTOSCALER_STATE_NAMESPACE"),
    ("ray.core.generated.autoscaler_pb2", "ClusterConfig"),
    ("ray.core.generated.autoscaler_pb2", "NodeGroupConfig"),
    ("ray.experimental.internal_kv", "_internal_kv_get"),
    ("ray.experimental.internal_kv", "_internal_kv_put"),
    ("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS"),
    ("ray._private.ray_constants", "KV_NAMESPACE_PDB"),
    ("ray.experimental.internal_kv", "_internal_kv_list"),
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator", "get_or_create_autoscaling_coordinator"),
    ("ray.train.v2._internal.logging.logging", "LoggingManager.get_log_directory"),
    ("ray._private.internal_api", "node_stats"),
    ("ray.core.generated.node_manager_pb2", "GetNodeStatsReply.STORE_STATS_FIELD_NUMBER"),
    ("ray.core.generated.node_manager_pb2", "ObjectStoreStats.OBJECT_STORE_BYTES_USED_FIELD_NUMBER"),
    ("ray.core.generated.node_manager_pb2", "ObjectStoreStats.OBJECT_STORE_BYTES_AVAIL_FIELD_NUMBER"),
    ("ray.core.generated.node_manager_pb2", "ObjectStoreStats.OBJECT_STORE_BYTES_FALLBACK_FIELD_NUMBER"),
    ("ray.core.generated.node_manager_pb2", "ObjectStoreStats.SPILLED_BYTES_TOTAL_FIELD_NUMBER"),
    ("ray.core.generated.node_manager_pb2", "ObjectStoreStats.RESTORED_BYTES_TOTAL_FIELD_NUMBER"),
    ("ray.core.generated.node_manager_pb2", "ObjectStoreStats.CUMULATIVE_CREATED_BYTES_FIELD_NUMBER"),
    ("ray._common.network_utils", "build_address"),
    ("ray._common.network_utils", "parse_address"),
    ("ray._common.utils", "get_ray_address_file"),
    ("ray._private.utils", "read_ray_address"),
    ("ray._private.runtime_env.constants", "RAY_JOB_CONFIG_JSON_ENV_VAR"),
    ("ray._raylet", "DASHBOARD_AGENT_LISTEN_PORT_NAME"),
    ("ray._raylet", "wait_for_persisted_port"),
    ("ray._private.worker", "global_worker"),
    ("ray._private.node", "Node.get_session_dir_path"),
    ("ray._private.node", "Node.node_id"),
    ("ray.train.v2._internal.execution.context", "logger"),
    ("ray._private.authentication.authentication_token_setup", "_enable_token_auth"),
    ("ray._private.authentication.authentication_utils", "is_token_auth_enabled"),
    ("ray._private.authentication.http_token_authentication", "get_auth_headers_if_auth_enabled"),
    ("ray.data._internal.progress", "logger"),
    ("ray.train", "ScalingConfig._resources_per_worker_not_none"),
    ("ray.train.v2._internal.execution.controller.placement_group_cleaner", "logger"),
    ("ray.train.v2._internal.execution.callback", "ControllerCallback.after_controller_start"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback.after_worker_group_start"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback.after_worker_group_training_start"),
    ("ray.train.v2._internal.execution.callback", "ReportCallback.after_report"),
    ("ray.train.v2._internal.callbacks.env_callback", "_initialize_env_callbacks"),
    ("ray.dashboard.modules.metrics.dashboards.train_dashboard_panels", "TRAIN_GRAFANA_ROWS"),
)


def missing_private_apis() -> list[str]:
    """The entries of PRIVATE_APIS that the installed Ray lacks, as "module.attribute"."""
    missing = []
    for module, attribute in PRIVATE_APIS:
        try:
            functools.reduce(getattr, attribute.split("."), importlib.import_module(module))
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attribute}")
    return missing


# --- The cluster and its autoscaler ----------------------------------------------------------------------------

def reported_node_groups() -> list[dict[str, Any]]:
    """The node types in Ray's cluster config (Anyscale's autoscaler reports them): name, resources, min and max count.

    Empty when no autoscaler reported any (Ray's own autoscaler does not).
    """
    # no public API: the autoscaler's node types; `ray.autoscaler.sdk` has no getter
    import ray._private.state

    config = ray._private.state.state.get_cluster_config()
    if config is None:
        return []
    return [{"name": group.name, "resources": dict(group.resources), "min_count": group.min_count,
             "max_count": group.max_count} for group in config.node_group_configs]


def report_node_groups(node_groups: list[dict[str, Any]]) -> None:
    """Write node types (dicts as `reported_node_groups` returns them) into Ray's cluster config, as Anyscale does."""
    # no public API: only an autoscaler writes the cluster config (tests play Anyscale's with this)
    # Ray's Cython module and its generated protobuf classes: their stubs do not name these (mypy)
    from ray._raylet import (  # type: ignore[attr-defined]
        GCS_AUTOSCALER_CLUSTER_CONFIG_KEY,
        GCS_AUTOSCALER_STATE_NAMESPACE,
    )
    from ray.core.generated.autoscaler_pb2 import ClusterConfig, NodeGroupConfig  # type: ignore[attr-defined]
    from ray.experimental.internal_kv import _internal_kv_put

    config = ClusterConfig(node_group_configs=[NodeGroupConfig(**group) for group in node_groups])
    _internal_kv_put(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, config.SerializeToString(), overwrite=True,
                     namespace=GCS_AUTOSCALER_STATE_NAMESPACE)


def autoscaler_report() -> dict[str, Any] | None:
    """The report Ray's autoscaler writes every few seconds (node types, pending nodes); None when none runs."""
    # no public API: `ray status` prints this report as text only
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    return json.loads(status).get("autoscaler_report") if status else None


def autoscaling_coordinator() -> ActorHandle:
    """The detached actor Ray Train asks for resources on every `fit()`, created now if it does not exist yet."""
    # no public API: Ray Train creates it itself, in its first fit() (see helpers.cluster.start_autoscaling_coordinator)
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


def object_store_stats(raylet_address: str, raylet_port: int) -> dict[str, int]:
    """One node's object store, as its raylet reports it: bytes used, capacity and in fallback files now; bytes
    spilled to disk, restored from it and created, since the node started."""
    # no public API: `ray memory --stats-only` prints these, as text, for the whole cluster (memory_summary)
    from ray._private.internal_api import node_stats

    stats = node_stats(raylet_address, raylet_port, include_memory_info=False).store_stats
    return {"used": stats.object_store_bytes_used, "capacity": stats.object_store_bytes_avail,
            "fallback": stats.object_store_bytes_fallback, "spilled": stats.spilled_bytes_total,
            "restored": stats.restored_bytes_total, "created": stats.cumulative_created_bytes}


#: Two settings of Ray Data 2.60's Parquet reader that it reads from the environment of the process that calls
#: `read_parquet`, as it plans the read (ray/data/_internal/datasource_v2/formats/parquet/): the most uncompressed
#: bytes it packs into one read task (parquet_datasource_v2.py, `get_file_partitioner`; 128 MiB when unset), and the
#: actors that read the files' footers each time the dataset is listed, every epoch (footer_file_indexer.py,
#: `FooterFileIndexer.__init__`; 32 when unset).
PARQUET_READ_TASK_BYTES_VAR = "RAY_DATA_PARQUET_BIN_PACKING_BYTES"
PARQUET_FOOTER_ACTORS_VAR = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


@contextlib.contextmanager
def parquet_read_plan(read_task_bytes: int, footer_actors: int) -> Iterator[None]:
    """Within the `with` block, `ray.data.read_parquet` packs at most `read_task_bytes` of Parquet data into one read
    task, and lists the files with `footer_actors` actors."""
    # no public API: read_parquet's `override_num_blocks` does not reach the packer (it ignores partition hints), and
    # nothing else sizes the footer readers
    settings = {PARQUET_READ_TASK_BYTES_VAR: str(read_task_bytes), PARQUET_FOOTER_ACTORS_VAR: str(footer_actors)}
    with environ(**settings):
        yield


def pdb_breakpoints() -> list[dict[str, Any]]:
    """The breakpoints of `RAY_DEBUG=legacy` now waiting in the connected cluster, as `ray debug` lists them: each
    worker's pdb registers a JSON record (`pdb_address`, `filename`, `lineno`, `job_id`, ...) in the GCS's key-value
    store under "RAY_PDB_<id>" (ray/util/rpdb.py, ray/scripts/scripts.py `debug`)."""
    from ray._private.ray_constants import KV_NAMESPACE_PDB
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    records = (_internal_kv_get(key, namespace=KV_NAMESPACE_PDB)
               for key in _internal_kv_list("RAY_PDB_", namespace=KV_NAMESPACE_PDB))
    return [json.loads(record) for record in records if record is not None]


def host_port_address(ip: str, port: int) -> str:
    """Ray's "ip:port" (an IPv6 ip in brackets): the address `ray start --head` advertises for a GCS at `ip` and
    `port`, and the form of any other Ray server's address (a node's metrics endpoint)."""
    # no public API: Ray's own address formatting, the one `ray start` records in ray_current_cluster
    from ray._common.network_utils import build_address

    return build_address(ip, port)


def gcs_host_port(address: str) -> tuple[str, int] | None:
    """The host and port of a GCS address as `host_port_address` writes it; None when `address` is not "host:port"."""
    # no public API: Ray's own parsing of the addresses it records (the inverse of build_address)
    from ray._common.network_utils import parse_address

    parsed = parse_address(address)
    if parsed is None or not parsed[0] or not parsed[1].isdigit():
        return None
    return parsed[0], int(parsed[1])


def recorded_cluster_file() -> str:
    """The file in which `ray start` records its cluster's GCS address on this machine, for a plain `ray.init()`
    to join: `$RAY_TMPDIR/ray/ray_current_cluster` (/tmp/ray/ray_current_cluster by default); `ray stop` deletes it."""
    # no public API: Ray's own path of it (RAY_TMPDIR, else TMPDIR on Linux, else /tmp)
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(None)


def recorded_cluster_address() -> str | None:
    """The address in `recorded_cluster_file()`, which a plain `ray.init()` (no address, no RAY_ADDRESS) joins
    without asking whether that cluster still runs; None when there is no such file."""
    # no public API: what ray.init() reads (ray/_private/services.py, get_ray_address_from_environment)
    from ray._private.utils import read_ray_address

    return read_ray_address(None)


# --- Jobs and tokens -------------------------------------------------------------------------------------------

def submitted_job_config() -> dict[str, Any] | None:
    """The job config `ray job submit` hands its entrypoint process (its runtime env among it); None outside a job."""
    # no public API before ray.init(): `ray.get_runtime_context().runtime_env` needs a connected driver
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    raw = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return json.loads(raw) if raw else None


def jobs_agent_port(timeout_s: float = 10.0) -> int | None:
    """The HTTP port of the dashboard agent of the Ray this driver started, which serves the Jobs API's requests;
    -1 when the agent could not bind its port (52365: `ray.init()` has no option for it, so a second local Ray on
    the machine, or any socket there on that port, leaves it taken); None when the agent did not say within
    timeout_s (it says as it starts)."""
    # no public API: the agent persists its port in the session dir (dashboard/agent.py, persist_port), -1 on failure
    from ray._private.worker import global_worker
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, wait_for_persisted_port  # type: ignore[attr-defined]

    node = global_worker.node
    try:
        return wait_for_persisted_port(node.get_session_dir_path(), node.node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME,
                                       timeout_ms=int(timeout_s * 1000))
    except RuntimeError:  # "Timed out waiting for file ..."
        return None


def enable_token_auth() -> None:
    """Send Ray's token from now on: RAY_AUTH_MODE=token for this process and its children, Ray's config reloaded."""
    # no public API: Ray reads RAY_AUTH_MODE once into its config, and `ray.init()` has no token option
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


def token_auth_enabled() -> bool:
    """Whether the Ray of this process (a driver, or a worker of a cluster) runs with token authentication."""
    # no public API: the authentication mode is in Ray's internal config only
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()


def auth_headers() -> dict[str, str]:
    """The HTTP headers that carry this process's Ray token to the dashboard; {} when token auth is off."""
    # no public API: `JobSubmissionClient` adds the token to its own requests only
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    return get_auth_headers_if_auth_enabled({})


# no public API: Ray Data logs the notice once per process from this private module's logger, with no switch
#: The logger of Ray Data's "Progress bars disabled" notice.
RAY_DATA_PROGRESS_LOGGER = "ray.data._internal.progress"
def ray_train_report_logger() -> str:
    """The name of the logger of Ray Train's "Reporting training result ..." lines, one per worker and report."""
    # no public API: train/v2/_internal/execution/context.py names it `logging.getLogger(__file__)`, a path,
    # outside the `ray.train` logger whose level `RunConfig(logging_config=...)` sets
    import ray

    return os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution", "context.py")


# --- Ray Tune --------------------------------------------------------------------------------------------------

#: The files in which Ray Tune 2.60's driver saves a search's state, in the search's folder (TuneController.CKPT_FILE_TMPL,
#: ray/tune/execution/tune_controller.py); the newest one is what `Tuner.restore` reads.
TUNE_STATE_FILES = "experiment_state-*.json"


def tune_trial_statuses(experiment_state: dict[str, Any]) -> dict[str, str]:
    """Each trial's status (PENDING, RUNNING, TERMINATED, ERROR, ...) in a loaded `experiment_state-*.json`."""
    # no public API: a ResultGrid does not say which trials finished; ExperimentAnalysis(path).trials does, but it
    # also reads every trial's results and logs a warning for each trial without one
    statuses = {}
    for trial_json, _ in experiment_state["trial_data"]:
        trial = json.loads(trial_json)
        statuses[trial["trial_id"]] = trial["status"]
    return statuses


def tune_trial_actor_id(trial: Any) -> str | None:
    """The id (hex) of the actor that runs a Tune trial's function, its driver; None while it has none."""
    # no public API: a Callback gets the Trial, whose actor handle is in its temporary state, and the state API
    # (ray.util.state) finds an actor by its id only
    actor = trial.temporary_state.ray_actor
    return None if actor is None else actor._actor_id.hex()


# --- Ray Train -------------------------------------------------------------------------------------------------

# no public API: Ray Train's PlacementGroupCleaner logs from its private module's logger, outside the loggers that
# `RunConfig(logging_config=...)` sets (it runs in its own detached actor)
#: The logger of Ray Train's PlacementGroupCleaner, the actor that frees a run's workers' resources when the run's
#: controller dies without doing it (Ray 2.60, train/v2/_internal/execution/controller/placement_group_cleaner.py).
TRAIN_PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
#: How its routine cleanup message begins, logged at WARNING each time it frees one: every time Ray Tune stops a
#: trial (ASHA's decision, the end of a search), the trial's driver and its Ray Train controller end with it.
TRAIN_PLACEMENT_GROUP_CLEANUP = "Detected that the Ray Train controller actor"

# no public API: `Result.from_path` logs, at INFO and from a private module's logger, that it found the run's snapshot
# and will resume from it, as if a new run were starting
#: The logger of Ray Train's checkpoint manager (Ray 2.60, train/v2/_internal/execution/checkpoint/checkpoint_manager.py).
TRAIN_CHECKPOINT_MANAGER_LOGGER = "ray.train.v2._internal.execution.checkpoint.checkpoint_manager"


def train_resources_per_worker(scaling_config: ScalingConfig) -> dict[str, float]:
    """What Ray Train reserves for each worker of `scaling_config`, by Ray Train's own rule (its defaults filled in)."""
    # no public API: ScalingConfig exposes what was asked for (resources_per_worker may be None), not what it reserves
    return scaling_config._resources_per_worker_not_none


def train_log_dir() -> str:
    """Where Ray Train writes its log files on this node, in the Ray session this process joined."""
    # no public API: Ray Train's log folder (<session dir>/logs/train) is known only to its LoggingManager
    from ray.train.v2._internal.logging.logging import LoggingManager

    log_dir = LoggingManager.get_log_directory()
    if log_dir is None:
        raise RuntimeError("This process has not joined a Ray session: start Ray first (setup() or start_ray()).")
    return log_dir


#: Ray Train's controller writes its log records (JSON lines, DEBUG included) to these files in `train_log_dir()`
#: (Ray 2.60, ray/train/v2/_internal/logging/logging.py).
TRAIN_CONTROLLER_LOGS = "ray-train-sys-controller-*.log"
#: The controller's record as it asks for its first worker group: the end of the controller's own set-up.
TRAIN_WORKER_GROUP_REQUESTED = "Attempting to start training worker"
#: What Ray Train's controller logs, with its own clock, as it starts a worker group (Ray 2.60,
#: ray/train/v2/_internal/execution/worker_group/worker_group.py): phase -> the message's pattern.
TRAIN_STARTUP_PHASES = {
    "placement_group": r"Placement group ready in ([\d.]+)s",
    "worker_processes": r"\d+ worker actors created in ([\d.]+)s",
    "train_context": r"Train context initialized on workers in ([\d.]+)s",
    "process_group_and_callbacks": r"after_worker_group_start callbacks completed in ([\d.]+)s",
    "train_function_shipped": r"Train function launched on workers in ([\d.]+)s",
    "worker_group_total": r"Worker group startup completed in ([\d.]+)s total",
}


# --- The lines Ray forwards to a notebook (Ray 2.60) -----------------------------------------------------------

#: A line Ray forwarded from another process: "(RayTrainWorker pid=42, ip=10.0.0.2) ...", "(pid=gcs_server) ...",
#: "(raylet) ...", "(autoscaler +1m2s) ...", optionally in colour; the note Ray prints under de-duplicated lines;
#: or a line of Ray's C++ core log ("[2026-11-22 13:06:00,208 E 12379 12379] core_worker.cc:2465: ..."), which
#: the kernel's Ray client writes itself.
RAY_LOG_LINE = re.compile(
    r"^(\x1b\[[\d;]*m)?\(((\w+ )?pid=\w+|raylet|autoscaler \+[\w.]+)(, ip=[\w.:-]+)?\)"
    r"|^\(Ray deduplicates logs by default\."
    r"|^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] \w+\.cc:\d+: "
)

#: The start of a Python logger's line as Ray 2.60 formats it in a job's log (ray_constants.LOGGER_FORMAT, as in
#: "<date time>\tINFO job_manager.py:581 -- ..."; a driver's `ray.init()` logs so too): the time, then the level.
_RAY_LOGGER_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+"
#: The line Ray's job manager writes to a job's log as it starts the job (dashboard/modules/job/job_manager.py). A job
#: submitted again under a deleted job's id appends to the same file, after its own such line; not anchored at the
#: line's start, since the old job's monitor may have left its last message without a newline.
JOB_START_LINE = re.compile(_RAY_LOGGER_TIME + r"INFO job_manager\.py:\d+ -- Runtime env is setting up\.$")
#: Ray's own lines in a job's log: its loggers' and the supervisor's "Running entrypoint for job ...", written as the
#: job starts but flushed after the job's first output (job_supervisor.py).
JOB_RAY_LINE = re.compile(rf"^{_RAY_LOGGER_TIME}[A-Z]+ \w+\.py:\d+ -- |^Running entrypoint for job ")

#: Colour codes, and the note Ray appends to a line it printed once for several processes.
RAY_LOG_DECORATION = re.compile(r"\x1b\[[\d;]*m|\s*\[repeated \d+x across cluster\].*$")

#: The prefix of a forwarded line, up to the message ("(RayTrainWorker pid=42) ", "[... E 1 1] core_worker.cc:9: ").
RAY_LOG_PREFIX = re.compile(
    r"^\(((\w+ )?pid=\w+|raylet|autoscaler \+[\w.]+)(, ip=[\w.:-]+)?\) ?"
    r"|^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] \w+\.cc:\d+: "
)

#: A forwarded message that reports an error. The rule looks at what a line says, not at its log level:
#: the committed outputs hold benign lines logged at level E ("(pid=gcs_server) [...] E ... Failed to kill
#: actor ...: Socket closed" while Ray tears actors down; "[... E ...] core_worker.cc: Actor with class name:
#: 'MapWorker(...)' ... has constructor arguments in the object store") and Ray Data warnings; none of them
#: is a traceback, an exception line or a Ray Train failure report, so they stay out of the comparison.
#: The Ray Train phrases are the ones Ray 2.60 logs: ray/train/v2/_internal/util.py ("Error in training
#: function:"), api/exceptions.py (WorkerGroupError), worker_group/poll.py ("[Rank 1 Error Snippet]:").
RAY_ERROR_MESSAGE = re.compile(
    r"^Traceback \(most recent call last\):"
    # an exception line: "ValueError: x", "TimeoutError", "ray.exceptions.RayTaskError(ValueError): ...",
    # "helpers.fault_tolerance.InjectedFailure: ...", Ray Train's "Error: Training failed ..."
    r"|^([A-Za-z_]\w*\.)*\w*(Error|Exception|Failure|Interrupt|Exit)(\([\w.]*\))?(:\s|:?$)"
    r"|Error in training function:"
    r"|Training failed due to worker errors"
    r"|\[Rank [\d, ]+ Error Snippet\]"
    r"|Exception raised in creation task"
    r"|A worker died or was killed"
)

#: Known noise in Ray 2.60, allowed in every cell. Ray Data lists a dataset's files with worker threads and a
#: "completion-signaler" thread (ray/data/_internal/dynamic_work_queue.py); once the listing is complete, the
#: signaler still puts its last sentinels on queues the finished listing has already interrupted, and if it
#: loses that race it dies with an uncaught InterruptedError, which Python prints as "Exception in thread
#: pool-N/completion-signaler:" and a traceback. The files were all listed. Only that block passes: the header,
#: the traceback's indented lines and a last line that is exactly "InterruptedError"; any other line ends it.
_LISTING_NOISE_HEADER = r"Exception in thread pool-\d+/completion-signaler:"
RAY_DATA_LISTING_NOISE = re.compile(rf"^{_LISTING_NOISE_HEADER}$")
#: The same block when the listing ran in the kernel's own process (Ray Data lists some datasets in the driver):
#: Python prints it to the kernel's stderr, unprefixed, so it would show up as output the recording does not have.
#: It leaves the comparison whole, and only whole: a block that ends in another exception stays.
KERNEL_LISTING_NOISE = re.compile(
    rf"^{_LISTING_NOISE_HEADER}\nTraceback \(most recent call last\):\n(?:  .*\n)+InterruptedError\n",
    re.MULTILINE,
)

#: Known noise in Ray 2.60, allowed in every cell: a SplitCoordinator (the actor that hands a dataset's blocks to
#: Ray Train's workers) reporting "SystemExit". Ray Train shuts these actors down when a worker group ends, after a
#: failure too (ray/train/v2/_internal/data_integration/dataset_manager.py, shutdown_data_executors), and Ray
#: ends an actor by raising SystemExit in it (ray.actor.exit_actor, CoreWorker.drain_and_exit_worker); a
#: concurrent actor may print it from the thread that was serving a split. Seen in CI in lesson 05's injected
#: failure. Only that one line passes: any other line of a SplitCoordinator's is checked as usual.
DATA_COORDINATOR_EXIT = re.compile(r"^\(SplitCoordinator pid=\w+(, ip=[\w.:-]+)?\) SystemExit(: \d+)?$")


#: Ray Train builds the callbacks this variable names (`module.Class`, comma-separated), in the driver, at every
#: `fit()`, and runs them in the run's controller (Ray 2.60, train/v2/_internal/constants.py and callbacks/env_callback.py).
TRAIN_CALLBACKS_VAR = "RAY_TRAIN_CALLBACKS"


def train_run_callback_bases() -> tuple[type, ...]:
    """The base classes of a callback that hears a Ray Train run's controller start, its worker group start and its
    training start, and every report: Ray 2.60's ControllerCallback, WorkerGroupCallback and ReportCallback.

    Public API missing: `ray.train.UserCallback` hears reports and exceptions only, not the start-up's phases.
    """
    from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback, WorkerGroupCallback

    return ControllerCallback, WorkerGroupCallback, ReportCallback


def env_train_callbacks() -> list[Any]:
    """The callbacks Ray Train builds from TRAIN_CALLBACKS_VAR at a `fit()` in this process (as instances).

    Public API missing: none; this is how Ray Train itself reads the variable (`_initialize_env_callbacks`).
    """
    from ray.train.v2._internal.callbacks.env_callback import _initialize_env_callbacks

    return _initialize_env_callbacks()


# --- Ray's Grafana dashboards ----------------------------------------------------------------------------------

def train_dashboard_panels() -> list[dict[str, Any]]:
    """The panels of Ray's Train dashboard in Grafana, as the installed Ray generates it into
    `<session>/metrics/grafana/dashboards/train_grafana_dashboard.json`: each panel's row, title, description and the
    metrics its queries read.

    Public API missing: the dashboards are generated from this module; only their JSON is written out.
    """
    from ray.dashboard.modules.metrics.dashboards.train_dashboard_panels import TRAIN_GRAFANA_ROWS

    return [{"row": row.title, "title": panel.title, "description": panel.description,
             "metrics": sorted({name for target in panel.targets for name in re.findall(r"\bray_\w+(?=[{\[])",
                                                                                     target.expr)})}
            for row in TRAIN_GRAFANA_ROWS for panel in row.panels]

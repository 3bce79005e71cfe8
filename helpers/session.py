"""`setup()`: the one line at the top of every notebook, and where Ray runs: a local Ray or a cluster (`start_ray`).

Token authentication is in helpers.auth, log levels and warning filters in helpers.logs; the names that lived here
before stay importable from here (the `import X as X` lines).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import helpers
from helpers.auth import DEFAULT_TOKEN_FILE as DEFAULT_TOKEN_FILE
from helpers.auth import TOKEN_VARS as TOKEN_VARS
from helpers.auth import send_token_if_given, token_auth_state
from helpers.auth import token_source as token_source
from helpers.config import ConfigError, CourseConfig, load_config, load_dotenv_file
from helpers.logs import CPU_RACE_WAIT_S as CPU_RACE_WAIT_S
from helpers.logs import RAY_INTERNAL_WARNINGS as RAY_INTERNAL_WARNINGS
from helpers.logs import WORKER_ENV_DEFAULTS, quiet_driver_logs, quiet_worker_loggers, worker_warning_filters
from helpers.logs import logger_level as logger_level
from helpers.system import wait_until
from helpers.tooling import ray_internals

#: The dashboard (and the Jobs API behind it) listens on loopback only.
DASHBOARD_HOST = "127.0.0.1"
#: How long a request to the dashboard may take before it fails with TimeoutError.
DASHBOARD_TIMEOUT_S = 60
#: Ray Train's switch for its preemption watcher (read from the driver's environment at every fit()).
PREEMPTION_WATCHER_VAR = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
#: A local Ray's Jobs API needs its dashboard agent on port 52365 (ray.init() has no option for it). When the port
#: is taken, the agent runs without it: start_ray tries again this many times in all, this many seconds apart.
JOBS_AGENT_TRIES, JOBS_AGENT_RETRY_S = 2, 2.0
JOBS_AGENT_PORT = 52365  # Ray's default for `ray start --dashboard-agent-listen-port`, the one ray.init() uses
JOBS_AGENT_OFF = (
    "Warning: this Ray's Jobs API is off. Its dashboard agent could not listen on port 52365, so submitting, "
    "stopping or deleting a job here fails (a submission says 'No available agent to submit job'). Another local "
    "Ray on this machine holds the port, or a connection held it for a moment: `ss -tanp 'sport = :52365'` names the "
    "process. To fix it: end that process, or restart the kernel if none is listed; to keep the other Ray, start "
    "this one with `ray start --head --dashboard-agent-listen-port=0` and set RAY_ADDRESS to the address it prints.")
#: The dashboard address of the Ray this kernel started or joined, kept for re-runs of setup().
_dashboard_url: str | None = None


def quiet_worker_logs() -> None:
    """Run by Ray in every worker process it starts: Ray's per-epoch info lines stay in its log files
    (`helpers.logs.quiet_worker_loggers`), and the worker learns its cluster's address (`name_this_cluster`)."""
    quiet_worker_loggers()
    name_this_cluster()


def name_this_cluster() -> None:
    """Run in every worker process: RAY_ADDRESS names the cluster this worker belongs to, unless already set.

    Ray's State API looks a cluster up by RAY_ADDRESS, else by the Ray processes running on the machine, and fails
    with "Found multiple active Ray instances" when there are several (two notebooks' local Rays). Ray Train 2.60's
    PlacementGroupCleaner uses it to see whether a run's controller is alive; when it fails, the placement group of
    a run whose controller was killed (a Tune trial stopped, lesson 11) is never removed, and its CPUs stay reserved.
    """
    import ray

    # "local" or "auto" (inherited from a driver started with RAY_ADDRESS=local) name no cluster: Ray would look one
    # up again, by the file `ray start` writes or by the GCS processes on the machine, and may find another.
    if os.environ.get("RAY_ADDRESS", "").strip() in ("", LOCAL_RAY, "auto"):
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


#: Passed on to every worker when set in this process: the callbacks Ray Train builds at each fit() (read in whichever
#: process calls it: a Tune trial, a job's driver) and the file the course's run recorder writes
#: (helpers.tooling.run_recorder, which the GPU lane sets).
RUN_RECORD_VAR = "COURSE_RUN_RECORD"
PASSED_ON = (ray_internals.TRAIN_CALLBACKS_VAR, RUN_RECORD_VAR)


def job_runtime_env() -> dict | None:
    """The runtime environment of the Ray job this process is the entrypoint of (`ray job submit`), else None."""
    job_config = ray_internals.submitted_job_config()
    return (job_config.get("runtime_env") or {}) if job_config is not None else None


def runtime_env(cfg: CourseConfig) -> dict:
    """The Ray runtime environment every worker gets: the `helpers` package and the course settings.

    `py_modules` uploads `helpers` so it imports on every node of a real cluster;
    a `sys.path` tweak would only reach the driver. Each worker runs `quiet_worker_logs` as it starts.
    Inside a submitted job, what the job's own runtime env sets wins: `ray.init` refuses to merge two runtime
    envs that set the same field or the same variable, and the job's values are already this process's.
    """
    ours: dict[str, Any] = {
        "py_modules": [str(Path(helpers.__file__).parent)],
        "env_vars": {**{name: os.environ.get(name, value) for name, value in WORKER_ENV_DEFAULTS.items()},
                     **{name: os.environ[name] for name in PASSED_ON if os.environ.get(name)},
                     **cfg.as_env(), "PYTHONWARNINGS": worker_warning_filters()},
        "worker_process_setup_hook": f"{__name__}.{quiet_worker_logs.__name__}"}
    job = job_runtime_env()
    if job is None:
        return ours
    merged = {field: value for field, value in ours.items() if field not in job}
    if "py_modules" not in merged:  # the hook imports `helpers`: only where this env ships it to the workers
        merged.pop("worker_process_setup_hook", None)
    merged["env_vars"] = {name: value for name, value in ours["env_vars"].items() if name not in job.get("env_vars", {})}
    return merged


#: RAY_ADDRESS=local: always start a local Ray, also where `ray start` recorded a cluster (Ray's `ray.init("local")`).
LOCAL_RAY = "local"
#: How long `ray_target` waits for the GCS of the cluster `ray start` recorded to accept a connection. A live GCS
#: accepts at once, across a network too; a dead one would keep `ray.init()` waiting for ever.
RECORDED_CLUSTER_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RayTarget:
    """The Ray that `start_ray` runs on: the cluster at `address`, or a new local Ray (`address` None)."""

    address: str | None
    #: What named the cluster: "RAY_ADDRESS", or the file in which `ray start` recorded it.
    named_by: str | None = None
    #: Why a local Ray starts although `ray start` recorded a cluster (it does not answer): the line to print.
    passed_over: str | None = None


def ray_target(cfg: CourseConfig, timeout_s: float = RECORDED_CLUSTER_TIMEOUT_S) -> RayTarget:
    """Which Ray `start_ray` joins or starts: RAY_ADDRESS's cluster, else the cluster `ray start` recorded on this
    machine when it answers, else a new local Ray.

    A plain `ray.init()` joins the recorded cluster without asking whether it still runs, and the file outlives a
    head that was killed, ran out of memory or lost its container (only `ray stop` deletes it): `ray.init()` then
    retries that cluster for about 14 minutes (20 tries, about 40 s each) with nothing in a notebook, then fails.
    RAY_ADDRESS=auto joins the recorded cluster too: when it
    does not answer, this raises ConfigError at once.
    """
    if cfg.ray_address == LOCAL_RAY:
        return RayTarget(None)
    if cfg.ray_address not in (None, "auto"):
        return RayTarget(cfg.ray_address, "RAY_ADDRESS")
    file, recorded = ray_internals.recorded_cluster_file(), ray_internals.recorded_cluster_address()
    why = None if recorded is None else _unreachable(recorded, timeout_s)
    if cfg.ray_address == "auto":
        if why is not None:
            raise ConfigError(
                f"RAY_ADDRESS=auto joins the cluster that `ray start` recorded in {file}, {recorded}, but it does not "
                f"answer ({why}). To fix it: start that cluster again, or set RAY_ADDRESS to the address of a running "
                f"one, or to {LOCAL_RAY} to start a local Ray; if no Ray runs there any more, delete the file "
                f"(rm {file}).")
        return RayTarget(cfg.ray_address, "RAY_ADDRESS")  # Ray finds it: the recorded cluster, or its GCS process
    if recorded is None:
        return RayTarget(None)
    if why is None:
        return RayTarget(recorded, file)
    return RayTarget(None, passed_over=(
        f"Ray: {file} names the cluster {recorded}, which does not answer ({why}), so a local Ray starts instead. "
        f"That file is left over from a Ray that ended without `ray stop`: delete it (rm {file}), or set "
        f"RAY_ADDRESS={LOCAL_RAY} to always start a local Ray (`ray stop` deletes it too, but stops every Ray on "
        "this machine)."))


def _unreachable(address: str, timeout_s: float) -> str | None:
    """Why nothing at the GCS address `address` accepts a TCP connection within `timeout_s`; None when it does."""
    host_port = ray_internals.gcs_host_port(address)
    if host_port is None:
        return "not a host:port address"
    try:
        with socket.create_connection(host_port, timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as error:  # refused (nothing listens there), no route to the host, a name that does not resolve
        return (error.strerror or str(error)).lower()


#: The Ray that `start_ray` last joined or started in this process; None before it runs.
_target: RayTarget | None = None


def joined_address(cfg: CourseConfig) -> str | None:
    """The address of the cluster this process joined (RAY_ADDRESS, or one `ray start` recorded); None: a local Ray."""
    if _target is not None:
        return _target.address
    return None if cfg.ray_address == LOCAL_RAY else cfg.ray_address  # Ray was started without start_ray


#: The Ray that `ray_address` last named (see `ray_started`); None before it runs.
_asked: RayTarget | None = None


def ray_address(cfg: CourseConfig) -> str:
    """The address to pass to `ray.init`: the cluster to join (see `ray_target`), or "local" to start a local Ray.

    It also readies this process for that Ray. Joining a cluster, it sends Ray's token when this process has one
    (RAY_AUTH_MODE=token, `helpers.auth`): Ray sends it to a cluster named by its address only then. On a local Ray,
    where `ray.init` turns token auth on by itself, it switches Ray Train's preemption watcher off.
    """
    global _asked

    target = ray_target(cfg)
    if target.passed_over:
        print(target.passed_over, flush=True)
    if target.address:
        send_token_if_given()  # a cluster with token auth refuses a driver that does not send it
    else:
        # One machine is never preempted: skip the actor Ray Train starts on every fit() to watch for node
        # preemption. On 2 cores that process competes with the workers' start-up: fit() to first step
        # took 13 s instead of 16 s here. Clusters (RAY_ADDRESS) keep it; .env can set it either way.
        os.environ.setdefault(PREEMPTION_WATCHER_VAR, "0")
    _asked = target
    # The address is always explicit: with none, Ray would read the recorded cluster again, which may have changed.
    return target.address or LOCAL_RAY


def _started(context: Any) -> None:
    """After `ray.init(address=ray_address(cfg), ...)`: record where Ray runs, and quiet Ray's driver logs."""
    import ray

    global _dashboard_url, _target

    if not ray.is_initialized():
        raise RuntimeError("Ray is not running in this kernel: run ray.init(address=ray_address(cfg), ...) first.")
    _target = _asked
    _dashboard_url = getattr(context, "dashboard_url", None) or None
    # Ray Train asks this actor for resources on every fit() and waits 5 s for its answer: started now, in the
    # background, the first fit() of the session does not time out while it starts (see helpers.cluster).
    ray_internals.autoscaling_coordinator()
    quiet_driver_logs()  # from here on, Ray's warnings (not its info chatter) reach the notebook
    if _target is not None and not _target.address and ray_internals.jobs_agent_port() == -1:
        print(JOBS_AGENT_OFF)


def start_ray(cfg: CourseConfig, object_store_memory: int | None = None) -> float:
    """Start an embedded local Ray, or join a cluster (see `ray_target`); return the seconds it took.

    `object_store_memory` (bytes) sizes the local Ray's object store (Ray's default: 30% of RAM). A cluster's nodes
    sized theirs when they started (`ray start --object-store-memory`): with RAY_ADDRESS, `ray.init` refuses it.
    """
    import ray

    address = ray_address(cfg)
    target = _asked
    assert target is not None, "ray_address() records the Ray it names"
    if target.named_by not in (None, "RAY_ADDRESS") and object_store_memory is not None:
        # The script's own check (helpers.tooling.scripts) sees RAY_ADDRESS only; ray.init's error names neither.
        raise ConfigError(
            f"An object store size is given for the local Ray, but Ray joins the cluster that `ray start` recorded in "
            f"{target.named_by}, {target.address}, whose nodes sized their object stores when they started. To fix it: "
            f"set RAY_ADDRESS={LOCAL_RAY} to start a local Ray, or leave the size out to run on that cluster.")
    local: dict[str, Any] = {} if target.address else {"include_dashboard": True, "dashboard_host": DASHBOARD_HOST}
    if object_store_memory is not None:
        local["object_store_memory"] = object_store_memory
    started = time.perf_counter()
    for attempt in range(1, JOBS_AGENT_TRIES + 1):
        # Ray's start-up log lines carry timestamps and pids; setup() prints its own summary instead.
        context = ray.init(address=address, runtime_env=runtime_env(cfg), logging_level=logging.ERROR, **local)
        if (target.address or attempt == JOBS_AGENT_TRIES or ray_internals.jobs_agent_port() != -1
                or _another_server_on(JOBS_AGENT_PORT)):
            # Joined a cluster (its head's agent is the cluster's business), the agent is up, tried enough, or
            # another server (another local Ray's agent) holds the port: starting again would not help.
            break
        ray.shutdown()  # a connection held the port for a moment: a new start gets it
        time.sleep(JOBS_AGENT_RETRY_S)
    _started(context)
    return time.perf_counter() - started


def _another_server_on(port: int) -> bool:
    """Whether a process other than this Ray's own listens on `port`: another local Ray's dashboard agent, most often.
    (This Ray's agent may listen there on one address while it failed on the other: it binds the node's address,
    then loopback, and keeps the first when the second fails.) A listener of unknown owner counts as another."""
    import psutil

    try:
        listeners = [conn.pid for conn in psutil.net_connections("tcp")
                     if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port]
    except psutil.Error:  # some systems show other users' sockets to root only
        return True
    for pid in listeners:
        try:
            if pid is None or os.getpid() not in (parent.pid for parent in psutil.Process(pid).parents()):
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def ray_started(cfg: CourseConfig, context: Any) -> CourseConfig:
    """After your own `ray.init(address=ray_address(cfg), ...)` (lesson 00): what `setup()` does once Ray runs.

    It quiets Ray's driver logs, plans the workers (GPUs or CPUs, how many), prints what this kernel runs on, and
    returns the configuration to use from here on (`context`: what `ray.init` returned).
    """
    _started(context)
    return _running(cfg, _how())


def _how() -> str:
    """How this kernel came to run on its Ray, for the "Ray" line."""
    if _target is None:
        return "started by ray.init()"
    how = f"connected to {_target.address}" if _target.address else "started a local Ray"
    if _target.named_by not in (None, "RAY_ADDRESS"):
        how += f" (recorded by `ray start` in {_target.named_by})"
    return how


def _running(cfg: CourseConfig, how: str, dotenv: Path | None | bool = False) -> CourseConfig:
    """Plan the workers on the running Ray, print what this kernel runs on, and return the configuration to use.

    `dotenv`: the `.env` file setup() found (None: none), for its full table; False: only what Ray runs on.
    """
    import ray
    import torch

    from helpers.cluster import cluster_capacity, plan_workers

    joined = joined_address(cfg)
    capacity = cluster_capacity()
    plan = plan_workers(cfg, capacity=capacity)  # GPUs or CPUs, how many workers, and why
    # From here on, cfg.ray_address is the cluster this kernel joined (None: a local Ray, also for RAY_ADDRESS=local).
    cfg = replace(cfg, use_gpu=plan.use_gpu, num_workers=plan.num_workers, ray_address=joined,
                  worker_cpus=plan.resources_per_worker["CPU"])
    full = dotenv is not False
    _print_rows({
        **({"mode": _mode(cfg)} if full else {}),
        "device": "cuda (GPU)" if cfg.use_gpu else "cpu",
        **({"data dir": str(cfg.data_dir), "storage path": cfg.storage_path} if full else {}),
        "workers": plan.describe(),
        **({".env": _dotenv(dotenv)} if full else {}),  # type: ignore[arg-type]
        "Ray": f"{ray.__version__}, {how}",
        "cluster": capacity.describe(),
        "dashboard": f"http://{_dashboard_url}" if _dashboard_url else "not running",
        "token auth": token_auth_state(joined=joined is not None),
        **({"torch": torch.__version__} if full else {}),
    })
    return cfg


def setup(start: bool = True) -> CourseConfig:
    """Load `.env` and the configuration, start or reuse Ray, print the effective settings.

    Safe to re-run in the same kernel: a running Ray is reused, not started twice. With `start=False` this
    kernel starts no Ray (lesson 07 runs a cluster of its own processes and talks to it through its Jobs API).
    """
    import ray
    import torch

    dotenv = load_dotenv_file()
    cfg = load_config()
    _put_this_python_first_on_path()
    if not start:
        _print_rows({
            "mode": _mode(cfg),
            "data dir": str(cfg.data_dir),
            "storage path": cfg.storage_path,
            ".env": _dotenv(dotenv),
            "Ray": f"{ray.__version__}, not started in this kernel",
            "torch": torch.__version__,
        })
        return cfg
    if ray.is_initialized():
        how = "already running in this kernel: reused"
    else:
        seconds = start_ray(cfg)
        assert _target is not None, "start_ray() records where it started or joined Ray"
        how = f"{_how()} in {seconds:.1f} s"
    return _running(cfg, how, dotenv)


def _put_this_python_first_on_path() -> None:
    """Put this Python's `bin` folder first on PATH, as an activated virtualenv does: `!ray ...` and `!python ...`
    in a cell are then the pinned ones, also when JupyterLab was started without activating `.venv`."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    if path[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(entry for entry in path if entry != bin_dir)])


def _mode(cfg: CourseConfig) -> str:
    return cfg.mode + ("  (tiny runs: COURSE_SMOKE_TEST=1)" if cfg.smoke_test else "  (the lesson's real size)")


def _dotenv(found: Path | None) -> str:
    return str(found) if found else "none found (environment and defaults)"


def _print_rows(rows: dict[str, str]) -> None:
    width = max(map(len, rows))
    print("\n".join(f"{key:<{width}} : {value}" for key, value in rows.items()))


def start_task_workers(count: int, timeout_s: float = 60.0) -> int:
    """Have `count` worker processes for tasks started and ready, so the tasks you time next measure their work.

    Ray starts a worker process when a task needs one (a second or more on a busy machine), and ends one idle for
    over 1 s while its node has more idle workers than free CPUs (as while a placement group or a 2-CPU task holds
    them): a burst of tasks after that can wait for a process start. This runs `count` 0.2 s tasks at once until
    `count` different processes ran them, and returns `count`; after `timeout_s` it raises TimeoutError.
    Ask for no more than the free CPUs: more tasks than that wait for each other and share processes.
    """
    import ray

    @ray.remote(num_cpus=1)
    def _worker_id() -> str:
        time.sleep(0.2)  # long enough that the `count` tasks overlap, each in its own process
        return ray.get_runtime_context().get_worker_id()

    def each_in_its_own_process() -> bool:
        try:
            return len(set(ray.get([_worker_id.remote() for _ in range(count)], timeout=timeout_s))) >= count
        except ray.exceptions.GetTimeoutError:  # more tasks than free CPUs: wait_until then says so
            return False

    wait_until(each_in_its_own_process, timeout_s, interval_s=0,
               what=f"{count} tasks at once, each in a worker process of its own (ask for no more than the free CPUs)")
    return count


def dashboard_url() -> str:
    """The address of this session's Ray dashboard and of the Jobs API behind it, e.g. http://127.0.0.1:8265."""
    if _dashboard_url is None:
        raise RuntimeError("No Ray dashboard is known in this kernel: run setup() first (it starts one on 127.0.0.1, "
                           "or finds the dashboard of the cluster it joins).")
    return f"http://{_dashboard_url}"


def dashboard_get(path: str, token: bool = True) -> tuple[int, Any]:
    """GET `path` from the Ray dashboard of this session: the HTTP status and the JSON body (None on an error).

    With `token=True` the request carries Ray's token, as the dashboard's login page does once you paste it. The
    dashboard may take seconds to answer while a run's workers start on a small machine (10 s was too short once).
    """
    headers = ray_internals.auth_headers() if token else {}
    request = urllib.request.Request(f"{dashboard_url()}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=DASHBOARD_TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None

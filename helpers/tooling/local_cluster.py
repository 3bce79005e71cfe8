"""A multi-node Ray cluster on this one machine, started with `ray start` as you would on real machines.

`LocalCluster` runs one head node and some worker nodes, each a `ray start` of its own, so tests and the Ray Jobs
lesson meet what a real cluster does: a driver joins through `RAY_ADDRESS`, the cluster checks a token, the
dashboard answers on its own port. Three choices keep it apart from any other Ray on the machine (a notebook
kernel's `ray.init()`, a test's local Ray):

- a private temp dir (`--temp-dir`): `ray start` records the cluster's address in `<temp dir>/ray_current_cluster`,
  and a plain `ray.init()` only looks in `/tmp/ray/ray_current_cluster`, so it starts its own Ray instead of joining;
- free ports for everything with a fixed default (GCS 6379, dashboard 8265, Ray Client 10001, agent 52365);
- `stop()` ends only this cluster's processes; `ray stop` would end every Ray on the machine.

With `autoscaling_config`, Ray's autoscaler runs on the head with Ray's fake multi-node provider, which starts
each node it adds as a real raylet on this machine: see `fake_autoscaling_config`.

    with LocalCluster(worker_nodes=2) as cluster:
        print("\n".join(cluster.commands))
        env = {**os.environ, **cluster.driver_env(), "RAY_AUTH_MODE": "token"}
        subprocess.run([sys.executable, "train.py"], env=env, check=True)
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

import psutil
from ray.util import get_node_ip_address

from helpers.system import end_processes, free_ports, processes_naming
from helpers.tooling.ray_internals import host_port_address

#: The Ray CLI of this Python environment.
RAY_CLI = Path(sys.executable).parent / "ray"
#: Variables of the calling process that would point `ray start` at another cluster or another token.
#: (Ray reads RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH, so a token meant for another cluster would win.)
INHERITED_RAY_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
#: How long one `ray start` may take (about 13 s for a head on a 2-core machine).
START_TIMEOUT_S = 180
#: How long each stage of `stop()` lets its processes exit after SIGTERM before it sends SIGKILL.
STOP_GRACE_S = 10.0


def fake_autoscaling_config(node_types: dict[str, dict], max_workers: int) -> dict:
    """A cluster config (the shape of a cluster YAML) for Ray's fake multi-node provider.

    `node_types` maps a node type to its `resources`, e.g. `{"cpu_node": {"resources": {"CPU": 2}, "max_workers": 2}}`;
    `min_workers` defaults to 0. The head gets no CPU, so every task waits for a node the autoscaler adds.
    """
    head = {"resources": {"CPU": 0}, "node_config": {}, "min_workers": 0, "max_workers": 0}
    workers = {name: {"node_config": {}, "min_workers": 0, **node_type} for name, node_type in node_types.items()}
    return {
        "cluster_name": "fake-multinode",
        "max_workers": max_workers,
        "idle_timeout_minutes": 1,
        "provider": {
            "type": "fake_multinode",
            # The provider names each node after its id and never checks or updates a real machine.
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "head_node_type": "ray.head.default",
        "available_node_types": {"ray.head.default": head, **workers},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class LocalCluster:
    """A Ray cluster of several nodes on this machine, started with `ray start` as on real machines.

    With an `autoscaling_config`, pass `worker_nodes=0`: the autoscaler adds the nodes the tasks ask for.
    """

    def __init__(self, worker_nodes: int = 2, cpus_per_worker_node: int = 2, head_cpus: int = 0,
                 token_auth: bool = True, autoscaling_config: dict | None = None,
                 gpus_per_worker_node: int | None = 0) -> None:
        self.worker_nodes = worker_nodes
        self.cpus_per_worker_node = cpus_per_worker_node
        #: 0 by default: several nodes on one machine would each claim every GPU. None: Ray detects them.
        self.gpus_per_worker_node = gpus_per_worker_node
        self.head_cpus = head_cpus
        self.token_auth = token_auth
        self.autoscaling_config = autoscaling_config
        #: The GCS address, "<node ip>:<port>": what a driver sets as RAY_ADDRESS.
        self.address = ""
        #: The dashboard (and the Jobs API), on loopback only.
        self.dashboard_url = ""
        #: The token every node and driver must send, when `token_auth`.
        self.token: str | None = None
        #: The shell commands `start()` ran, in order; `ray` is this environment's CLI, the token stays in its file.
        self.commands: list[str] = []
        #: The cluster's private temp dir: sessions, logs, sockets, the token file.
        self.temp_dir: Path | None = None
        self._env: dict[str, str] = {}

    def start(self) -> LocalCluster:
        """Start the head node, then the worker nodes; on any failure, stop what started and raise RuntimeError."""
        if self.temp_dir is not None:
            raise RuntimeError(f"This cluster is already running (temp dir {self.temp_dir}).")
        # Short on purpose: Ray's socket paths live under it, and Unix sockets allow about 100 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
        atexit.register(self.stop)
        try:
            self._start_head()
            for _ in range(self.worker_nodes):
                # Each node's agent needs a port of its own; with the default, 52365, only the first would get it.
                gpus = [] if self.gpus_per_worker_node is None else [f"--num-gpus={self.gpus_per_worker_node}"]
                self._ray_start(f"--address={self.address}", f"--num-cpus={self.cpus_per_worker_node}", *gpus,
                                "--dashboard-agent-listen-port=0", f"--temp-dir={self.temp_dir}")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_head(self) -> None:
        """Write the token (and the autoscaling config), then `ray start --head` on free ports."""
        assert self.temp_dir is not None
        gcs_port, dashboard_port, client_port = free_ports(3)
        # The address `ray start --head` advertises: it calls the same function (the first IP, not 127.0.0.1).
        self.address = host_port_address(get_node_ip_address(), gcs_port)
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
        # Nor the course's settings (COURSE_*): a real cluster's nodes never see them; drivers and jobs hand them over.
        self._env = {name: value for name, value in os.environ.items()
                     if name not in INHERITED_RAY_VARS and not name.startswith("COURSE_")}
        # As in an activated virtual environment: a job's entrypoint `python` is then this environment's Python.
        self._env["PATH"] = os.pathsep.join([str(RAY_CLI.parent), self._env.get("PATH", os.defpath)])
        if self.token_auth:
            self.token = secrets.token_hex(32)  # what `ray get-auth-token --generate` makes: 256 random bits
            token_file = self.temp_dir / "auth_token"  # self.token_file, now that the token is set
            _write_private(token_file, self.token)
            # Every process of the cluster inherits these from its `ray start`, and the nodes the autoscaler adds
            # inherit them from the autoscaler; ~/.ray/auth_token, which a local `ray.init()` uses, stays untouched.
            self._env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
        else:
            self._env.update(RAY_AUTH_MODE="disabled")
        head_env: dict[str, str] = {}
        # Every port with a fixed default is set: to a free port, or to 0 (the OS picks one) for the agent's.
        # The head runs no training: no GPU either (Ray would detect the machine's GPUs on every node it starts).
        options = [f"--num-cpus={self.head_cpus}", "--num-gpus=0", f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
                   f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={client_port}",
                   "--dashboard-agent-listen-port=0", f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
        if self.autoscaling_config is not None:
            config = json.loads(json.dumps(self.autoscaling_config))
            # The fake provider starts its nodes against <node ip>:6379 unless told the GCS address.
            config["provider"].setdefault("gcs_address", self.address)
            config_file = self.temp_dir / "autoscaling_config.json"
            config_file.write_text(json.dumps(config, indent=2))
            head_env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
            options.append(f"--autoscaling-config={config_file}")
        self._ray_start("--head", *options, extra_env=head_env)
        # `ray start` records the address it advertises; a mismatch would send drivers (and the fake provider's
        # nodes) elsewhere.
        recorded = (self.temp_dir / "ray_current_cluster").read_text().strip()
        if recorded != self.address:
            raise RuntimeError(f"The head advertises {recorded}, not {self.address}.")

    def _ray_start(self, *options: str, extra_env: dict[str, str] | None = None) -> None:
        """Run one `ray start` (it returns once the node is up) and record it in `commands`."""
        extra_env = extra_env or {}
        shown_env: dict[str, str] = {name: self._env[name] for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
                                     if name in self._env}
        shown_env.update(extra_env)
        self.commands.append(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown_env.items()),
                                       "ray", "start", *map(shlex.quote, options)]))
        try:
            # A session of its own: Ctrl-C in the terminal of the test run does not reach the nodes; stop() does.
            done = subprocess.run([str(RAY_CLI), "start", *options], env={**self._env, **extra_env},
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=START_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired as error:
            # TimeoutExpired carries the output as bytes, even with text=True.
            output = b"".join(part for part in (error.stdout, error.stderr) if part).decode(errors="replace")
            raise RuntimeError(f"`{self.commands[-1]}` did not return within {START_TIMEOUT_S} s:\n"
                               f"{output[-3000:]}") from None
        if done.returncode != 0:
            raise RuntimeError(f"`{self.commands[-1]}` failed (exit code {done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")

    @property
    def token_file(self) -> Path | None:
        """The file holding the cluster's token (readable by this user only), when `token_auth`."""
        return self.temp_dir / "auth_token" if self.token and self.temp_dir else None

    def driver_env(self) -> dict[str, str]:
        """The variables a driver process needs to join: RAY_ADDRESS, and RAY_AUTH_TOKEN when `token_auth`.

        Ray sends the token only when the driver also has RAY_AUTH_MODE=token; the course's `setup()` sets that.
        """
        if not self.address:
            raise RuntimeError("The cluster is not running: call start() first.")
        return {"RAY_ADDRESS": self.address, **({"RAY_AUTH_TOKEN": self.token} if self.token else {})}

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: those naming its temp dir or its GCS address, and all their descendants.

        The GCS, raylets, dashboard, autoscaler and log monitors name the temp dir in their arguments; the Ray
        Client server names only the GCS address; the agents and workers name neither (Ray replaces their process
        titles, e.g. "ray::IDLE"), but they are children of a raylet. The nodes the fake provider adds get the
        head's temp dir, and they are children of the autoscaler.
        """
        if self.temp_dir is None:
            return []
        marks = [re.escape(str(self.temp_dir)) + r"(?![\w.-])"]
        if self.address:
            marks.append(r"(?<![\w.])" + re.escape(self.address) + r"(?!\d)")
        return processes_naming(re.compile("|".join(marks)))

    def stop(self) -> None:
        """Stop this cluster's processes (not any other Ray on the machine) and delete its temp dir; idempotent."""
        if self.temp_dir is None:
            return
        atexit.unregister(self.stop)
        roles = {proc: _role(proc) for proc in self.processes()}
        # The autoscaler first, so that it adds no node while the others stop; then `ray stop`'s order: the raylets
        # (their workers and agents follow them), everything else, and the GCS last, which the others report to.
        for stage in ("autoscaler", "raylet", "other", "gcs_server"):
            end_processes([proc for proc, role in roles.items() if role == stage], STOP_GRACE_S)
        # Anything started meanwhile (a worker, a node the autoscaler was adding) gets no grace period.
        end_processes(self.processes(), grace_s=0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.temp_dir = None
        self.address = self.dashboard_url = ""

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


def _write_private(path: Path, text: str) -> None:
    """Write `text` to a new file that only this user can read (mode 0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def _role(proc: psutil.Process) -> str:
    """Which part of a Ray node `proc` is: "autoscaler", "raylet", "gcs_server", or "other"."""
    try:
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if name in ("raylet", "gcs_server"):
        return name
    return "autoscaler" if re.search(r"autoscaler\S*[/\\]monitor\.py", cmdline) else "other"

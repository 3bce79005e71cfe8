"""helpers.setup(): starts Ray once, prints the effective settings, ships helpers to workers."""

from __future__ import annotations

import inspect
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

import pytest
import ray

from helpers import load_config, setup
from helpers.cluster import plan_workers
from helpers.config import REPO_ROOT
from helpers.session import JOBS_AGENT_OFF, JOBS_AGENT_PORT, PREEMPTION_WATCHER_VAR, dashboard_get, name_this_cluster
from helpers.system import wait_until
from helpers.tooling import ray_internals

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


@pytest.fixture(scope="module")
def ray_setup(no_ray):
    with patch.dict(os.environ):  # setup() sets variables: the environment as it was, afterwards
        os.environ.pop(PREEMPTION_WATCHER_VAR, None)  # as on a fresh machine
        yield
        ray.shutdown()


def ray_sessions() -> set[Path]:
    """The session folders of the local Rays started on this machine (under Ray's temp root)."""
    return set(Path(ray_internals.recorded_cluster_file()).parent.glob("session_2*"))


@contextmanager
def connection_from_port_until_an_agent_fails(port: int) -> Iterator[None]:
    """A TCP connection from 127.0.0.1:`port`, as any client's ephemeral port can be, held until a Ray started
    meanwhile says its dashboard agent could not listen on `port` (-1 in the session folder)."""
    before = ray_sessions()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), source_address=("127.0.0.1", port))
    peer, _ = server.accept()

    def failed() -> bool:
        return any(path.read_text().strip() == "-1" for session in ray_sessions() - before
                   for path in session.glob("dashboard_agent_listen_port_*"))

    def release() -> None:
        try:
            wait_until(failed, 120, 0.2, what="the agent failing to bind")
        finally:
            for sock in (peer, client, server):  # the peer first: its side, not the port, waits out TIME_WAIT
                sock.close()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        yield
    finally:
        releaser.join()


def test_setup_starts_ray_prints_the_settings_and_survives_a_rerun(ray_setup, capsys):
    # A connection holds the Jobs API's port as Ray starts, as one did in a CI run: the agent cannot listen there
    # (the Jobs API is off), and setup() starts the local Ray once more, when the port is free again.
    before = ray_sessions()
    with connection_from_port_until_an_agent_fails(JOBS_AGENT_PORT):
        cfg = setup()
    assert len(ray_sessions() - before) == 2 and ray_internals.jobs_agent_port() == JOBS_AGENT_PORT
    first = capsys.readouterr().out
    assert JOBS_AGENT_OFF not in first
    for key in ("mode", "device", "data dir", "storage path", "workers", "Ray", "cluster", "dashboard", "token auth",
                "torch"):
        assert f"\n{key}" in f"\n{first}", f"setup() should print {key!r}"
    assert "started a local Ray" in first
    assert "http://127.0.0.1:" in first, "the dashboard must listen on loopback"
    assert "token auth   : on: Ray requires its token" in first
    # How many workers it chose, and why: the plan that lessons 02-06 and the scripts use.
    plan = plan_workers(load_config())
    assert f"workers      : {plan.describe()}" in first and cfg.num_workers == plan.num_workers
    # The CPUs each worker gets, for lesson 02's typed ScalingConfig; the override variable stays unset.
    assert cfg.worker_cpus == plan.resources_per_worker["CPU"] and cfg.cpus_per_worker == load_config().cpus_per_worker
    assert f"cluster      : {ray.cluster_resources()['CPU']:g} CPUs" in first
    assert cfg.use_gpu in (True, False), "setup() resolves use_gpu='auto' against the cluster"
    assert cfg.use_gpu == (ray.cluster_resources().get("GPU", 0) > 0)
    # A local Ray is one machine: Ray Train's preemption watcher is off (every fit() reads this variable).
    assert os.environ[PREEMPTION_WATCHER_VAR] == "0"

    again = setup()
    assert "already running in this kernel: reused" in capsys.readouterr().out
    assert again == cfg


def test_workers_get_helpers_and_the_settings_through_the_runtime_env(ray_setup):
    cfg = setup()

    @ray.remote
    def inside_a_worker() -> tuple[list[str], dict]:
        import ray.data  # noqa: F401  (configures Ray Data's logger, at RAY_DATA_LOG_LEVEL)

        import helpers.config  # noqa: F401  (imports on the worker)

        py_modules = ray.get_runtime_context().runtime_env.get("py_modules", [])
        env = {k: v for k, v in os.environ.items() if k.startswith(("COURSE_", "PYTHONWARNINGS"))}
        levels = [logging.getLogger(name).level for name in ("ray.data", ray_internals.ray_train_report_logger())]
        switches = os.environ.get("RAY_TRAIN_ENABLE_PRINT_PATCH"), os.environ.get("KINETO_LOG_LEVEL")
        return py_modules, env, levels, *switches

    py_modules, env, levels, print_patch, kineto_level = ray.get(inside_a_worker.remote())
    # Ray Data's info lines (one per dataset pass) and Ray Train's line per report stay out of the notebook.
    assert levels == [logging.WARNING, logging.WARNING]
    assert print_patch == "0", "with Ray Train's print patch, a print in the loop reaches the notebook twice"
    assert kineto_level == "6", "torch.profiler's library logs every start and stop to the notebook"
    # Ray's own deprecation warning about what Ray Train sets itself is filtered in every worker.
    assert "ignore:`ExecutionOptions.exclude_resources` is deprecated" in env.pop("PYTHONWARNINGS")
    # The package travels as an uploaded archive, so it imports on nodes without this checkout.
    assert len(py_modules) == 1 and py_modules[0].startswith("gcs://_ray_pkg_"), py_modules
    # Workers see the settings as the environment gave them (use_gpu may still be 'auto' there).
    expected = load_config().as_env()
    assert {name: env.get(name) for name in expected} == expected
    assert env["COURSE_DATA_DIR"] == str(cfg.data_dir) and env["COURSE_STORAGE_PATH"] == str(cfg.storage_path)


def test_the_dashboard_answers_only_with_rays_token(ray_setup):
    setup()
    assert dashboard_get("/api/v0/actors", token=False)[0] == 401
    status, body = dashboard_get("/api/v0/actors")
    assert status == 200 and body["result"] is True


def test_setup_drops_ray_datas_cpu_warning_only_when_cpus_come_back(ray_setup, caplog):
    """Ray Data (ray/data/dataset.py, logger "ray.data.dataset") warns that a dataset "will hang" when it starts with no
    free CPU. setup() drops that message when a CPU is free again within seconds (a finished fit() handing its CPUs
    back), and lets it through while the CPUs stay taken; other messages pass."""
    import ray.data.dataset as dataset_module
    from ray.util.placement_group import placement_group, remove_placement_group

    from helpers.session import CPU_RACE_WAIT_S

    setup()
    assert dataset_module.logger.name == "ray.data.dataset"
    assert "currently does not have any " in inspect.getsource(dataset_module)
    message = ("Warning: The Ray cluster currently does not have any available CPUs. The Dataset job will hang unless "
               "more CPUs are freed up.")
    with caplog.at_level(logging.WARNING, logger="ray.data.dataset"):
        dataset_module.logger.warning(message)  # CPUs free: dropped
        dataset_module.logger.warning("some other warning")
        every_cpu = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
        ray.get(every_cpu.ready(), timeout=30)
        try:
            started = time.monotonic()
            dataset_module.logger.warning(message)  # every CPU taken: a real shortage, kept
            waited = time.monotonic() - started
        finally:
            remove_placement_group(every_cpu)
    assert [record.getMessage() for record in caplog.records] == ["some other warning", message]
    assert CPU_RACE_WAIT_S <= waited < 2 * CPU_RACE_WAIT_S, "it waits CPU_RACE_WAIT_S, then stops waiting"


def test_workers_know_their_cluster_and_keep_the_routine_cleanup_warning_out(ray_setup):
    setup()

    @ray.remote
    def inside_a_worker() -> tuple[str | None, list[bool], str]:
        cleaner = logging.getLogger(ray_internals.TRAIN_PLACEMENT_GROUP_CLEANER_LOGGER)

        def kept(message: str) -> bool:
            return bool(cleaner.filter(logging.LogRecord(cleaner.name, logging.WARNING, "", 0, message, None, None)))

        routine = f"{ray_internals.TRAIN_PLACEMENT_GROUP_CLEANUP} (abc) is dead. Cleaning up placement group = [x]"
        return (os.environ.get("RAY_ADDRESS"), [kept(routine), kept("Failed to clean up placement group: x")],
                os.environ.get("PYTHONWARNINGS", ""))

    address, kept, warning_filters = ray.get(inside_a_worker.remote())
    # Ray's State API, which Ray Train's placement group cleaner uses, finds this cluster even beside another Ray.
    assert address == ray.get_runtime_context().gcs_address
    assert kept == [False, True], "only the routine cleanup leaves the notebook; a failed one reaches it"
    assert "ignore:The given NumPy array is not writable:UserWarning" in warning_filters


def test_a_worker_that_inherits_ray_address_local_names_its_cluster_instead(ray_setup, monkeypatch):
    # A kernel started with RAY_ADDRESS=local (a local Ray beside a dead recorded cluster) hands the word to its
    # workers; Ray's State API there would look the cluster up again, by the machine's GCS processes.
    setup()
    for word in ("local", "auto"):
        monkeypatch.setenv("RAY_ADDRESS", word)
        name_this_cluster()
        assert os.environ["RAY_ADDRESS"] == ray.get_runtime_context().gcs_address
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    name_this_cluster()
    assert os.environ["RAY_ADDRESS"] == "10.0.0.5:6379", "an address someone set stays"


def test_a_second_local_ray_says_its_jobs_api_is_off(ray_setup):
    # This module's Ray listens on port 52365 with its dashboard agent, the port of every local Ray's agent, which
    # the Jobs API needs. A second local Ray on the machine (another kernel's) starts once, and says so.
    # (A job submitted to it then fails with "No available agent to submit job", after the 10 s the dashboard waits
    # for the agent: dashboard/modules/job/job_head.py, as lesson 09's submission did in CI.)
    setup()
    assert ray_internals.jobs_agent_port() == JOBS_AGENT_PORT
    before = ray_sessions()
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", "from helpers import setup\nsetup()\n"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert JOBS_AGENT_OFF in done.stdout, done.stdout
    assert len(ray_sessions() - before) == 1, "started again, though another Ray's agent holds the port"

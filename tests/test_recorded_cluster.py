"""A cluster that `ray start` recorded on this machine and that has died since must not hang the course.

`ray start --head` writes its address to `$RAY_TMPDIR/ray/ray_current_cluster` (/tmp/ray/... by default) and only
`ray stop` deletes it; a plain `ray.init()` joins that address and, when nothing answers there, waits without end.
`helpers.session.ray_target` asks the recorded GCS first: a dead one is passed over with one line, a live one is
joined as a cluster (tests/test_multinode.py joins a real one). Every test here points RAY_TMPDIR at a private folder:
the machine's own /tmp/ray/ray_current_cluster, which other Rays may use, is never read or written.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT, ConfigError, load_config
from helpers.session import PREEMPTION_WATCHER_VAR, RECORDED_CLUSTER_TIMEOUT_S, RayTarget, ray_target, start_ray
from helpers.system import free_ports
from helpers.tooling import ray_internals
from helpers.tooling.scripts import parse_streaming_args
from tests.support import RAY_START_THEN_FAILS_S


@pytest.fixture
def ray_tmpdir(monkeypatch) -> Iterator[Path]:
    """A private RAY_TMPDIR for this test (short: Ray's socket paths live under it), with its `ray` folder."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    (folder / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def record(ray_tmpdir: Path, address: str) -> Path:
    """Write `address` where `ray start` records its cluster under `ray_tmpdir`; return the file."""
    file = ray_tmpdir / "ray" / "ray_current_cluster"
    file.write_text(address)
    return file


def dead_address() -> str:
    """127.0.0.1 and a port that was free a moment ago: nothing listens there."""
    return f"127.0.0.1:{free_ports(host='127.0.0.1')[0]}"


def passed_over_line(file: Path, address: str, why: str) -> str:
    """The one line `start_ray` prints when it passes over the dead cluster at `address` recorded in `file`."""
    return (f"Ray: {file} names the cluster {address}, which does not answer ({why}), so a local Ray starts instead. "
            f"That file is left over from a Ray that ended without `ray stop`: delete it (rm {file}), or set "
            "RAY_ADDRESS=local to always start a local Ray (`ray stop` deletes it too, but stops every Ray on this "
            "machine).")


def test_the_recorded_file_is_the_one_ray_init_reads(ray_tmpdir):
    assert ray_internals.recorded_cluster_file() == str(ray_tmpdir / "ray" / "ray_current_cluster")
    assert ray_internals.recorded_cluster_address() is None
    record(ray_tmpdir, "10.0.0.5:6379\n")
    assert ray_internals.recorded_cluster_address() == "10.0.0.5:6379"
    assert ray_internals.gcs_host_port("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert ray_internals.gcs_host_port(ray_internals.gcs_address("::1", 6379)) == ("::1", 6379)
    assert ray_internals.gcs_host_port("10.0.0.5") is None and ray_internals.gcs_host_port("") is None


def test_a_recorded_cluster_that_does_not_answer_is_passed_over_at_once(ray_tmpdir):
    address = dead_address()
    file = record(ray_tmpdir, address)
    started = time.monotonic()
    target = ray_target(load_config({}))
    assert time.monotonic() - started < RECORDED_CLUSTER_TIMEOUT_S, "a refused connection needs no waiting"
    assert target == RayTarget(None, passed_over=passed_over_line(file, address, "connection refused"))
    assert file.read_text() == address, "the file is the learner's to delete"


#: The time-out the test gives the probe: well below the default, RECORDED_CLUSTER_TIMEOUT_S, which it must not wait.
PROBE_TIMEOUT_S = 0.5


def test_a_recorded_host_that_never_answers_is_passed_over_within_the_timeout(ray_tmpdir):
    # 192.0.2.1 (TEST-NET-1) is never assigned: the connection times out, or fails at once without a route.
    record(ray_tmpdir, "192.0.2.1:6379")
    started = time.monotonic()
    target = ray_target(load_config({}), timeout_s=PROBE_TIMEOUT_S)
    assert time.monotonic() - started < PROBE_TIMEOUT_S + 1, "the probe waited longer than it was told"
    assert target.address is None and "names the cluster 192.0.2.1:6379, which does not answer" in target.passed_over


def test_a_recorded_file_without_an_address_is_passed_over(ray_tmpdir):
    file = record(ray_tmpdir, "")
    assert ray_target(load_config({})) == RayTarget(None, passed_over=passed_over_line(file, "",
                                                                                      "not a host:port address"))


def test_a_recorded_cluster_that_answers_is_joined(ray_tmpdir):
    with socket.create_server(("127.0.0.1", 0)) as listening:
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        file = record(ray_tmpdir, address)
        assert ray_target(load_config({})) == RayTarget(address, named_by=str(file))


def test_ray_address_decides_before_the_recorded_file(ray_tmpdir):
    assert ray_target(load_config({})) == RayTarget(None), "no file, no RAY_ADDRESS: a local Ray, as before"
    with socket.create_server(("127.0.0.1", 0)) as listening:
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        record(ray_tmpdir, live)
        assert ray_target(load_config({"RAY_ADDRESS": "10.0.0.5:6379"})) == RayTarget("10.0.0.5:6379", "RAY_ADDRESS")
        assert ray_target(load_config({"RAY_ADDRESS": "local"})) == RayTarget(None), "local: never the recorded one"
        assert ray_target(load_config({"RAY_ADDRESS": "auto"})) == RayTarget("auto", "RAY_ADDRESS")
    dead = dead_address()
    file = record(ray_tmpdir, dead)
    assert ray_target(load_config({"RAY_ADDRESS": "local"})) == RayTarget(None)  # and nothing printed about it
    with pytest.raises(ConfigError, match=f"RAY_ADDRESS=auto joins the cluster that `ray start` recorded in {file}, "
                                          f"{dead}, but it does not answer"):
        ray_target(load_config({"RAY_ADDRESS": "auto"}))


@pytest.mark.timeout(30)  # were it not refused, ray.init() in this process would wait on a socket that is no GCS
def test_an_object_store_size_is_refused_where_the_recorded_cluster_would_be_joined(ray_tmpdir):
    # Ray's own refusal ("When connecting to an existing cluster, object_store_memory must not be provided") would
    # name neither the recorded cluster nor the fix; the course refuses before Ray starts.
    with socket.create_server(("127.0.0.1", 0)) as listening:
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        file = record(ray_tmpdir, address)
        with pytest.raises(ConfigError, match=f"Ray joins the cluster that `ray start` recorded in {file}, {address}, "
                                              ".* set RAY_ADDRESS=local to start a local Ray"):
            start_ray(load_config({}), object_store_memory=256 * 2**20)


def test_ray_address_local_lets_a_script_size_its_object_store(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a local Ray: the script's object store is the one it starts
    assert parse_streaming_args("x", ["--object-store-mib", "256"]).object_store_mib == 256


#: setup() as a notebook's first cell runs it, then what it decided (the course's settings in the environment).
SETUP_DRIVER = f"""
import os
from helpers import setup

cfg = setup()
print("ray_address:", cfg.ray_address, "preemption watcher:", os.environ.get({PREEMPTION_WATCHER_VAR!r}))
"""
#: The cheapest run of a course script that starts Ray: it refuses 64 workers once it has seen the cluster.
SCRIPT = [str(REPO_ROOT / "notebooks" / "train_ray_ddp.py"), "--num-workers", "64", "--smoke-test"]
#: The most a run may take: tests.support's bound for a process that starts Ray and then refuses (or, for setup(),
#: gets going). Without the check, both would wait for the dead cluster without end.
BOUND_S = RAY_START_THEN_FAILS_S


@pytest.fixture(scope="module")
def runs_beside_a_dead_cluster(tmp_path_factory) -> Iterator[dict]:
    """setup() and a script, side by side, each in its own process with a dead cluster recorded in its RAY_TMPDIR:
    their outcome and wall time, the recorded file and the dead address."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    (folder / "ray").mkdir()
    address = dead_address()
    file = record(folder, address)
    env = {name: value for name, value in os.environ.items() if name not in ("RAY_ADDRESS", PREEMPTION_WATCHER_VAR)}
    env.update(RAY_TMPDIR=str(folder), PYTHONUNBUFFERED="1")
    commands = {"setup": ["-c", SETUP_DRIVER],
                "script": [*SCRIPT, "--storage-path", str(tmp_path_factory.mktemp("storage"))]}
    started = time.monotonic()
    runs = {name: subprocess.Popen([sys.executable, *args], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name, args in commands.items()}
    done = {}
    try:
        for name, run in runs.items():
            try:
                stdout, stderr = run.communicate(timeout=max(1.0, started + BOUND_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                run.kill()  # the hang this module is about: its output so far goes into the failure
                stdout, stderr = run.communicate()
            done[name] = (subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr),
                          time.monotonic() - started)
        yield {"runs": done, "file": file, "address": address}
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.ray  # starts a local Ray in a subprocess
def test_setup_beside_a_dead_recorded_cluster_starts_a_local_ray_and_says_so(runs_beside_a_dead_cluster):
    found = runs_beside_a_dead_cluster
    done, wall_s = found["runs"]["setup"]
    assert done.returncode == 0, f"after {wall_s:.0f} s:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert wall_s < BOUND_S
    lines = done.stdout.splitlines()
    assert lines[0] == passed_over_line(found["file"], found["address"], "connection refused")
    assert any(line.startswith("Ray          : ") and ", started a local Ray in " in line for line in lines), lines
    # A local Ray, as without the file: Ray Train's preemption watcher off, cfg.ray_address None.
    assert lines[-1] == "ray_address: None preemption watcher: 0"
    assert found["file"].read_text() == found["address"]


@pytest.mark.ray  # starts a local Ray in a subprocess
def test_a_script_beside_a_dead_recorded_cluster_starts_a_local_ray_and_says_so(runs_beside_a_dead_cluster):
    found = runs_beside_a_dead_cluster
    done, wall_s = found["runs"]["script"]
    assert wall_s < BOUND_S, f"after {wall_s:.0f} s:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.splitlines()[0] == passed_over_line(found["file"], found["address"], "connection refused")
    # It got as far as asking the local Ray for 64 workers, and refused them with the course's error.
    assert done.returncode != 0 and "error: This run can never start: it asks for 64 workers" in done.stderr
    assert "Traceback" not in done.stderr

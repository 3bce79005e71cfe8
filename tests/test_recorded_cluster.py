"""A cluster that `ray start` recorded on this machine and that has died since must not hang the course.

`ray start --head` writes its address to `$RAY_TMPDIR/ray/ray_current_cluster` (/tmp/ray/... by default) and only
Ray's own stop command deletes it; a plain `ray.init()` joins that address and, when nothing answers there, waits
without end.
`helpers.session.ray_target` asks the recorded GCS first: a dead one is passed over with one line, a live one is
joined as a cluster (tests/test_multinode.py joins a real one). Every test here points RAY_TMPDIR at a private folder:
the machine's own /tmp/ray/ray_current_cluster, which other Rays may use, is never read or written.

The tests that start a local Ray beside a dead recorded cluster: tests/test_recorded_cluster_ray.py.
"""

from __future__ import annotations

import socket
import time

import pytest

from helpers.config import ConfigError, load_config
from helpers.session import RECORDED_CLUSTER_TIMEOUT_S, RayTarget, ray_target, start_ray
from helpers.tooling import ray_internals
from helpers.tooling.scripts import parse_streaming_args
from tests.support import dead_address, passed_over_line, record


def test_the_recorded_file_is_the_one_ray_init_reads(ray_tmpdir):
    assert ray_internals.recorded_cluster_file() == str(ray_tmpdir / "ray" / "ray_current_cluster")
    assert ray_internals.recorded_cluster_address() is None
    record(ray_tmpdir, "10.0.0.5:6379\n")
    assert ray_internals.recorded_cluster_address() == "10.0.0.5:6379"
    assert ray_internals.gcs_host_port("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert ray_internals.gcs_host_port(ray_internals.host_port_address("::1", 6379)) == ("::1", 6379)
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

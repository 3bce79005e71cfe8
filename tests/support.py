"""What several test modules share that is not a fixture: bounds on wall-clock time, the environment of a driver
that joins a test's own cluster, and checks that a test's own processes are gone. (Test modules import from here,
never from each other.)

Every process check here looks only at the processes of the test's own cluster or session: processes it listed
before they stopped, or processes whose command line names its own temp dir or GCS address. Another test session
on the same machine, or a learner's Ray beside the suite, is never looked at.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import psutil

from helpers.tooling.local_cluster import LocalCluster

#: The bound on "fails fast": a check that refuses, or reports an error, without waiting for anything slow. The slow
#: paths these tests guard against take longer: a download's time-outs and retries (minutes), a run that waits for
#: resources that never come (Ray Train's 60 s worker-group time-out, or forever), a Ray Train fit (20-30 s from its
#: start to its first report on the 2-core CI machine). The checks themselves take well under 1 s on an idle
#: machine; the bound is that generous so that a machine shared with another test run, or with a learner's training,
#: does not fail them. One bound for all: a test whose own limit is the behaviour under test names that limit.
FAILS_FAST_S = 20.0

#: The same for a process that starts a local Ray first and then refuses its run: Ray's start-up (about 15 s here, up
#: to 60 s with three started side by side on a loaded 2-core machine) plus the check. Without the check, such a run
#: would wait for its resources without end.
RAY_START_THEN_FAILS_S = 120.0

#: The Ray variables that send a driver to a cluster: a test's driver starts without them, then gets its own cluster's.
RAY_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without any Ray address or token setting, plus `variables`."""
    env = {name: value for name, value in os.environ.items() if name not in RAY_VARS}
    return {**env, **variables}


def running(proc: psutil.Process) -> bool:
    """Whether `proc` still runs; a zombie does not."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running_processes_naming(temp_dir: Path, address: str) -> list[str]:
    """Command lines of the running processes that name this cluster's `temp_dir` or GCS `address` (whole: not
    another cluster's /tmp/rc-abc1 for /tmp/rc-abc, nor port 63790 for 6379)."""
    marks = [re.escape(str(temp_dir)) + r"(?![\w.-])", r"(?<![\w.])" + re.escape(address) + r"(?!\d)"]
    names_cluster = re.compile("|".join(marks))
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] != psutil.STATUS_ZOMBIE and names_cluster.search(cmdline):
            found.append(cmdline[:160])
    return found


def assert_stopped(processes: list[psutil.Process], temp_dir: Path, address: str) -> None:
    """Nothing of a stopped cluster is left: none of its `processes` (listed before stop(): they include the agents,
    workers and job drivers, which name neither its temp dir nor its address), no process naming its temp dir or GCS
    address, and no temp dir."""
    assert processes, "the cluster had no processes to stop"
    assert [proc for proc in processes if running(proc)] == []
    assert running_processes_naming(temp_dir, address) == []
    assert not temp_dir.exists()


@contextlib.contextmanager
def stopped_after(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Start `cluster`, yield it, and afterwards stop it and check that nothing of it is left (`assert_stopped`): its
    processes, listed just before it stops, include the drivers of jobs still running (children of its workers)."""
    cluster.start()
    temp_dir, address = cluster.temp_dir, cluster.address
    assert temp_dir is not None
    try:
        yield cluster
    finally:
        processes = cluster.processes()
        cluster.stop()
    assert_stopped(processes, temp_dir, address)

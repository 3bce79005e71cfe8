"""A pytest plugin, registered by the root conftest.py: the suite must not leave Ray, kernels or JupyterLab running.

At the start of the session it puts a fresh id in the environment (COURSE_TEST_SESSION); every process the suite
starts inherits it: Ray's head and worker processes, `ray start` nodes, notebook kernels, JupyterLab. At the end it
waits up to 30 s for those processes to exit, then kills what is left and fails the session, listing them. Processes
of another test session running on the same machine carry another id and are left alone.
"""

from __future__ import annotations

import os
import time
import uuid

import psutil
import pytest

#: The environment variable that marks the processes this session started.
SESSION_VARIABLE = "COURSE_TEST_SESSION"

#: Command-line fragments of the processes the suite may start (Ray's head and workers, kernels, JupyterLab).
WATCHED = ("raylet", "gcs_server", "ipykernel_launcher", "jupyter-lab", "jupyterlab", "default_worker.py")


def started_by(session_id: str) -> dict[int, str]:
    """The watched processes whose environment carries `session_id`: pid -> the start of their command line."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if not any(fragment in cmdline for fragment in WATCHED):
            continue
        try:
            if proc.environ().get(SESSION_VARIABLE) == session_id:
                found[proc.info["pid"]] = cmdline[:160]
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[SESSION_VARIABLE] = uuid.uuid4().hex


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session_id = os.environ[SESSION_VARIABLE]
    deadline = time.monotonic() + 30  # Ray and kernels take a few seconds to exit
    while (leftovers := started_by(session_id)) and time.monotonic() < deadline:
        time.sleep(1)
    if leftovers:
        print("\nProcesses started by the test suite are still running (now killed):")
        for pid, cmd in leftovers.items():
            print(f"  {pid}: {cmd}")
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

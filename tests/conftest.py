"""Suite-wide settings and a guard: the suite must not leave Ray, kernels or JupyterLab running."""

from __future__ import annotations

import time

import matplotlib
import psutil
import pytest

# Figures made by the unit tests render off-screen. (Not through MPLBACKEND: the notebooks'
# kernels inherit the environment and must keep Jupyter's inline backend.)
matplotlib.use("Agg")

#: Command-line fragments of the processes the suite may start (Ray's head, kernels, JupyterLab).
WATCHED = ("raylet", "gcs_server", "ipykernel_launcher", "jupyter-lab", "jupyterlab", "default_worker.py")


def _watched_processes() -> dict[int, str]:
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if any(fragment in cmdline for fragment in WATCHED):
            found[proc.info["pid"]] = cmdline[:160]
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._watched_before = set(_watched_processes())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = getattr(session.config, "_watched_before", set())
    deadline = time.monotonic() + 30  # Ray and kernels take a few seconds to exit
    while True:
        leftovers = {pid: cmd for pid, cmd in _watched_processes().items() if pid not in before}
        if not leftovers or time.monotonic() > deadline:
            break
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

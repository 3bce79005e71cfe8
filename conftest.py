"""Suite-wide pytest set-up (notebooks and tests/).

- nbval compares each notebook cell's output with the committed one, except Ray's log lines: those it forwards
  from its other processes (workers, actors, the GCS) arrive whenever those processes write them, in whichever
  cell happens to be running, and they and its C++ core log carry pids, ids and timestamps. Everything else
  the kernel prints, Python warnings and errors included, stays compared.
- A guard: the suite must not leave Ray, kernels or JupyterLab running.
"""

from __future__ import annotations

import re
import time

import matplotlib
import nbformat
import psutil
import pytest
from nbval.plugin import IPyNbCell

#: A line Ray forwarded from another process: "(RayTrainWorker pid=42, ip=10.0.0.2) ...", "(pid=gcs_server) ...",
#: optionally in colour; the note Ray prints under de-duplicated lines; or a line of Ray's C++ core log
#: ("[2026-11-22 13:06:00,208 E 12379 12379] core_worker.cc:2465: ..."), which the kernel's Ray client writes itself.
RAY_LOG_LINE = re.compile(
    r"^(\x1b\[[\d;]*m)?\((\w+ )?pid=\w+(, ip=[\w.:-]+)?\)"
    r"|^\(Ray deduplicates logs by default\."
    r"|^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] \w+\.cc:\d+: "
)


def drop_ray_log_lines(outputs: list) -> list:
    """`outputs` without the lines Ray forwarded from other processes; a stream left empty is dropped."""
    kept = []
    for output in outputs:
        if output.get("output_type") == "stream":
            lines = [line for line in output["text"].splitlines(keepends=True) if not RAY_LOG_LINE.match(line)]
            if not "".join(lines).strip():
                continue
            output = nbformat.from_dict({**output, "text": "".join(lines)})
        kept.append(output)
    return kept


_compare_outputs = IPyNbCell.compare_outputs


def _compare_outputs_without_ray_logs(self, test, ref, skip_compare=None):
    return _compare_outputs(self, drop_ray_log_lines(test), drop_ray_log_lines(ref), skip_compare)


IPyNbCell.compare_outputs = _compare_outputs_without_ray_logs

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

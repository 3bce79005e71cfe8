"""Suite-wide pytest set-up (notebooks and tests/).

- nbval compares each notebook cell's output with the committed one, except Ray's log lines: those it forwards
  from its other processes (workers, actors, the GCS, the raylet) arrive whenever those processes write them, in
  whichever cell happens to be running, and they and its C++ core log carry pids, ids and timestamps. Everything
  else the kernel prints, Python warnings and errors included, stays compared.
- Forwarded lines that report an error still fail the cell, whether or not its output is compared: a Python
  traceback (``Traceback (most recent call last):``), an exception line (``ValueError: ...``,
  ``ray.exceptions.RayTaskError(...): ...``) or one of Ray Train's failure reports (``Error in training
  function:``, ``Training failed due to worker errors``, ``[Rank 1 Error Snippet]:``). nbval then reports
  "Ray reported errors from other processes" and lists the lines. Only the new run's output is checked.
- A cell that causes errors on purpose opts in with a comment line in its source::

      # NBVAL_RAY_ERRORS_EXPECTED: Traceback|InjectedFailure|Training failed due to worker errors

  Every forwarded error line must then match the regex (``re.search``, colour codes and Ray's
  "[repeated Nx across cluster]" note removed); a line that does not still fails the cell. Several such
  lines combine as alternatives. A marker also covers the notebook's later cells: Ray forwards a line whenever
  it reaches the kernel, so an error caused on purpose may arrive while the next cells run.
- Known Ray 2.60 noise passes everywhere: the InterruptedError traceback of Ray Data's file-listing
  "completion-signaler" thread (see RAY_DATA_LISTING_NOISE), printed at random after a listing has finished,
  forwarded from a Ray task or printed by the kernel itself (KERNEL_LISTING_NOISE, left out of the comparison);
  and one line: a SplitCoordinator's "SystemExit" when Ray Train shuts it down (DATA_COORDINATOR_EXIT).
- A guard: the suite must not leave Ray, kernels or JupyterLab running.
- Fixtures shared by test modules (tests/): starting Ray takes about 8 s on the 2-core CI machine and writing MNIST
  as Parquet about 13 s, so the modules that train in this process (test_cluster, test_fault_tolerance,
  test_ingest) share one of each. `course_ray`: the course's `setup()`, run by the first module that asks for it;
  later modules get the same configuration while that Ray is still up. `no_ray`: a module that starts its own Ray
  (with other settings) or its own cluster asks for this instead; it shuts the shared Ray down first; whatever is
  still up at the end of the session is shut down then. `mnist_parquet`: lesson 03's Parquet copy of MNIST in one
  folder for the session, written once (`write_mnist_parquet` finds it complete the next time).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
import nbformat
import psutil
import pytest
import ray
from nbval.plugin import IPyNbCell, NbCellError

if TYPE_CHECKING:
    from helpers import CourseConfig

#: A line Ray forwarded from another process: "(RayTrainWorker pid=42, ip=10.0.0.2) ...", "(pid=gcs_server) ...",
#: "(raylet) ...", "(autoscaler +1m2s) ...", optionally in colour; the note Ray prints under de-duplicated lines;
#: or a line of Ray's C++ core log ("[2026-11-22 13:06:00,208 E 12379 12379] core_worker.cc:2465: ..."), which
#: the kernel's Ray client writes itself.
RAY_LOG_LINE = re.compile(
    r"^(\x1b\[[\d;]*m)?\(((\w+ )?pid=\w+|raylet|autoscaler \+[\w.]+)(, ip=[\w.:-]+)?\)"
    r"|^\(Ray deduplicates logs by default\."
    r"|^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] \w+\.cc:\d+: "
)

#: Colour codes, and the note Ray appends to a line it printed once for several processes.
_DECORATION = re.compile(r"\x1b\[[\d;]*m|\s*\[repeated \d+x across cluster\].*$")

#: The prefix of a forwarded line, up to the message ("(RayTrainWorker pid=42) ", "[... E 1 1] core_worker.cc:9: ").
_PREFIX = re.compile(
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

#: The opt-in marker of a cell that causes errors on purpose.
EXPECTED_MARKER = re.compile(r"^\s*#\s*NBVAL_RAY_ERRORS_EXPECTED:\s*(.+?)\s*$", re.MULTILINE)


def drop_ray_log_lines(outputs: list) -> list:
    """`outputs` without the lines Ray forwarded from other processes and without KERNEL_LISTING_NOISE; a stream
    left empty is dropped."""
    kept = []
    for output in outputs:
        if output.get("output_type") == "stream":
            lines = [line for line in output["text"].splitlines(keepends=True) if not RAY_LOG_LINE.match(line)]
            text = KERNEL_LISTING_NOISE.sub("", "".join(lines))
            if not text.strip():
                continue
            output = nbformat.from_dict({**output, "text": text})
        kept.append(output)
    return kept


def expected_ray_errors(source: str) -> re.Pattern | None:
    """The regex a cell's `# NBVAL_RAY_ERRORS_EXPECTED:` lines allow, or None without such a line."""
    patterns = EXPECTED_MARKER.findall(source)
    return re.compile("|".join(f"(?:{pattern})" for pattern in patterns)) if patterns else None


def ray_error_lines(outputs: list, expected: re.Pattern | None = None) -> list[str]:
    """The forwarded lines in `outputs` that report an error and that `expected` does not allow."""
    found = []
    in_listing_noise = set()  # the processes whose last lines began a RAY_DATA_LISTING_NOISE block
    for output in outputs:
        if output.get("output_type") != "stream":
            continue
        for line in output["text"].splitlines():
            if not RAY_LOG_LINE.match(line):
                continue
            plain = _DECORATION.sub("", line)
            prefix = _PREFIX.match(plain)
            source, message = (prefix.group(0).strip(), plain[prefix.end():]) if prefix else ("", plain)
            if source in in_listing_noise:
                if message == "InterruptedError":  # the block's last line
                    in_listing_noise.discard(source)
                    continue
                if message == "Traceback (most recent call last):" or message.startswith(" "):
                    continue
                in_listing_noise.discard(source)
            if RAY_DATA_LISTING_NOISE.match(message):
                in_listing_noise.add(source)
                continue
            if DATA_COORDINATOR_EXIT.match(plain):
                continue
            if not RAY_ERROR_MESSAGE.search(message):
                continue
            if expected is None or not expected.search(plain):
                found.append(plain)
    return found


def check_ray_errors(cell_num: int, source: str, outputs: list) -> None:
    """Raise nbval's NbCellError when Ray forwarded error lines the cell does not expect."""
    unexpected = ray_error_lines(outputs, expected_ray_errors(source))
    if unexpected:
        hint = (
            "If the cell causes these errors on purpose, allow them with a line "
            "'# NBVAL_RAY_ERRORS_EXPECTED: <regex>' in its source."
        )
        raise NbCellError(
            cell_num,
            f"Ray reported errors from other processes ({len(unexpected)} line(s))",
            source,
            "\n".join(unexpected) + "\n\n" + hint,
        )


_compare_outputs = IPyNbCell.compare_outputs
_runtest = IPyNbCell.runtest


def _compare_outputs_without_ray_logs(self, test, ref, skip_compare=None):
    return _compare_outputs(self, drop_ray_log_lines(test), drop_ray_log_lines(ref), skip_compare)


def _allowed_so_far(self) -> str:
    """This cell's source plus the expected-error markers of the notebook's earlier cells: Ray forwards a line
    whenever it reaches the kernel, so an error a cell causes on purpose may arrive while a later cell runs."""
    markers = getattr(self.parent, "_ray_errors_expected", [])
    markers.extend(EXPECTED_MARKER.findall(self.cell.source))
    self.parent._ray_errors_expected = markers
    return self.cell.source + "".join(f"\n# NBVAL_RAY_ERRORS_EXPECTED: {marker}" for marker in markers)


def _runtest_checking_ray_errors(self):
    # nbval compares only cells whose output is checked; the error check runs for every executed cell.
    allowed = _allowed_so_far(self)
    try:
        _runtest(self)
    except NbCellError as failure:
        check_ray_errors(self.cell_num, allowed, getattr(self, "test_outputs", []))
        raise failure
    check_ray_errors(self.cell_num, allowed, getattr(self, "test_outputs", []))


IPyNbCell.compare_outputs = _compare_outputs_without_ray_logs
IPyNbCell.runtest = _runtest_checking_ray_errors

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


_started: dict[str, CourseConfig] = {}  # the configuration setup() returned, while its Ray is up


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end() -> Iterator[None]:
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def course_ray() -> CourseConfig:
    """setup()'s configuration, with its local Ray up (started here unless a previous module left it running)."""
    if "cfg" not in _started or not ray.is_initialized():
        from helpers import setup

        assert not ray.is_initialized(), "a Ray that setup() did not start is running"
        _started["cfg"] = setup()
    return _started["cfg"]


@pytest.fixture(scope="module")
def no_ray() -> None:
    """No Ray in this process when the module starts."""
    ray.shutdown()
    _started.clear()


@pytest.fixture(scope="session")
def _parquet_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
def mnist_parquet(course_ray: CourseConfig, _parquet_storage: Path) -> str:
    """The root of the Parquet copy of MNIST (train/ and test/), in a folder of this session."""
    from helpers.ingest import write_mnist_parquet

    return write_mnist_parquet(course_ray.data_dir, str(_parquet_storage))

"""The nbval plugin tests/plugins/nbval_ray.py: Ray's forwarded log lines leave the comparison, and those that
report an error fail the cell unless the cell's metadata expects them (`testing.ray_errors_expected`).

The forwarded lines below are copied from the committed outputs of the lessons.

The plugin run through nbval itself: tests/test_nbval_ray_logs_notebook.py.
"""

from __future__ import annotations

import nbformat
import pytest
from nbval.plugin import NbCellError

from helpers.logs import job_output
from tests.plugins.nbval_ray import check_ray_errors, drop_ray_log_lines, expected_errors, ray_error_lines

#: Benign lines, several logged at level E, that must neither be compared nor fail a cell.
BENIGN = (
    "\x1b[36m(TrainController pid=8566)\x1b[0m Requesting resources: {'CPU': 1.0} * 2\n"
    "\x1b[36m(pid=gcs_server)\x1b[0m [2026-11-22 06:46:53,887 E 6758 6758] (gcs_server) gcs_actor_scheduler.cc:234: "
    "Failed to kill actor 0ee5e2dfcc7d, return status: Invalid: KillActor RPC failed for actor 0ee5e2dfcc7d: "
    "RpcError: RPC error: Socket closed\n"
    "(RayTrainWorker pid=42, ip=10.0.0.2) Moving model to device: cuda:0\n"
    "(Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication.)\n"
    "[2026-11-22 13:06:00,208 E 12379 12379] core_worker.cc:2465: Actor with class name: 'MapWorker'\n"
    "\x1b[36m(SplitCoordinator pid=691)\x1b[0m Progress bars disabled. To enable, set "
    "`ray.data.DataContext.get_current().enable_progress_bars = True`.\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m [State Transition] SHUTTING_DOWN -> FINISHED.\n"
    "(raylet) Warning: the lease cannot be scheduled right now.\n"
)

#: A worker's failure as lesson 05 injects it, and the controller's report of it.
WORKER_FAILURE = (
    "\x1b[36m(RayTrainWorker pid=557)\x1b[0m Error in training function:\n"
    "\x1b[36m(RayTrainWorker pid=557)\x1b[0m Traceback (most recent call last):\n"
    '\x1b[36m(RayTrainWorker pid=557)\x1b[0m   File "/tmp/ray/session_x/helpers/fault_tolerance.py", line 68, in '
    "train_loop_per_worker\n"
    '\x1b[36m(RayTrainWorker pid=557)\x1b[0m     raise InjectedFailure(f"rank {rank} fails on purpose")\n'
    "\x1b[36m(RayTrainWorker pid=557)\x1b[0m helpers.fault_tolerance.InjectedFailure: rank 1 fails on purpose at "
    "epoch 1, step 2\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m [FailurePolicy] RETRY\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m   Error count: 1 (max allowed: 1)\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m Error: Training failed due to worker errors:\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m [Rank 1 Error Snippet]:\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m ray.train.WorkerGroupError: Training failed due to worker errors:\n"
    "\x1b[36m(TrainController pid=464)\x1b[0m Traceback (most recent call last):\x1b[32m [repeated 2x across "
    "cluster] (Ray deduplicates logs by default.)\x1b[0m\n"
)

#: A worker's unexpected error (lesson 06's collective timeout).
TIMEOUT = (
    "\x1b[36m(RayTrainWorker pid=5447)\x1b[0m Traceback (most recent call last):\n"
    "\x1b[36m(RayTrainWorker pid=5447)\x1b[0m ray.exceptions.RayTaskError(BroadcastCollectiveTimeoutError): "
    "ray::SynchronizationActor.broadcast_from_rank_zero() (pid=5406, ip=192.0.2.2)\n"
    "\x1b[36m(RayTrainWorker pid=5447)\x1b[0m asyncio.exceptions.CancelledError\n"
    "\x1b[36m(RayTrainWorker pid=5447)\x1b[0m TimeoutError\n"
)

#: A cell's `testing.ray_errors_expected`, as lesson 05's injected failure lists them.
EXPECTS_INJECTED = ["Traceback", "InjectedFailure", "Error in training function",
                    "Training failed due to worker errors", "Error Snippet"]
FIT = "result = trainer.fit()\n"


def _stream(name: str, text: str):
    return nbformat.from_dict({"output_type": "stream", "name": name, "text": text})


def test_lines_forwarded_by_ray_are_dropped_and_empty_streams_go():
    result = nbformat.from_dict({"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}})
    assert drop_ray_log_lines([_stream("stderr", BENIGN + WORKER_FAILURE), result]) == [result]


def test_the_kernels_own_output_is_kept():
    warning = "/x/y.py:3: RayDeprecationWarning: `ExecutionOptions.exclude_resources` is deprecated\n"
    mixed = _stream("stderr", "\x1b[36m(DatasetManager pid=7)\x1b[0m a log line\n" + warning)
    kept = drop_ray_log_lines([mixed, _stream("stdout", "(a parenthesis, pid=3 is not a Ray prefix)\n")])
    assert [output["text"] for output in kept] == [warning, "(a parenthesis, pid=3 is not a Ray prefix)\n"]


def test_benign_forwarded_lines_pass():
    assert ray_error_lines([_stream("stderr", BENIGN)]) == []
    check_ray_errors(3, "trainer.fit()\n", [_stream("stderr", BENIGN)])


def test_a_workers_traceback_fails_the_cell_and_names_the_lines():
    with pytest.raises(NbCellError) as failure:
        check_ray_errors(7, "result = trainer.fit()\n", [_stream("stderr", BENIGN + WORKER_FAILURE)])
    assert failure.value.cell_num == 7
    assert "Ray reported errors from other processes" in str(failure.value)
    report = failure.value.inner_traceback
    assert "(RayTrainWorker pid=557) Traceback (most recent call last):" in report
    assert "helpers.fault_tolerance.InjectedFailure: rank 1" in report
    assert "ray.train.WorkerGroupError: Training failed due to worker errors:" in report
    assert "Requesting resources" not in report and "Error count" not in report


def test_the_kernels_own_error_text_is_not_this_checks_business():
    # Printed by the kernel itself, so compared by nbval as usual; not a forwarded line.
    check_ray_errors(1, "", [_stream("stdout", "ValueError: shown on purpose by the lesson\n")])


def test_expected_errors_pass_with_the_metadata():
    check_ray_errors(9, FIT, [_stream("stderr", BENIGN + WORKER_FAILURE)], EXPECTS_INJECTED)


def test_expecting_another_error_does_not_allow_this_one():
    with pytest.raises(NbCellError) as failure:
        check_ray_errors(9, FIT, [_stream("stderr", WORKER_FAILURE + TIMEOUT)], EXPECTS_INJECTED)
    report = failure.value.inner_traceback
    assert "BroadcastCollectiveTimeoutError" in report and "TimeoutError" in report
    assert "InjectedFailure" not in report  # the expected lines are not reported


def test_the_expected_regexes_must_cover_every_error_line():
    lines = ray_error_lines([_stream("stderr", WORKER_FAILURE)], expected_errors(["InjectedFailure"]))
    assert any("Traceback (most recent call last):" in line for line in lines)
    assert not any("InjectedFailure" in line for line in lines)


def test_a_killed_worker_counts_as_an_error():
    died = "\x1b[33m(raylet)\x1b[0m A worker died or was killed while executing a task by an unexpected system error.\n"
    assert ray_error_lines([_stream("stderr", died)]) == [died.replace("\x1b[33m", "").replace("\x1b[0m", "").rstrip()]


def _listing_noise(pid: int | None, last_line: str = "InterruptedError") -> str:
    """The traceback Ray 2.60's file listing prints when its completion-signaler thread loses its race: forwarded
    from a ListFiles task (`pid`), or printed by the kernel's own process (None)."""
    prefix = "" if pid is None else f"\x1b[36m(ListFiles pid={pid})\x1b[0m "
    lines = [
        "Exception in thread pool-0/completion-signaler:",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner',
        "    self.run()",
        '  File "/x/ray/data/_internal/dynamic_work_queue.py", line 180, in _signal_completion',
        "    pool.work_queue.put(SENTINEL)",
        '  File "/x/ray/data/_internal/util.py", line 1082, in put',
        "    raise InterruptedError()",
        last_line,
    ]
    return "".join(prefix + line + "\n" for line in lines)


def test_the_listings_interrupted_signaler_thread_passes_in_any_cell():
    interleaved = _listing_noise(6283).replace("    self.run()\n", "    self.run()\n" + BENIGN, 1)
    assert ray_error_lines([_stream("stderr", interleaved + BENIGN)]) == []


def test_only_that_block_passes_a_real_error_around_it_still_fails():
    other_exception = _listing_noise(6283, last_line="ValueError: not the known race")
    lines = ray_error_lines([_stream("stderr", other_exception + TIMEOUT)])
    assert "(ListFiles pid=6283) ValueError: not the known race" in lines
    assert any("BroadcastCollectiveTimeoutError" in line for line in lines)
    worker_after_noise = _listing_noise(1) + WORKER_FAILURE
    assert any("InjectedFailure" in line for line in ray_error_lines([_stream("stderr", worker_after_noise)]))


def test_the_block_printed_by_the_kernel_itself_leaves_the_comparison_and_nothing_else_does():
    # Seen in CI: lesson 09's read_parquet listed its files in the kernel, which printed the block to stderr.
    printed = "before\n" + _listing_noise(None) + "after\n"
    assert drop_ray_log_lines([_stream("stderr", printed)]) == [_stream("stderr", "before\nafter\n")]
    assert drop_ray_log_lines([_stream("stderr", _listing_noise(None))]) == []
    # Ray's forwarded lines may land inside the block: they leave, and the block still goes as a whole.
    interleaved = _listing_noise(None).replace("    self.run()\n", "    self.run()\n" + BENIGN, 1)
    assert drop_ray_log_lines([_stream("stderr", interleaved)]) == []
    other = _listing_noise(None, last_line="ValueError: not the known race")
    assert drop_ray_log_lines([_stream("stderr", other)]) == [_stream("stderr", other)]


def test_a_split_coordinator_shut_down_by_ray_train_passes_and_nothing_else_of_its_does():
    # Seen in CI in lesson 05's injected failure, while Ray Train tore the failed worker group's datasets down.
    shut_down = "\x1b[36m(SplitCoordinator pid=1958)\x1b[0m SystemExit: 1\n"
    assert ray_error_lines([_stream("stderr", shut_down + BENIGN)]) == []
    assert ray_error_lines([_stream("stderr", "(SplitCoordinator pid=7, ip=10.0.0.2) SystemExit\n")]) == []
    crashed = "\x1b[36m(SplitCoordinator pid=1958)\x1b[0m ValueError: a real error in the executor\n"
    assert ray_error_lines([_stream("stderr", crashed)]) == [
        "(SplitCoordinator pid=1958) ValueError: a real error in the executor"]
    traceback = "\x1b[36m(SplitCoordinator pid=1958)\x1b[0m Traceback (most recent call last):\n"
    assert ray_error_lines([_stream("stderr", traceback)]) == [
        "(SplitCoordinator pid=1958) Traceback (most recent call last):"]
    worker_exit = "\x1b[36m(RayTrainWorker pid=557)\x1b[0m SystemExit: 1\n"
    assert ray_error_lines([_stream("stderr", worker_exit)]) == ["(RayTrainWorker pid=557) SystemExit: 1"]



def test_job_output_keeps_what_the_newest_job_printed_and_drops_ray_s_lines():
    # A job's log (lesson 07) as Ray 2.60 writes it: a first job under the id, deleted, then a second one appended to
    # the same file; the job manager's lines, the supervisor's "Running entrypoint" line flushed after the job's
    # first output, and lines Ray forwarded, as a raylet's warning about a nearly full disk once was the last line.
    log = ("2026-11-29 09:24:15,104\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
           "hello\n"
           "Running entrypoint for job exercise-1: echo hello\n"
           # the old job's monitor ends its message without a newline: the next job's start line follows on it
           "Job supervisor actor died.2026-11-29 09:25:01,000\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
           "test_acc=0.9741 test_loss=0.0804 images_per_s=559\n"
           "Running entrypoint for job exercise-1: python train_ray_ddp.py\n"
           "2026-11-29 09:25:03,000\tINFO worker.py:1841 -- Connecting to existing Ray cluster at address: ...\n"
           + BENIGN
           + "workers ran on 1 node(s): 9e6a46a6, 9e6a46a6\n"
           + "(raylet) file_system_monitor.cc:116: /tmp/ray/session_x is over 95% full, available space: 1 GB\n")
    assert job_output(log) == ["test_acc=0.9741 test_loss=0.0804 images_per_s=559",
                               "workers ran on 1 node(s): 9e6a46a6, 9e6a46a6"]
    assert job_output("GREETING\n") == ["GREETING"]  # no start line: every line is the job's

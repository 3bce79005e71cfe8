"""Lesson 11's "Fatal Python error: Aborted" after an ASHA stop, reduced to Python and torch (no Ray).

Ray Train runs the training function in a daemon thread (ray/train/v2/_internal/execution/worker_group/
thread_runner.py). When a worker process exits through Python's finalization while that thread is inside a torch
op that released the GIL, the thread's attempt to take the GIL back calls pthread_exit (CPython up to 3.13.7,
python/cpython#87135; 3.13.8 and 3.14 hang the thread instead); glibc unwinds its stack like a C++ exception, the
unwind meets a noexcept C++ frame of torch (pybind11's gil_scoped_release destructor, pytorch/pytorch#38228),
std::terminate aborts, and the fault handler Ray enables prints the line. (Inside Ray, ray::TerminateHandler logs a
stack trace where a plain process prints "terminate called without an active exception".)
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import faulthandler, sys, threading, time
import torch

faulthandler.enable(all_threads=False)  # as in every Ray worker (ray/_private/worker.py)
started, stop = threading.Event(), threading.Event()


class _SlowTeardown:  # keeps the interpreter in its shutdown for 1 s, long after the thread's next matmul ends
    def __del__(self, sleep=time.sleep):
        sleep(1)


_keep = _SlowTeardown()  # __main__ is cleared after Python marks itself as finalizing

def train():
    a = torch.randn(500, 500)
    started.set()
    while not stop.is_set():
        a @ a  # torch releases the GIL for the whole matmul

thread = threading.Thread(target=train, daemon=True)  # as Ray Train's TrainingThread
thread.start()
started.wait()
time.sleep(0.05)
if sys.argv[1] == "join":
    stop.set()
    thread.join()
sys.exit(0)  # what a worker's main loop does when it exits (ray/_private/worker.py, main_loop)
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.version_info >= (3, 13, 8), reason="CPython 3.13.8 and 3.14 hang such a thread (gh-87135)")
@pytest.mark.skipif(sys.platform != "linux", reason="the abort comes from glibc's pthread_exit unwinding the stack")
def test_a_process_that_exits_while_its_daemon_thread_is_in_a_torch_op_aborts():
    ended = _run("exit")
    assert ended.returncode == -signal.SIGABRT, (ended.returncode, ended.stderr[-2000:])
    assert "Fatal Python error: Aborted" in ended.stderr
    assert "terminate called without an active exception" in ended.stderr


def test_the_same_process_exits_cleanly_once_the_thread_has_left_torch():
    ended = _run("join")
    assert ended.returncode == 0, ended.stderr[-2000:]
    assert "Fatal Python error" not in ended.stderr

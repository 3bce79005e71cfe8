"""Small process-level utilities the course's helpers share: waiting for a condition, environment variables set for
a block, free TCP ports, finding and ending processes. It imports nothing from the course, so any helper (and test)
can use it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import psutil

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout_s: float, interval_s: float = 0.5, what: str = "the condition",
               sleep: Callable[[float], object] = time.sleep) -> T:
    """Call `predicate` every `interval_s` seconds until it returns something true, and return that.

    Raises TimeoutError naming `what` when `timeout_s` seconds pass first (the predicate is called at least once).
    An exception the predicate raises ends the wait. `sleep` waits between calls (e.g. a threading.Event's `wait`,
    to stop waiting early: the predicate then sees the event set).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if result := predicate():
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        sleep(interval_s)


@contextlib.contextmanager
def environ(**settings: str) -> Iterator[None]:
    """Within the `with` block, the environment variables `settings` are set; after it, each is as it was before
    (set to its old value, or unset). Tests use pytest's `monkeypatch.setenv` instead."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def free_ports(count: int = 1, host: str = "") -> list[int]:
    """`count` distinct TCP ports that are free now on `host` (default: every interface), held open together so that
    the OS picks different ones. Another process may take one before it is used: use it at once."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def processes_naming(pattern: re.Pattern[str]) -> list[psutil.Process]:
    """The processes whose command line matches `pattern`, and all their descendants (Ray's workers and agents name
    nothing of their node: Ray replaces their process titles, but they are children of its raylet). Never this
    process, whatever its arguments say: ending what this finds must not end the caller."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and pattern.search(" ".join(proc.info["cmdline"] or [])):
            found[proc.pid] = proc
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update((child.pid, child) for child in proc.children(recursive=True))
    return list(found.values())


def end_processes(procs: list[psutil.Process], grace_s: float = 10.0) -> None:
    """SIGTERM `procs`, wait up to `grace_s` for them to end, then SIGKILL the ones left."""
    _send(procs, psutil.Process.terminate)
    left = _wait(procs, grace_s)
    _send(left, psutil.Process.kill)
    _wait(left, 5)


def _send(procs: list[psutil.Process], signal_: Callable[[psutil.Process], None]) -> None:
    """Send a signal (psutil's `terminate` or `kill`) to each of `procs` that still exists."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            signal_(proc)


def _running(proc: psutil.Process) -> bool:
    """Whether `proc` still runs; a zombie does not (its parent, init or Ray's autoscaler, reaps it in its own time)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to `timeout_s` for `procs` to end; return the ones still running."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not any(_running(proc) for proc in procs), timeout_s, 0.1, what="the processes ending")
    return [proc for proc in procs if _running(proc)]

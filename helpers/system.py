"""Small process-level utilities the course's helpers share: waiting for a condition, environment variables set for
a block, free TCP ports. It imports nothing from the course, so any helper (and test) can use it."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

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

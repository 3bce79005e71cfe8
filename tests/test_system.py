"""helpers.system: waiting for a condition, environment variables for a block, free ports."""

from __future__ import annotations

import os
import socket

import pytest

from helpers.system import environ, free_ports, wait_until


def test_wait_until_returns_the_first_true_value_and_times_out_naming_what():
    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "done"), 5, 0.01) == "done"
    assert len(calls) == 3
    with pytest.raises(TimeoutError, match="^the cluster starting did not happen within 0.05 s$"):
        wait_until(lambda: None, 0.05, 0.01, what="the cluster starting")
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, 0, 0.01)  # called once even with no time


def test_environ_sets_for_the_block_and_restores(monkeypatch):
    monkeypatch.setenv("COURSE_TEST_SET", "before")
    monkeypatch.delenv("COURSE_TEST_UNSET", raising=False)
    with pytest.raises(ZeroDivisionError), environ(COURSE_TEST_SET="inside", COURSE_TEST_UNSET="inside"):
        assert os.environ["COURSE_TEST_SET"] == os.environ["COURSE_TEST_UNSET"] == "inside"
        raise ZeroDivisionError
    assert os.environ["COURSE_TEST_SET"] == "before" and "COURSE_TEST_UNSET" not in os.environ


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(3, host="127.0.0.1")
    assert len(set(ports)) == 3
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))

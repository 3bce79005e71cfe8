"""The plugin tests/plugins/leftover_processes.py finds the processes its own test session started, and only those."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.plugins.leftover_processes import SESSION_VARIABLE, started_by


def _watched_process(session_id: str) -> subprocess.Popen:
    """A sleeping process whose command line the plugin watches (it names ipykernel_launcher), in `session_id`."""
    command = [sys.executable, "-c", "import time; time.sleep(60)", "ipykernel_launcher"]
    return subprocess.Popen(command, env={**os.environ, SESSION_VARIABLE: session_id})


def test_the_processes_of_this_session_are_found_and_another_sessions_are_not():
    ours, theirs = _watched_process("this-session"), _watched_process("another-session")
    try:
        found = started_by("this-session")
        assert ours.pid in found and "ipykernel_launcher" in found[ours.pid]
        assert theirs.pid not in found
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait()


def test_this_test_session_marks_what_it_starts():
    assert os.environ.get(SESSION_VARIABLE), "the plugin sets the session's id before the tests run"

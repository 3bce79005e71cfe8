"""Exercises with feedback: a check the learner runs, and a worked solution they can reveal.

An exercise in a lesson is three code cells after its task (a numbered item under "## Exercises"):
1. the learner's cell, with `...` where their code goes;
2. the check: `check("1", {"what must hold": lambda: ..., ...})` (`expect_equal(value, expected)` inside a lambda
   also shows what the value is when it differs). It prints "✓ Exercise 1 passes" with what
   held, or "✗ Exercise 1, not yet:" with what does not hold, and never raises, so it also runs, and says what to do,
   before the learner has written anything;
3. the solution, collapsed (cell metadata `"jupyter": {"source_hidden": true}`) and tagged "solution": the worked
   answer, ending with the same check and `strict=True`, which raises when the solution does not pass. Running the
   notebook top to bottom so proves every solution against its check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path


class ExerciseNotPassed(AssertionError):
    """A check run with `strict=True` found an expectation that does not hold."""


def holds(expectation: Callable[[], object]) -> tuple[bool, str]:
    """Whether `expectation()` is true, and why not: an exception (an unfinished `...`, a missing name) counts as no."""
    try:
        return bool(expectation()), ""
    except Exception as error:  # the learner's code is not there yet, or is wrong: say so, do not stop the notebook
        return False, f" ({type(error).__name__}: {error})"


def check(exercise: str, expectations: Mapping[str, Callable[[], object]], strict: bool = False,
          kind: str = "Exercise") -> None:
    """Print whether `exercise` passes: each key says what must hold, its value tests it.

    `kind` names what is checked in the message: "Exercise 2", or a capstone's "Step 2".
    """
    if not expectations:
        raise ValueError("a check needs at least one expectation")
    results = {what: holds(test) for what, test in expectations.items()}
    failed = [f"  - {what}{why}" for what, (held, why) in results.items() if not held]
    if failed:
        message = f"✗ {kind} {exercise}, not yet:\n" + "\n".join(failed)
    else:
        message = f"✓ {kind} {exercise} passes:\n" + "\n".join(f"  - {what}" for what in results)
    print(message)
    if strict and failed:
        raise ExerciseNotPassed(message)


def expect_equal(value: object, expected: object) -> bool:
    """True when `value == expected`; otherwise an AssertionError whose message shows the value, for `check` to print."""
    if value != expected:
        raise AssertionError(f"got {value!r}")
    return True


def argv_of(command: str, program: str, timeout_s: float = 30) -> list[list[str]]:
    """Every argument list with which the shell `command` runs `program`, as another user's `ps` would see it.

    A stand-in named `program`, put first on PATH, records its arguments and exits, so the real program never runs;
    what `$(...)` and variables expanded to is in them. A command that names the program by its full path, or does
    not run it, gives [].
    """
    with tempfile.TemporaryDirectory() as folder:
        calls = Path(folder) / "calls.jsonl"
        stand_in = Path(folder) / program
        stand_in.write_text(f"#!{sys.executable}\nimport json, sys\n"
                            f"with open({str(calls)!r}, 'a') as f:\n"
                            f"    f.write(json.dumps([{program!r}, *sys.argv[1:]]) + '\\n')\n")
        stand_in.chmod(0o700)
        env = {**os.environ, "PATH": os.pathsep.join([folder, os.environ.get("PATH", "")])}
        subprocess.run(command, shell=True, env=env, capture_output=True, timeout=timeout_s, check=False)
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

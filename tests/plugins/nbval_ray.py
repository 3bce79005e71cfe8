"""nbval's comparison rules for notebooks that run Ray (a pytest plugin, registered by the root conftest.py).

- Ray forwards the log lines of its other processes (workers, actors, the GCS, the raylet) into whichever cell is
  running when they arrive, and they and its C++ core log carry pids, ids and timestamps. Those lines leave the
  comparison; everything else the kernel prints, Python warnings and errors included, stays compared.
- A forwarded line that reports an error still fails the cell, whether or not its output is compared: a Python
  traceback, an exception line (``ValueError: ...``, ``ray.exceptions.RayTaskError(...): ...``) or one of Ray
  Train's failure reports (``Error in training function:``, ``Training failed due to worker errors``). nbval then
  reports "Ray reported errors from other processes" and lists the lines. Only the new run's output is checked.
- A cell that causes errors on purpose says so in its metadata, with the regexes every such line must match
  (``re.search``, colour codes and Ray's "[repeated Nx across cluster]" note removed) and why::

      "metadata": {"testing": {"ray_errors_expected": ["Traceback", "InjectedFailure"],
                               "ray_errors_because": "the failure is injected on purpose"}}

  A line that matches none of them still fails the cell. The allowance also covers the notebook's later cells: Ray
  forwards a line whenever it reaches the kernel, so an error caused on purpose may arrive while the next cells run.
- Known Ray 2.60 noise passes everywhere (the patterns and why they exist: `helpers.tooling.ray_internals`).

The patterns of Ray's log format live in `helpers.tooling.ray_internals`, beside the course's other dependencies on
Ray 2.60's internals, so that a Ray upgrade breaks them in one place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import nbformat
import pytest
from nbval.plugin import IPyNbCell, NbCellError

from helpers.tooling.ray_internals import (
    DATA_COORDINATOR_EXIT,
    KERNEL_LISTING_NOISE,
    RAY_DATA_LISTING_NOISE,
    RAY_ERROR_MESSAGE,
    RAY_LOG_DECORATION,
    RAY_LOG_LINE,
    RAY_LOG_PREFIX,
)

#: The cell-metadata key of the course's test settings; in it, the list of a cell's expected error regexes and why.
TESTING = "testing"
EXPECTED = "ray_errors_expected"
EXPECTED_BECAUSE = "ray_errors_because"


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


def expected_errors(patterns: Iterable[str]) -> re.Pattern | None:
    """One regex allowing any of `patterns`, or None when there are none."""
    patterns = list(patterns)
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
            plain = RAY_LOG_DECORATION.sub("", line)
            prefix = RAY_LOG_PREFIX.match(plain)
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


def check_ray_errors(cell_num: int, source: str, outputs: list, expected: Iterable[str] = ()) -> None:
    """Raise nbval's NbCellError when Ray forwarded error lines that none of the `expected` regexes allows."""
    unexpected = ray_error_lines(outputs, expected_errors(expected))
    if unexpected:
        hint = (
            "If the cell causes these errors on purpose, list regexes that match them in its metadata: "
            f'"{TESTING}": {{"{EXPECTED}": [...], "{EXPECTED_BECAUSE}": "..."}}.'
        )
        raise NbCellError(
            cell_num,
            f"Ray reported errors from other processes ({len(unexpected)} line(s))",
            source,
            "\n".join(unexpected) + "\n\n" + hint,
        )


def allowed_so_far(cell: IPyNbCell) -> list[str]:
    """The expected-error regexes of `cell` and of the notebook's earlier cells, in the order they ran."""
    allowed = getattr(cell.parent, "_ray_errors_expected", [])
    allowed.extend(cell.cell.metadata.get(TESTING, {}).get(EXPECTED, []))
    cell.parent._ray_errors_expected = allowed
    return list(allowed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """After each notebook cell runs, compared or not, fail it on error lines Ray forwarded that it does not expect.

    When the cell also failed on its own, the error lines are reported instead: they usually say why."""
    if not isinstance(item, IPyNbCell):
        return (yield)
    allowed = allowed_so_far(item)
    try:
        return (yield)
    finally:
        check_ray_errors(item.cell_num, item.cell.source, item.test_outputs or [], allowed)


# nbval 0.11 has no hook to filter outputs before it compares them. Its sanitizers (--nbval-sanitize-with) only
# substitute text inside an output: a stream that held nothing but Ray's lines would stay behind, empty, and fail as
# an output the recording does not have. So the comparison itself is wrapped, and only it.
_compare_outputs = IPyNbCell.compare_outputs


def _compare_outputs_without_ray_logs(self, test, ref, skip_compare=None):
    return _compare_outputs(self, drop_ray_log_lines(test), drop_ray_log_lines(ref), skip_compare)


IPyNbCell.compare_outputs = _compare_outputs_without_ray_logs

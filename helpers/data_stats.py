"""Ray Data's `stats()` text read as numbers: a dataset's operators (`operator_times`, lesson 03) and an iterator's
times (`iterator_times`, lesson 06). Ray Data prints durations as text with a unit ("9.12s", "101.97ms", "850us")."""

from __future__ import annotations

import re

import pandas as pd

#: Seconds per unit of the durations in Ray Data's stats text.
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}

_STATS_OPERATOR = re.compile(r"^\s*(?:Sub)?[Oo]perator \d+ (?P<name>.+?): (?P<tasks>\d+) tasks executed")
_STATS_TIME = re.compile(r"^\s*\* Remote (?P<kind>wall|cpu) time: .*?(?P<total>[\d.]+)(?P<unit>us|ms|s) total")


def operator_times(stats: str) -> pd.DataFrame:
    """From `ds.stats()`'s text: one row per operator that ran tasks, with its tasks and total wall and CPU seconds."""
    rows: dict[str, dict[str, float | None]] = {}
    current = None
    for line in stats.splitlines():
        if match := _STATS_OPERATOR.match(line):
            current = rows.setdefault(match["name"], {"tasks": int(match["tasks"]), "wall_s": None, "cpu_s": None})
        elif current is not None and (match := _STATS_TIME.match(line)):
            current[f"{match['kind']}_s"] = round(float(match["total"]) * _UNITS[match["unit"]], 3)
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("operator")


#: The lines of a Ray Data iterator's `stats()` that `iterator_times` reads, by the key it returns them under.
ITERATOR_LINES = {
    "total_s": "Total time overall",
    "initialize_s": "Total time in Ray Data iterator initialization code",
    "blocked_s": "Total time user thread is blocked by Ray Data iter_batches",
    "first_batch_s": "Total time spent waiting for the first batch after starting iteration",
    "user_s": "Total execution time for user thread",
}


def iterator_times(stats: str) -> dict[str, float]:
    """Seconds from a Ray Data iterator's `stats()` text: total, initialization, blocked, first batch, user code.

    Ray Data prints these times as text ("9.12s", "101.97ms") and leaves out a line whose time is still 0: such
    a key is 0.0 here. A shard iterator's times add up over every pass (epoch) made with it so far.
    """
    times = dict.fromkeys(ITERATOR_LINES, 0.0)
    for key, label in ITERATOR_LINES.items():
        found = re.search(rf"{re.escape(label)}: ([\d.]+)(us|ms|s)\b", stats)
        if found:
            times[key] = float(found.group(1)) * _UNITS[found.group(2)]
    return times

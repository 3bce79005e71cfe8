"""Figures measured in rounds, on a small, shared machine: each figure's median with its min and max over the rounds,
and the verdicts the course draws from them. It imports nothing from the course.

Two verdict rules, each where a lesson's recorded output relies on it:
- `verdict` (the benchmark, lessons 03 and 10): a ratio taken *within* each round, and a direction only when every
  round agrees (3 rounds or more);
- `ranges_verdict` (lesson 06's `compare_rounds`): a difference only when the two conditions' ranges over the rounds
  do not overlap.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def spread(values: Iterable[float]) -> dict:
    """Median, min and max of one figure over the rounds, and the rounds' values."""
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def verdict(ratios: list[float]) -> str:
    """What the rounds say about `a / b`: a direction only when every round agrees (and there are 3 or more)."""
    if len(ratios) < 3:
        return f"no verdict from {len(ratios)} round(s)"
    if min(ratios) > 1:
        return "faster in every round"
    if max(ratios) < 1:
        return "slower in every round"
    return "no measurable difference"


def compare(runs: dict[str, list[float]], a: str, b: str) -> dict:
    """`a` against `b`: the ratio of their figures within each round, its spread, and the verdict."""
    ratios = [x / y for x, y in zip(runs[a], runs[b], strict=True)]
    return {"a": a, "b": b, "ratio": spread(ratios), "verdict": verdict(ratios)}


def ranges_verdict(low: float, high: float, baseline_low: float, baseline_high: float) -> str:
    """What the rounds say about a condition whose values ranged over [low, high], against a baseline's range:
    a difference only when the two ranges do not overlap."""
    if high < baseline_low:
        return "measured: lower"
    if low > baseline_high:
        return "measured: higher"
    return "no measurable difference"


def spread_text(figure: dict, digits: int = 1, unit: str = "") -> str:
    """A `spread` as text: "median [min-max]", each with `digits` decimals, `unit` after the median."""
    return f"{figure['median']:.{digits}f}{unit} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"


def rotated(variants: list, round_index: int) -> list:
    """The variants in the order round `round_index` runs them: each round starts one further along."""
    shift = round_index % len(variants)
    return variants[shift:] + variants[:shift]


def run_rounds(variants: dict[str, Callable[[], T]], rounds: int, warmup: bool = False) -> dict[str, list[T]]:
    """Run every variant once per round, in rotated order; what each variant returned per round, in round order.

    `warmup` first runs the first variant once and drops it: the process' one-off costs (allocator, kernel
    choice, first imports) then do not land on round 1's first variant.
    """
    if warmup:
        next(iter(variants.values()))()
    runs: dict[str, list] = {name: [] for name in variants}
    for round_index in range(rounds):
        for name in rotated(list(variants), round_index):
            runs[name].append(variants[name]())
    return runs

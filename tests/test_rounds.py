"""helpers.rounds: spreads over rounds and the two verdict rules (spread, verdict, compare: tests/test_bench.py)."""

from __future__ import annotations

from helpers.rounds import ranges_verdict, spread, spread_text


def test_spread_text_is_median_min_max():
    assert spread_text(spread([3, 1, 2.5]), 1, " images/s") == "2.5 images/s [1.0-3.0]"
    assert spread_text(spread([10.4, 12.6]), 0) == "12 [10-13]"


def test_the_ranges_rule_needs_ranges_that_do_not_overlap():
    assert ranges_verdict(1, 2, 3, 4) == "measured: lower"
    assert ranges_verdict(5, 6, 3, 4) == "measured: higher"
    assert ranges_verdict(2, 3, 3, 4) == "no measurable difference"  # they touch

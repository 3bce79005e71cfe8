"""helpers.rounds: spreads and the two verdict rules; helpers.sizes."""

from __future__ import annotations

import pytest

from helpers.rounds import compare, ranges_verdict, spread, spread_text, verdict


def test_spread_is_median_min_max_with_the_rounds():
    assert spread([3, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "rounds": [3.0, 1.0, 2.0]}


@pytest.mark.parametrize(("ratios", "expected"), [
    ([1.1, 1.2, 1.05, 1.3, 1.01], "faster in every round"),
    ([0.9, 0.8, 0.95], "slower in every round"),
    ([0.86, 1.13, 0.99, 1.02, 0.97], "no measurable difference"),  # a median below 1, inside the spread
    ([1.5, 1.6], "no verdict from 2 round(s)"),
    ([2.0], "no verdict from 1 round(s)"),
])
def test_a_verdict_needs_every_round_to_agree(ratios, expected):
    assert verdict(ratios) == expected


def test_compare_takes_the_ratio_within_each_round():
    # b is faster on average, but a beats b in every round: only within-round ratios see that
    runs = {"a": [100, 200, 300], "b": [90, 190, 290]}
    comparison = compare(runs, "a", "b")
    assert comparison["verdict"] == "faster in every round"
    assert comparison["ratio"]["rounds"] == pytest.approx([100 / 90, 200 / 190, 300 / 290])
    with pytest.raises(ValueError):
        compare({"a": [1, 2], "b": [1]}, "a", "b")


def test_spread_text_is_median_min_max():
    assert spread_text(spread([3, 1, 2.5]), 1, " images/s") == "2.5 images/s [1.0-3.0]"
    assert spread_text(spread([10.4, 12.6]), 0) == "12 [10-13]"


def test_the_ranges_rule_needs_ranges_that_do_not_overlap():
    assert ranges_verdict(1, 2, 3, 4) == "measured: lower"
    assert ranges_verdict(5, 6, 3, 4) == "measured: higher"
    assert ranges_verdict(2, 3, 3, 4) == "no measurable difference"  # they touch


def test_sizes_are_keyed_by_mode_and_keep_their_old_names():
    from helpers import cifar, ingest, tuning
    from helpers.sizes import SIZES, sized
    from helpers.tooling import scripts

    assert sorted(SIZES["smoke"]) == sorted(SIZES["full"]), "every size has a smoke and a full value"
    assert ingest.SMOKE_ROWS == sized("mnist_rows", True) == {"train": 1920, "valid": 1000}
    assert sized("mnist_rows", False) is None
    assert cifar.VIT_SIZES["smoke"] == sized("vit", True) and cifar.SMOKE_ROWS == sized("cifar_rows", True)
    assert (tuning.SEARCH_ROWS, tuning.SMOKE_SEARCH_ROWS) == (sized("search_rows", False), sized("search_rows", True))
    assert (scripts.DEFAULT_SIZE_GB, scripts.SMOKE_SIZE_GB) == (1.0, 0.01)

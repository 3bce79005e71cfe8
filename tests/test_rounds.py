"""helpers.rounds: spreads and the two verdict rules (spread, verdict, compare: tests/test_bench.py); helpers.sizes."""

from __future__ import annotations

from helpers.rounds import ranges_verdict, spread, spread_text


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

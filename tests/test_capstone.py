"""helpers.capstone's exercise references: what each epoch repeats and what a ring all-reduce sends.

Its check of lesson 09's steps 2 and 3 on loops that Ray Train runs: tests/test_capstone_ray.py.
"""

from __future__ import annotations

import pytest
from torch import nn


def test_the_exercise_references_count_what_repeats_and_what_a_ring_sends():
    import pandas as pd

    from helpers.capstone import ring_allreduce_megabytes, wall_after_epochs

    results = pd.DataFrame({"wall time (s)": [100.0], "train (s)": [60.0], "evaluate (s)": [10.0]}, index=["step"])
    assert wall_after_epochs(results, 1) == {"step": 100.0}
    assert wall_after_epochs(results, 10) == {"step": 100.0 + 9 * 70.0}
    linear = nn.Linear(1000, 250)  # 250,250 parameters: 1.001 MB of float32 gradients
    assert ring_allreduce_megabytes(linear, 2) == pytest.approx(1.001)
    assert ring_allreduce_megabytes(linear, 8) == pytest.approx(2 * 7 / 8 * 1.001)

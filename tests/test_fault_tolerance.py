"""helpers.fault_tolerance.with_failure refuses a failure that a run could not recover from or never reach.

Lesson 05's claims, on real runs: tests/test_fault_tolerance_ray.py.
"""

from __future__ import annotations

import pytest

from helpers.fault_tolerance import train_loop_per_worker, with_failure


@pytest.mark.parametrize("epoch,step,rank", [(0, 2, 1), (1, -1, 1), (1, 2, -1)])
def test_with_failure_refuses_a_failure_it_could_not_recover_from_or_never_reach(epoch, step, rank):
    # A failure in epoch 0 comes before any checkpoint: the restarted attempt would start fresh and fail again.
    with pytest.raises(ValueError, match="with_failure needs epoch >= 1"):
        with_failure(train_loop_per_worker, epoch=epoch, step=step, rank=rank)

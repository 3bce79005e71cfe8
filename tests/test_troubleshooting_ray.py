"""helpers.troubleshooting's iterator timings from a real Ray Data shard iterator."""

from __future__ import annotations

import time

import pytest
import ray

from helpers.troubleshooting import (
    iterator_times,
)

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


@pytest.fixture(scope="module")
def one_cpu_ray(no_ray):
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_iterator_times_from_a_real_shard_iterator_add_up_over_epochs(one_cpu_ray):
    shard = ray.data.range(400, override_num_blocks=4).streaming_split(1)[0]  # what get_dataset_shard returns
    history = []
    for _ in range(2):
        started = time.perf_counter()
        for _batch in shard.iter_batches(batch_size=100):
            time.sleep(0.02)  # user code, not blocked on data
        elapsed = time.perf_counter() - started
        history.append(iterator_times(shard.stats()))
    first, second = history
    assert all(first[key] > 0 for key in ("total_s", "blocked_s", "first_batch_s", "user_s")), first
    assert first["first_batch_s"] <= first["blocked_s"] <= first["total_s"], "the first batch's wait is blocked time"
    assert first["user_s"] >= 4 * 0.02, "four batches of user code"
    assert second["total_s"] > first["total_s"] and second["user_s"] > first["user_s"], "the times add up"
    assert second["total_s"] - first["total_s"] <= elapsed + 0.05, "the second epoch's share is the difference"

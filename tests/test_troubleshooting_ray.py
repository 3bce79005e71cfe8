"""helpers.troubleshooting on the course's local Ray: iterator timings from a real Ray Data shard iterator, and Ray
Train's metrics as the nodes' Prometheus endpoints serve them while a real run goes on (lesson 06, section 02), and
that run's controller log read as lesson 06 reads it (every start-up phase, against the pinned Ray)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import ray.train
from ray.train import RunConfig
from ray.train.torch import TorchTrainer

from helpers.cluster import course_scaling_config
from helpers.troubleshooting import (
    METRICS_EXPORT_INTERVAL_S,
    controller_records,
    iterator_times,
    startup_phases,
    watch_train_metrics,
)

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


def test_iterator_times_from_a_real_shard_iterator_add_up_over_epochs(course_ray):
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


def report_then_wait(config: dict) -> None:
    time.sleep(1)
    ray.train.report({"step": 1})  # its time is recorded now, sent at the next export, served a while after
    time.sleep(METRICS_EXPORT_INTERVAL_S + 3)  # the run goes on past that export


def test_a_run_s_metrics_are_read_while_it_runs_and_its_controller_log_has_every_start_up_phase(course_ray, tmp_path):
    trainer = TorchTrainer(report_then_wait,
                           scaling_config=course_scaling_config(course_ray, num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path), name="watched"))
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(trainer.fit)
        table = watch_train_metrics("watched", until=running.done, timeout_s=300)
        running.result()
    assert list(table.columns) == ["controller", "rank 0", "rank 1"], table
    assert float(table.loc["starting the worker group", "controller"].removesuffix(" s")) > 0, table
    reports = table.loc["inside ray.train.report()"]
    assert reports["controller"] == "" and all(float(reports[rank].removesuffix(" s")) > 0
                                               for rank in ("rank 0", "rank 1")), table
    # The same run's controller log, against the pinned Ray: it has every start-up phase startup_phases reads.
    phases = startup_phases(controller_records("watched"))
    parts = sum(seconds for phase, seconds in phases.items() if phase not in ("worker_group_total", "controller_setup"))
    assert 0 < parts <= phases["worker_group_total"] + 0.05, phases

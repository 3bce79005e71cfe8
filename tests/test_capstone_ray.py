"""helpers.capstone: the check of lesson 09's steps 2 and 3 fails on the loops a learner gets wrong, within seconds.

The lesson's solutions pass it with `strict=True` whenever the notebook runs; these tests give it the two classic
mistakes, a loop that forgets `prepare_data_loader` (every worker trains on all the images) and one in which only
rank 0 calls `ray.train.report` (without a timeout, rank 0 would wait for the others forever), and a skeleton.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray.train
import ray.train.torch
import torch
from ray import cloudpickle
from torch import nn
from torch.utils.data import DataLoader

from helpers import capstone
from helpers.capstone import check_step, unfinished
from helpers.cifar import CifarParquet, cifar10_parquet_root, vit_cifar10
from helpers.exercises import ExerciseNotPassed
from helpers.training import evaluate_distributed
from tests.support import FAILS_FAST_S, RAY_START_THEN_FAILS_S

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


# The loops below run in Ray Train's workers, which cannot import this test module: send them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def loop(config: dict, shard: bool = True, only_rank_0_reports: bool = False) -> None:
    """A short Ray Train loop that reports what the lesson's `run_epoch` reports, with the mistakes switched on."""
    context = ray.train.get_context()
    train = DataLoader(CifarParquet(config["root"], "train", config["max_rows"]["train"]),
                       batch_size=config["global_batch_size"] // context.get_world_size(), shuffle=True)
    test = DataLoader(CifarParquet(config["root"], "test", config["max_rows"]["test"]))
    test = ray.train.torch.prepare_data_loader(test)
    train = ray.train.torch.prepare_data_loader(train) if shard else train
    model = ray.train.torch.prepare_model(vit_cifar10(smoke_test=True))
    optimizer = torch.optim.AdamW(model.parameters())
    for epoch in range(config["num_epochs"]):
        images = 0
        for batch_images, labels in train:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(batch_images), labels).backward()
            optimizer.step()
            images += len(labels)
        test_metrics = evaluate_distributed(model.module, test, "cpu")
        metrics = {"epoch": epoch, "train_images": images, "test_images": test_metrics["images"],
                   "test_acc": test_metrics["accuracy"]}
        if context.get_world_rank() != 0:
            if not only_rank_0_reports:
                ray.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as checkpoint_dir:
            torch.save(model.module.state_dict(), Path(checkpoint_dir) / "model.pt")
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir))


def forgets_prepare_data_loader(config: dict) -> None:
    loop(config, shard=False)


def only_rank_0_reports(config: dict) -> None:
    loop(config, only_rank_0_reports=True)


def skeleton(config: dict) -> None:
    ...


@pytest.fixture(scope="module")
def config(course_ray, tmp_path_factory) -> dict:
    return {"root": cifar10_parquet_root(course_ray.data_dir), "storage_path": str(tmp_path_factory.mktemp("runs")),
            "seed": 0}


def test_a_skeleton_is_not_run_and_the_learner_is_told_what_to_write(config, capsys):
    assert unfinished(skeleton) == ["skeleton"] and unfinished(loop) == []
    started = time.perf_counter()
    check_step("2", skeleton, config)
    assert time.perf_counter() - started < FAILS_FAST_S, "the skeleton ran"
    assert "✗ Step 2, not yet:\n  - `skeleton` still has `...`: write it" in capsys.readouterr().out


def test_a_loop_without_prepare_data_loader_fails_the_share_check(config, capsys):
    with pytest.raises(ExerciseNotPassed, match=r"each worker trains on its own share: 32 of the 64 images "
                                                r"\(AssertionError: got 64\)"):
        check_step("2", forgets_prepare_data_loader, config, strict=True)
    assert "✓" not in capsys.readouterr().out


def test_a_loop_where_only_rank_0_reports_fails_within_the_collective_timeout(config, monkeypatch):
    # Rank 1 never reports, so any timeout ends the run the same way: a short one, not the lesson's 15 s of waiting.
    timeout_s = 3
    monkeypatch.setattr(capstone, "CHECK_COLLECTIVE_TIMEOUT_S", timeout_s)
    started = time.perf_counter()
    with pytest.raises(ExerciseNotPassed, match=r"rank\(s\) \[1\] never called ray.train.report"):
        check_step("2", only_rank_0_reports, config, strict=True)
    assert time.perf_counter() - started < timeout_s + RAY_START_THEN_FAILS_S  # the fit's start-up, then the timeout

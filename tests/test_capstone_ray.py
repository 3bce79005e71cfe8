"""helpers.capstone: the checks of lesson 09 fail on the mistakes a learner makes, each with the message that says
what to fix, within seconds.

The lesson's solutions pass them with `strict=True` whenever the notebook runs. Here `check_step` gets a loop with
one mistake each: the global batch on every worker, no DDP, no DistributedSampler, a test set evaluated whole on
every worker, only rank 0 reporting (without a timeout, rank 0 would wait for the others forever), a restart from
epoch 0; `check_run` gets configurations that keep the wrong checkpoints or never restart; `check_job` a job without
its code; exercise 2's check the answer the learner would guess.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import pytest
import ray.train
import ray.train.torch
import torch
from ray import cloudpickle
from torch.utils.data import DataLoader

from helpers import capstone
from helpers.capstone import (
    check_job,
    check_run,
    check_step,
    cifar10_datasets,
    report_epoch,
    resume,
    run_epoch,
    train_loop_per_worker_ray_data,
    unfinished,
)
from helpers.cifar import CifarParquet, cifar10_parquet_root, vit_cifar10
from helpers.exercises import ExerciseNotPassed, check
from helpers.training import seed_everything
from tests.support import FAILS_FAST_S, RAY_START_THEN_FAILS_S

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_capstone_cifar10_vit.ipynb"


# The loops below run in Ray Train's workers, which cannot import this test module: send them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def loop(config: dict, mistake: str | None = None) -> None:
    """Lesson 09's step-2 loop (its solution), with one `mistake` switched on."""
    seed_everything(config["seed"])
    context = ray.train.get_context()
    world_size, device = context.get_world_size(), ray.train.torch.get_device()
    batch_size = config["global_batch_size"] // (1 if mistake == "global batch per worker" else world_size)
    train = DataLoader(CifarParquet(config["root"], "train", config["max_rows"]["train"]), batch_size=batch_size,
                       shuffle=True)
    test = DataLoader(CifarParquet(config["root"], "test", config["max_rows"]["test"]), batch_size=512)
    if mistake != "no DistributedSampler":
        train = ray.train.torch.prepare_data_loader(train)
    if mistake != "test set on every worker":
        test = ray.train.torch.prepare_data_loader(test)
    model = vit_cifar10(smoke_test=True)
    model = model.to(device) if mistake == "no DDP" else ray.train.torch.prepare_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    start_epoch = resume(model, optimizer)
    for epoch in range(0 if mistake == "restarts from epoch 0" else start_epoch, config["num_epochs"]):
        if world_size > 1 and mistake != "no DistributedSampler":
            train.sampler.set_epoch(epoch)
        metrics = {"epoch": epoch, **run_epoch(model, train, test, optimizer, device, config["started_at"])}
        if mistake == "only rank 0 reports" and context.get_world_rank() != 0:
            continue
        report_epoch(model, optimizer, metrics)


def with_mistake(mistake: str):
    def loop_with_mistake(config: dict) -> None:
        loop(config, mistake)

    return loop_with_mistake


def skeleton(config: dict) -> None:
    ...


@pytest.fixture(scope="module")
def config(course_ray, tmp_path_factory) -> dict:
    return {"root": cifar10_parquet_root(course_ray.data_dir), "storage_path": str(tmp_path_factory.mktemp("runs")),
            "seed": 0, "lr": 1e-3, "weight_decay": 1e-2, "prefetch_batches": 1, "shuffle_buffer": 64}


def test_a_skeleton_is_not_run_and_the_learner_is_told_what_to_write(config, capsys):
    assert unfinished(skeleton) == ["skeleton"] and unfinished(loop) == []
    started = time.perf_counter()
    check_step("2", skeleton, config)
    assert time.perf_counter() - started < FAILS_FAST_S, "the skeleton ran"
    assert "✗ Step 2, not yet:\n  - `skeleton` still has `...`: write it" in capsys.readouterr().out


@pytest.mark.parametrize("mistake,message", [
    ("global batch per worker", r"each worker's batch is global_batch_size // world_size = 8 images: 4 steps on its 32 "
                                r"\(AssertionError: got 2\)"),
    ("no DDP", r"every rank holds the same weights after the epoch: DDP averaged the gradients \(prepare_model\)\n"),
    ("no DistributedSampler", r"each worker trains on its own share: 32 of the 64 images, not all of them "
                              r"\(a DistributedSampler, from prepare_data_loader, or a dataset shard\) "
                              r"\(AssertionError: got 64\)"),
    ("test set on every worker", r"the evaluation covers the 32 test images once, split between the workers, not once "
                                 r"per worker \(the test loader too goes through prepare_data_loader\) "
                                 r"\(AssertionError: got 64\)"),
    ("restarts from epoch 0", r"started again under the same run name, the loop goes on at epoch 1, not 0: the run's "
                              r"checkpoints are of epochs \[0, 1\] \(AssertionError: got \[0, 0, 1\]\)"),
])
def test_each_mistake_of_step_2_fails_the_check_that_names_it(config, mistake, message, capsys):
    with pytest.raises(ExerciseNotPassed) as failed:
        check_step("2", with_mistake(mistake), config, strict=True)
    assert failed.match(message)
    failing = [line for line in str(failed.value).splitlines() if line.startswith("  - ")]
    assert len(failing) <= 4, f"{mistake!r} fails checks that are not about it: {failing}"
    assert "✓" not in capsys.readouterr().out


def test_a_loop_where_only_rank_0_reports_fails_within_the_collective_timeout(config, monkeypatch):
    # Rank 1 never reports, so any timeout ends the run the same way: a short one, not the lesson's 15 s of waiting.
    timeout_s = 3
    monkeypatch.setattr(capstone, "CHECK_COLLECTIVE_TIMEOUT_S", timeout_s)
    started = time.perf_counter()
    with pytest.raises(ExerciseNotPassed, match=r"rank\(s\) \[1\] never called ray.train.report"):
        check_step("2", with_mistake("only rank 0 reports"), config, strict=True)
    assert time.perf_counter() - started < timeout_s + RAY_START_THEN_FAILS_S  # the fit's start-up, then the timeout


def test_run_configurations_that_keep_the_wrong_checkpoints_or_never_restart_fail_without_a_run(config):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from helpers.results import MetricsHistory

    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
    latest_two = RunConfig(storage_path=config["storage_path"], checkpoint_config=CheckpointConfig(num_to_keep=2),
                           failure_config=FailureConfig(max_failures=2), callbacks=[MetricsHistory()])
    started = time.perf_counter()
    with pytest.raises(ExerciseNotPassed, match=r"it keeps the best 2 checkpoints by test_acc \(CheckpointConfig\) "
                                                r"\(AssertionError: got \(2, None, 'max'\)\)"):
        check_run(scaling, latest_two, train_loop_per_worker_ray_data, config, cifar10_datasets, strict=True)
    never_restarts = RunConfig(storage_path=config["storage_path"], callbacks=[MetricsHistory()],
                               checkpoint_config=CheckpointConfig(2, "test_acc", "max"))
    with pytest.raises(ExerciseNotPassed, match=r"it restarts the workers after a failure") as failed:
        check_run(scaling, never_restarts, train_loop_per_worker_ray_data, config, cifar10_datasets, strict=True)
    assert "a run with them" not in str(failed.value), "configurations that do not hold were run"
    assert time.perf_counter() - started < FAILS_FAST_S


def test_a_job_without_its_code_fails_the_check_with_the_cluster_s_reason(config):
    from ray.job_submission import JobSubmissionClient

    from helpers.session import dashboard_url

    client = JobSubmissionClient(dashboard_url())
    submission_id = client.submit_job(entrypoint="python train_capstone.py --epochs 1",
                                      runtime_env={"env_vars": {"COURSE_STORAGE_PATH": config["storage_path"]}})
    with pytest.raises(ExerciseNotPassed) as failed:
        check_job(client, submission_id, config["storage_path"], "a-job", strict=True, timeout_s=60)
    assert failed.match(r"it names its run job_name, a-job \(--name\)\n")
    assert failed.match(r"its code travels with it \(runtime_env: working_dir, and helpers as py_modules\)\n")
    assert failed.match(r"it runs: RUNNING 15 s after it started, or SUCCEEDED "
                        r"\(AssertionError: FAILED: .*train_capstone.py")
    assert "it stores its run under" not in str(failed.value)


def test_exercise_2_s_check_fails_on_a_guess_and_on_crops_never_made(config, capsys):
    from helpers.cifar import augment_batch, normalize_batch

    cells = [cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells
             if cell.cell_type == "code" and 'check("2"' in cell.source and "frozen = " not in cell.source]
    assert len(cells) == 1, f"{len(cells)} cells check exercise 2 without answering it"
    plain = ray.data.read_parquet(f"{config['root']}/test").limit(64).map_batches(normalize_batch).materialize()
    frozen = plain.map_batches(augment_batch).materialize()
    right = {"augment before materialize()": True, "augment after materialize()": False}
    answers = [(frozen, {"augment before materialize()": False, "augment after materialize()": False},
                "same_crops says what two passes of each dataset show"),  # "crops are random, so never the same"
               (plain, right, "frozen is a materialized dataset of 64 augmented rows")]  # no augment_batch in it
    for frozen_answer, same_crops, wrong in answers:
        exec(cells[0], {"frozen": frozen_answer, "same_crops": same_crops, "root": config["root"], "check": check,
                        "datasets": {"train": plain.map_batches(augment_batch)}})
        printed = capsys.readouterr().out
        assert printed.startswith("✗ Exercise 2, not yet:") and f"  - {wrong}" in printed, printed
        assert printed.count("  - ") == 1, printed

"""Lesson 05's claims, proven on real runs: after an injected failure the run resumes at the failed epoch, loses and
repeats no epoch, and its checkpoint carries the optimizer state; a loop that forgets the optimizer restore ends
with other metrics than the same run with the restore, so the comparison sees what the restore does. (Lesson 05
itself, under nbval, asserts that the resumed run ends with exactly the metrics of lesson 03's run without a failure,
recovers a worker process killed with SIGKILL to the same metrics, and continues a script's run stopped with Ctrl-C
under its name; tests/test_multinode.py does the last on a multi-node cluster.)
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pytest
import torch
from ray.train import DataConfig, FailureConfig, RunConfig
from ray.train.torch import TorchTrainer

from helpers import fault_tolerance
from helpers.cluster import course_scaling_config
from helpers.config import load_config
from helpers.fault_tolerance import train_loop_per_worker, with_failure
from helpers.ingest import mnist_datasets
from helpers.results import MetricsHistory, read_history

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


#: Small epochs: 5 steps of 64 images per worker, 128 images to validate.
ROWS = {"train": 640, "valid": 128}
NUM_EPOCHS = 2
#: What must come out the same when a failed epoch is repeated on the restored state.
COMPARED = ["train_loss", "test_loss", "test_acc"]


def fit(storage_path: str | Path, datasets: dict, name: str, max_failures: int = 0, loop=train_loop_per_worker):
    """Lesson 05's trainer: the resumable loop, 2 workers, shuffled epochs, MetricsHistory; `fit()`'s Result."""
    trainer = TorchTrainer(
        loop,
        train_loop_config={"num_epochs": NUM_EPOCHS, "global_batch_size": 128, "lr": 1e-3, "seed": 0,
                           "prefetch_batches": 1, "shuffle_buffer": ROWS["train"] // 2},
        datasets=datasets,  # materialized once, for every run, as lesson 05 does
        dataset_config=DataConfig(enable_shard_locality=False),
        scaling_config=course_scaling_config(load_config(), num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(storage_path), name=name, callbacks=[MetricsHistory()],
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit()


def epoch_metrics(result_or_folder) -> list[dict]:
    """Each reported epoch's compared metrics, in order."""
    history = read_history(result_or_folder)
    return history[history["event"] == "report"][COMPARED].to_dict("records")


def without(line: str):
    """`train_loop_per_worker` with one line of its source replaced by `pass`: a loop that forgets a restore."""
    source = textwrap.dedent(inspect.getsource(train_loop_per_worker))
    assert source.count(line) == 1, f"{line!r} not found once in the loop"
    namespace = dict(vars(fault_tolerance))
    exec(compile(source.replace(line, "pass"), "<loop without a restore>", "exec"), namespace)
    return namespace["train_loop_per_worker"]


@pytest.fixture(scope="module")
def runs(mnist_parquet, tmp_path_factory) -> tuple[Path, dict]:
    """A storage path for the module's runs, and the datasets they all train on."""
    return tmp_path_factory.mktemp("runs"), mnist_datasets(mnist_parquet, ROWS)


def _events(history) -> list[tuple]:
    return [(row.event, None if row.event == "failure" else int(row.epoch), None if row.event == "failure"
             else int(row.start_epoch)) for row in history.itertuples()]


@pytest.fixture(scope="module")
def resumed(runs):
    """The Result of lesson 05's run: rank 1 fails at epoch 1, step 2, and the run restarts once."""
    return fit(*runs, name="worker-failure", max_failures=1, loop=with_failure(train_loop_per_worker, 1, 2, 1))


def test_an_injected_failure_resumes_on_the_restored_state(resumed):
    history = read_history(resumed.path)
    # Epoch 0 once; the failure in epoch 1; epoch 1 once, by workers that started at epoch 1. None lost, none repeated.
    assert _events(history) == [("report", 0, 0), ("failure", None, None), ("report", 1, 1)]
    failure = history[history["event"] == "failure"].iloc[0]
    assert failure["rank"] == 1 and "InjectedFailure" in failure["error"] and "epoch 1, step 2" in failure["error"]
    with resumed.checkpoint.as_directory() as checkpoint_dir:
        state = torch.load(Path(checkpoint_dir) / "train_state.pt", map_location="cpu")
    assert state["epoch"] == NUM_EPOCHS - 1 and state["optimizer"]["state"], "optimizer state missing"


def test_a_loop_that_forgets_the_optimizer_restore_does_not_match(runs, resumed):
    line = "optimizer.load_state_dict(optimizer_state)"  # Adam's running averages start again from zero
    result = fit(*runs, name="forgets-optimizer", max_failures=1, loop=with_failure(without(line), 1, 2, 1))
    forgetful, reference = epoch_metrics(result), epoch_metrics(resumed)
    assert forgetful[0] == reference[0], "epoch 0 ran before the failure: it must match"
    assert forgetful[1]["train_loss"] != pytest.approx(reference[1]["train_loss"], rel=1e-3), \
        f"without `{line}` the resumed epoch still matches: the comparison cannot see the restore"

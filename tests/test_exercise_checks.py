"""Each lesson's exercise checks, run on the mistake the exercise targets: the check must say "not yet" and name
what does not hold. The check cell is taken from the notebook as the learner runs it; the answer is fed in as the
values the learner's cell would leave behind."""

from __future__ import annotations

import copy
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from tests.support import exercise_check_cell, failed, run_check_cell, run_check_source, write_run_folder

if TYPE_CHECKING:
    import pandas as pd

def define(namespace: dict[str, Any], signature: str, answer: str) -> None:
    """Define the learner's one-line answer, `def <signature>: return <answer>`, in `namespace`."""
    exec(f"def {signature}:\n    return {answer}\n", namespace)


# ---- 00 · exercise 1: results one at a time, as they finish (ray.wait), not in submission order (ray.get) ---------

NAPS_BY_GET = [3.0] + [0.25] * 7  # ray.get(refs): the submission order
NAPS_BY_WAIT = [0.25] * 7 + [3.0]  # ray.wait(..., num_returns=1) in a loop, on 2 CPUs or more
ARRIVED_BY_WAIT = [0.27 * n for n in range(1, 8)] + [3.02]  # the short naps one after another on the second CPU
ALL_AT_3_S = [3.02] * 8  # every result taken once ray.get(refs) returned
NOT_AS_THEY_CAME = "each short nap arrived while the long one still ran"


@pytest.mark.parametrize("as_finished,arrived_s,elapsed_s,wrong", [
    (NAPS_BY_WAIT, ARRIVED_BY_WAIT, 3.1, []),
    # ray.get on the list, or ray.wait(num_returns=8): submission order, all at once
    (NAPS_BY_GET, ALL_AT_3_S, 3.1, ["they arrived as they finished", NOT_AS_THEY_CAME]),
    (NAPS_BY_WAIT, ALL_AT_3_S, 3.1, [NOT_AS_THEY_CAME]),  # sorted(ray.get(refs))
    (NAPS_BY_WAIT, [], 3.1, [NOT_AS_THEY_CAME]),  # arrived_s not kept
    ([0.25] * 7 + [3.0], [0.25 * n for n in range(1, 8)] + [4.9], 4.9, ["the naps ran"]),  # one after the other
])
def test_lesson_00_exercise_1_fails_on_results_taken_in_submission_order_or_all_at_once(capsys, as_finished, arrived_s,
                                                                                         elapsed_s, wrong):
    results = run_check_cell("00_ray_core.ipynb", "exercise_1", {"as_finished": as_finished, "arrived_s": arrived_s,
                                                                  "elapsed_s": elapsed_s, "num_cpus": 2}, capsys)
    assert [what.split(":")[0].split(" (")[0] for what in failed(results)] == wrong, results


# ---- 00 · exercise 2: all three tasks submitted first, then a ray.get per task, each in its own try -----------------

@pytest.mark.parametrize("roots,elapsed_s,wrong", [
    ([2.0, None, 3.0], 1.05, []),
    (None, 1.05, ["roots is [2.0, None, 3.0]"]),  # try: roots = ray.get(refs): the ValueError loses 2.0 and 3.0
    ([2.0, None], 1.05, ["roots is [2.0, None, 3.0]"]),  # one try around the loop of ray.get: it stops at -1
    ([2.0, None, 3.0], 2.05, ["the two roots were computed"]),  # ray.get(checked_sqrt.remote(x)) per x
    ([2.0, None, 3.0], 0.01, ["the two roots were computed"]),  # roots = [2.0, None, 3.0], typed: nothing ran
])
def test_lesson_00_exercise_2_fails_on_one_get_for_all_or_tasks_run_one_by_one(capsys, roots, elapsed_s, wrong):
    """Each root takes 1 s and -1 raises at once: on 2 CPUs the solution takes 1 s, a submit-then-get loop 2 s."""
    results = run_check_cell("00_ray_core.ipynb", "exercise_2",
                             {"roots": roots, "elapsed_s": elapsed_s, "num_cpus": 2}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 01 · exercise 1: the same short run at another learning rate ----------------------------------------------

SHORT_CONFIG = {"num_epochs": 1, "max_steps_per_epoch": 10, "max_test_batches": 2, "lr": 1e-3, "seed": 0}


@pytest.mark.parametrize("slow_config,slow_acc,wrong", [
    ({**SHORT_CONFIG, "lr": 1e-5}, 0.31, []),
    ({**SHORT_CONFIG, "lr": 1e-4}, 0.62, ["slow_config is short_config with lr 1e-5"]),  # another learning rate
    ({"lr": 1e-5}, 0.11, ["slow_config is short_config with lr 1e-5"]),  # the lr alone: the other settings lost
    ({**SHORT_CONFIG, "lr": 1e-5}, 0.95, ["lr 1e-3 reaches the higher test accuracy"]),  # slow ran another config
])
def test_lesson_01_exercise_1_fails_on_another_learning_rate_or_config(capsys, slow_config, slow_acc, wrong):
    results = run_check_cell("01_single_gpu_pytorch.ipynb", "exercise_1",
                             {"short_config": SHORT_CONFIG, "slow_config": slow_config, "fast": {"test_acc": 0.80},
                              "slow": {"test_acc": slow_acc}}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 01 · exercise 2: a resumable checkpoint holds the optimizer's state and the epoch, not only the weights -------

def resumed(save_optimizer: bool, return_epoch: bool) -> dict[str, Any]:
    """Two small models and Adam optimizers, as the exercise's cell has them: a, one step trained, saved and loaded
    into a fresh b by an answer that keeps the optimizer's state or not, and returns the epoch or not."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model_a, model_b = nn.Linear(4, 2), nn.Linear(4, 2)
    optimizer_a = torch.optim.Adam(model_a.parameters(), lr=1e-3)
    optimizer_b = torch.optim.Adam(model_b.parameters(), lr=1e-3)
    model_a(torch.randn(8, 4)).sum().backward()
    optimizer_a.step()
    state = {"model": model_a.state_dict(), "epoch": 1,
             **({"optimizer": optimizer_a.state_dict()} if save_optimizer else {})}
    model_b.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer_b.load_state_dict(state["optimizer"])
    return {"torch": torch, "model_a": model_a, "model_b": model_b, "optimizer_a": optimizer_a,
            "optimizer_b": optimizer_b, "resumed_epoch": state["epoch"] if return_epoch else None}


@pytest.mark.parametrize("save_optimizer,return_epoch,wrong", [
    (True, True, []),
    (False, True, ["optimizer_b has optimizer_a's steps and moments"]),  # the weights alone: Adam starts over
    (True, False, ["load_resumable returned the epoch, 1"]),  # loads both states, forgets to return the epoch
])
def test_lesson_01_exercise_2_fails_when_the_optimizer_or_the_epoch_is_not_resumed(capsys, save_optimizer,
                                                                                    return_epoch, wrong):
    results = run_check_cell("01_single_gpu_pytorch.ipynb", "exercise_2", resumed(save_optimizer, return_epoch),
                             capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 02 · exercise 1: one worker's steps per epoch: its shard of the data, at its share of the global batch ------

@pytest.mark.parametrize("answer,fails", [
    ("math.ceil(math.ceil(60_000 / num_workers) / (global_batch_size // num_workers))", False),
    ("math.ceil(60_000 / global_batch_size)", True),  # the global batch over the whole dataset: every worker's steps
    ("math.ceil(60_000 / num_workers / global_batch_size)", True),  # the shard at the global batch size
    ("60_000 // num_workers // (global_batch_size // num_workers)", True),  # drops the last, smaller batch
])
def test_lesson_02_exercise_1_fails_on_the_global_batch_or_a_dropped_last_batch(capsys, answer, fails):
    import math

    from torch.utils.data import DataLoader

    namespace: dict[str, Any] = {"math": math, "DataLoader": DataLoader}
    define(namespace, "steps_per_epoch(num_workers, global_batch_size)", answer)
    results = run_check_cell("02_ray_train_ddp.ipynb", "exercise_1", namespace, capsys)
    assert bool(failed(results)) == fails, results


# ---- 02 · exercise 2: a round is kept when any rank attaches a checkpoint, with rank 0's metrics ----------------

@pytest.mark.parametrize("metrics,rows,wrong", [
    ({"step": 1, "rank": 0}, 1, []),
    (None, 0, ["predicted_metrics is result.metrics",  # "only rank 0's checkpoints count"
               "predicted_rows is the number of rows of result.metrics_dataframe"]),
    ({"step": 1, "rank": 1}, 1, ["predicted_metrics is result.metrics"]),  # the rank with the checkpoint's metrics
    ({"step": 2, "rank": 0}, 3, ["predicted_metrics is result.metrics",  # every round kept, the last one's metrics
                                 "predicted_rows is the number of rows of result.metrics_dataframe"]),
])
def test_lesson_02_exercise_2_fails_on_rank_1_s_metrics_or_every_round_kept(capsys, metrics, rows, wrong):
    import pandas as pd

    # What the lesson's two-worker run gives (its recorded output): the second round, with rank 0's metrics.
    kept = SimpleNamespace(metrics={"step": 1, "rank": 0}, metrics_dataframe=pd.DataFrame([{"step": 1, "rank": 0}]))
    results = run_check_cell("02_ray_train_ddp.ipynb", "exercise_2",
                             {"predicted_metrics": metrics, "predicted_rows": rows, "rank_1_result": kept}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 02 · exercise 3: local mode hands over the loop's own exception, not Ray Train's TrainingFailedError ---------

@pytest.mark.parametrize("caught,wrong", [
    (KeyError("lr"), []),
    (..., ["caught is an exception", "it is the loop's own exception, not Ray Train's TrainingFailedError",
           "it names the missing key"]),  # the stub, unsolved
    ("with workers", ["it is the loop's own exception, not Ray Train's TrainingFailedError"]),
])
def test_lesson_02_exercise_3_fails_on_the_stub_and_on_the_error_of_a_run_with_workers(capsys, caught, wrong):
    from ray.train import TrainingFailedError, WorkerGroupError

    if caught == "with workers":  # what fit() raises when the KeyError happens in a worker
        caught = WorkerGroupError("Training failed: KeyError: 'lr'", {0: KeyError("lr")})
    results = run_check_cell("02_ray_train_ddp.ipynb", "exercise_3",
                             {"caught": caught, "TrainingFailedError": TrainingFailedError}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 04 · exercise 1: the latest checkpoint stays on disk, whatever its score ----------------------------------

def kept_epochs_best_only(scores: list[float], num_to_keep: int) -> set[int]:
    return set(sorted(range(len(scores)), key=lambda epoch: scores[epoch])[-num_to_keep:])  # forgets the latest


def kept_epochs_with_latest(scores: list[float], num_to_keep: int) -> set[int]:
    return kept_epochs_best_only(scores, num_to_keep) | {len(scores) - 1}


@pytest.mark.parametrize("answer,wrong", [
    (kept_epochs_with_latest, []),
    (kept_epochs_best_only, [
        "kept_epochs([0.97, 0.99, 0.95, 0.98, 0.96], 2) is the set of epochs on disk after the run",
        "kept_epochs([0.90, 0.95, 0.80], 2) is {0, 1, 2}: the two best and the latest"]),
])
def test_lesson_04_exercise_1_fails_when_the_latest_checkpoint_is_forgotten(capsys, answer, wrong):
    # The lesson's run keeps epochs {1, 3, 4} of these scores (its recorded output): the best two and the latest.
    results = run_check_cell("04_checkpoints_and_results.ipynb", "exercise_1",
                             {"kept_epochs": answer, "scores": [0.97, 0.99, 0.95, 0.98, 0.96], "keep": 2,
                              "scores_on_disk": {1, 3, 4}}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 04 · exercise 2: the lowest test_loss among the checkpoints on disk, from the run folder alone ---------------

#: Lesson 04's recorded runs, as their folders hold them: each report's checkpoint folder and metrics, and the epochs
#: still on disk. The lesson's run keeps the best by test_acc (num_to_keep=1) and the latest; exercise 1's run the
#: best two and the latest.
LESSON_RUN = [(f"checkpoint_2026-11-29_00-{time}", {"epoch": epoch, "test_loss": loss, "test_acc": acc})
              for epoch, (time, loss, acc) in enumerate([("50-43.326304", 0.0471, 0.9853),
                                                         ("52-37.220383", 0.0393, 0.9878),
                                                         ("54-28.088973", 0.0593, 0.9823)])]
LESSON_RUN_ON_DISK = [1, 2]
SCORES_RUN = [(f"checkpoint_2026-11-29_00-56-{19 + 2 * epoch:02d}.000000",
               {"epoch": epoch, "test_acc": acc, "test_loss": loss})
              for epoch, (acc, loss) in enumerate(zip([0.97, 0.99, 0.95, 0.98, 0.96], [0.10, 0.40, 0.50, 0.20, 0.30]))]
SCORES_RUN_ON_DISK = [1, 3, 4]


@pytest.fixture(scope="module")
def lesson_04_runs(tmp_path_factory) -> dict[str, Any]:
    """What exercise 2's check reads of lesson 04: its run's `result` and history `reports`, and exercise 1's run,
    `scores_run`, with `on_disk_now`; the Results are rebuilt from their folders (the check reads only `path` and
    `filesystem` of those that fit() returned)."""
    from ray.train import Result

    from helpers.results import read_history

    storage = tmp_path_factory.mktemp("runs")
    write_run_folder(storage / "04_checkpoints", LESSON_RUN, LESSON_RUN_ON_DISK, history=True)
    write_run_folder(storage / "04_scores", SCORES_RUN, SCORES_RUN_ON_DISK, history=False)
    history = read_history(str(storage / "04_checkpoints"))
    scores_run = Result.from_path(str(storage / "04_scores"))
    return {"Path": Path, "result": Result.from_path(str(storage / "04_checkpoints")),
            "reports": history[history["event"] == "report"].copy(), "scores_run": scores_run,
            "on_disk_now": Result.from_path(scores_run.path, storage_filesystem=scores_run.filesystem),
            "losses": [metrics["test_loss"] for _, metrics in SCORES_RUN], "scores_on_disk": set(SCORES_RUN_ON_DISK)}


def lowest_loss_path(path: str, filesystem) -> str:  # the solution
    from ray.train import Result

    restored = Result.from_path(path, storage_filesystem=filesystem)
    return restored.get_best_checkpoint(metric="test_loss", mode="min").path


def lowest_loss_checkpoint(path: str, filesystem):
    from ray.train import Result

    return Result.from_path(path, storage_filesystem=filesystem).get_best_checkpoint(metric="test_loss", mode="min")


def highest_loss_path(path: str, filesystem) -> str:  # mode="max", as the run's CheckpointConfig ranks test_acc
    from ray.train import Result

    restored = Result.from_path(path, storage_filesystem=filesystem)
    return restored.get_best_checkpoint(metric="test_loss", mode="max").path


def best_test_acc_path(path: str, filesystem) -> str:  # section 05's call, unchanged: the run's score, not the loss
    from ray.train import Result

    restored = Result.from_path(path, storage_filesystem=filesystem)
    return restored.get_best_checkpoint(metric="test_acc", mode="max").path


def latest_checkpoint_path(path: str, filesystem) -> str:  # result.checkpoint: the latest, whatever its loss
    from ray.train import Result

    return Result.from_path(path, storage_filesystem=filesystem).checkpoint.path


def lowest_loss_in_history(path: str, filesystem) -> str:  # the course's history: deleted checkpoints included
    from helpers.results import read_history

    history = read_history(path)
    reports = history[history["event"] == "report"]
    return f"{path}/{reports.loc[reports['test_loss'].idxmin(), 'checkpoint']}"


IN_LESSON_RUN = "in this lesson's run: the checkpoint on disk with the lowest test_loss"


@pytest.mark.parametrize("answer,wrong", [
    (lowest_loss_path, []),
    (lowest_loss_checkpoint, ["lowest_loss_path returns a path", IN_LESSON_RUN, "in exercise 1's run"]),
    (highest_loss_path, [IN_LESSON_RUN, "in exercise 1's run"]),
    (latest_checkpoint_path, [IN_LESSON_RUN, "in exercise 1's run"]),
    (lowest_loss_in_history, ["in exercise 1's run"]),  # exercise 1's run has no history: FileNotFoundError
    (best_test_acc_path, ["in exercise 1's run"]),  # its best by test_acc, epoch 1, is not its lowest loss on disk
])
def test_lesson_04_exercise_2_fails_on_the_highest_loss_the_latest_a_checkpoint_off_disk_or_the_best_score(
        lesson_04_runs, capsys, answer, wrong):
    results = run_check_cell("04_checkpoints_and_results.ipynb", "exercise_2",
                             {**lesson_04_runs, "lowest_loss_path": answer}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 04 · exercise 3: the second *most* likely digit, and the share among the mistakes only ---------------------

TOP2_PREDICTOR = """
class Top2Predictor(MNISTPredictor):
    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        images = torch.tensor(batch["image"], device=self.device)
        top2 = self.model(images).topk(2, dim=1).indices.cpu().numpy()
        batch["prediction"], batch["second"] = top2[:, 0], top2[:, 1]
        return batch"""
SHARE_OF_MISTAKES = "(mistakes.label == mistakes.second).mean()"  # mistakes = top2[top2.label != top2.prediction]


@pytest.fixture(scope="module")
def lesson_04_predictions(tmp_path_factory) -> dict[str, Any]:
    """`best`, a checkpoint folder with a ResNet-18's model.pt (untrained: the check compares the predictor with the
    checkpoint's own logits); 16 images whose labels are its first guess for half of them, its second guess for a
    quarter and its third for the rest: 8 mistakes, half of them with the second guess right; and `results`, section
    09's predictions of MNISTPredictor over them."""
    import numpy as np
    import torch
    from ray.train import Checkpoint

    from helpers.inference import MNISTPredictor, load_model
    from helpers.models import resnet18_mnist

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("best")
    torch.save(resnet18_mnist().state_dict(), folder / "model.pt")
    best = Checkpoint.from_directory(str(folder))
    images = torch.randn(16, 1, 28, 28).numpy()
    with torch.no_grad():
        ranked = load_model(best)(torch.from_numpy(images)).topk(3, dim=1).indices.numpy()
    labels = ranked[np.arange(16), [(0, 0, 1, 2)[i % 4] for i in range(16)]]
    return {"best": best, "images": images, "labels": labels,
            "results": map_batches(MNISTPredictor, best, images, labels)}


def map_batches(predictor_class: type, best, images, labels) -> pd.DataFrame:
    """What datasets["valid"].map_batches(predictor_class, batch_size=512, compute=ActorPoolStrategy(...)) gives for
    these images, without Ray Data: the class built once, called on a batch of NumPy arrays; as a DataFrame."""
    import pandas as pd

    batch = predictor_class(best)({"image": images.copy(), "label": labels.copy()})
    return pd.DataFrame({key: value for key, value in batch.items() if key != "image"})


@pytest.mark.parametrize("predictor,rows,share,wrong", [
    (TOP2_PREDICTOR, 16, SHARE_OF_MISTAKES, []),
    (TOP2_PREDICTOR.replace(".topk(2, dim=1).indices", ".argsort(dim=1)[:, [-1, 1]]"),  # argmax, then the second
     16, SHARE_OF_MISTAKES, ["Top2Predictor gives the model's two best guesses"]),  # from the wrong end: least likely
    (TOP2_PREDICTOR, 8, SHARE_OF_MISTAKES,  # take_batch or a limit: part of datasets["valid"]
     ["top2 has section 09's mistakes, no more, no fewer"]),
    (TOP2_PREDICTOR, 16, "(top2.label == top2.second).mean()",  # among every image: 4 of 16, not 4 of 8
     ["second_guess_share is the share of mistakes whose label is second"]),
    (TOP2_PREDICTOR, 16, "100 * " + SHARE_OF_MISTAKES,  # a percentage, 50.0, not a share from 0 to 1
     ["second_guess_share is the share of mistakes whose label is second"]),
])
def test_lesson_04_exercise_3_fails_on_the_least_likely_digit_part_of_the_data_or_a_share_of_every_image(
        lesson_04_predictions, capsys, predictor, rows, share, wrong):
    import torch

    from helpers.inference import MNISTPredictor

    best, images, labels = (lesson_04_predictions[key] for key in ("best", "images", "labels"))
    namespace: dict[str, Any] = {"torch": torch, "MNISTPredictor": MNISTPredictor, "best": best}
    exec(predictor, namespace)
    top2 = map_batches(namespace["Top2Predictor"], best, images[:rows], labels[:rows])
    # A stand-in for the Ray Dataset datasets["valid"]: the check only takes a batch of it, a dict of NumPy arrays.
    valid = SimpleNamespace(take_batch=lambda n: {"image": images[:n].copy(), "label": labels[:n].copy()})
    namespace.update({"datasets": {"valid": valid}, "results": lesson_04_predictions["results"], "top2": top2,
                      "second_guess_share": eval(share, {"top2": top2,
                                                         "mistakes": top2[top2.label != top2.prediction]})})
    results = run_check_cell("04_checkpoints_and_results.ipynb", "exercise_3", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 05 · exercise 1: fit() raises once the budget is 0, and the failure is at step 0 of epoch 1 on fail_rank -------

FAIL_RANK = 1  # scaling.num_workers - 1: 2 workers, as recorded


@pytest.mark.parametrize("failure,kept,wrong", [
    ((1, 0, FAIL_RANK), "the run's error", []),
    (None, None, ["fit() raised", "error is a ray.train.WorkerGroupError, the TrainingFailedError of failed workers",
                  "error.worker_failures holds rank 1 only",
                  "its exception is the InjectedFailure of epoch 1, step 0"]),
    ((1, 1, FAIL_RANK), "the run's error", ["its exception is the InjectedFailure of epoch 1, step 0"]),  # step 1
    ((1, 0, 0), "the run's error", ["error.worker_failures holds rank 1 only",  # rank 0 instead of fail_rank
                                    "its exception is the InjectedFailure of epoch 1, step 0"]),
    ((1, 0, FAIL_RANK), "the worker's exception", [  # error = caught.worker_failures[fail_rank]
        "error is a ray.train.WorkerGroupError, the TrainingFailedError of failed workers",
        "error.worker_failures holds rank 1 only", "its exception is the InjectedFailure of epoch 1, step 0"]),
])
def test_lesson_05_exercise_1_fails_when_fit_returns_or_on_another_step_rank_or_exception(capsys, failure, kept,
                                                                                           wrong):
    """No failure (None) is what the cell leaves when fit() returned: with_failure(..., step=2) as in section 03
    never fails on the small datasets' 2 steps per epoch, and section 03's max_failures=1 restarts the workers."""
    import ray
    import ray.train

    from helpers.fault_tolerance import InjectedFailure

    error: Exception | None = None
    if failure is not None:
        epoch, step, rank = failure
        message = f"rank {rank} fails on purpose at epoch {epoch}, step {step}"
        # What fit() raises with max_failures=0 (a stand-in for the run): a WorkerGroupError that maps the failed
        # rank to the loop's own exception; Ray Train keeps the worker's traceback in the message only.
        error = ray.train.WorkerGroupError(
            f"[Rank {rank} Error Snippet]:\nTraceback (most recent call last):\n  ...\n"
            f"helpers.fault_tolerance.InjectedFailure: {message}\n", {rank: InjectedFailure(message)})
        if kept == "the worker's exception":
            error = error.worker_failures[rank]
    results = run_check_cell("05_fault_tolerance.ipynb", "exercise_1",
                             {"error": error, "fail_rank": FAIL_RANK, "ray": ray}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 05 · exercise 2: each kind of failure against its own budget, -1 without limit, nothing after the first raise ---

DECISIONS = """
limits = {"worker": max_failures, "preemption": max_preemption_failures}
counts, decided = {"worker": 0, "preemption": 0}, []
for failure in failures:
    counts[failure] += 1
    over = limits[failure] != -1 and counts[failure] > limits[failure]
    decided.append("raise" if over else "retry")
    if over:
        break
return decided"""


@pytest.mark.parametrize("body,wrong", [
    (DECISIONS, []),
    (DECISIONS.replace("counts[failure]", 'counts["worker"]').replace("limits[failure]", "max_failures"),
     ["preemptions do not use max_failures",  # one count, one budget: every failure against max_failures
      "max_preemption_failures=1: the second preemption ends it"]),
    (DECISIONS.replace("] > limits", "] >= limits"),  # off by one: max_failures=1 retries no failure
     ["section 03: max_failures=1, one worker failure -> retry", "preemptions do not use max_failures",
      "max_preemption_failures=1: the second preemption ends it"]),
    (DECISIONS.replace("limits[failure] != -1 and ", ""),  # -1 read as a count: every failure is over it
     ["preemptions do not use max_failures", "-1 retries without limit"]),
    (DECISIONS.replace("    if over:\n        break\n", ""),  # goes on deciding after the run has ended
     ["max_preemption_failures=1: the second preemption ends it"]),
])
def test_lesson_05_exercise_2_fails_on_one_budget_an_off_by_one_minus_one_as_a_count_or_no_stop(capsys, body, wrong):
    namespace: dict[str, Any] = {}
    exec("def decisions(max_failures, max_preemption_failures, failures):\n"
         + "\n".join("    " + line for line in body.strip().splitlines()), namespace)
    results = run_check_cell("05_fault_tolerance.ipynb", "exercise_2", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 06 · exercise 1: a rank is in report only when a frame *is* report, not one whose name contains it ----------

LAB_A_RANK_0 = ["Worker.get_objects (ray/_private/worker.py:1007)", "report (ray/train/v2/api/train_fn_utils.py:125)",
                "report_on_rank_zero_only (3608596061.py:8)"]  # lab A's rank 0, cut short


@pytest.mark.parametrize("answer,wrong", [
    ('{rank for rank, frames in stacks.items() if any(frame.startswith("report (") for frame in frames)}', []),
    ('{rank for rank, frames in stacks.items() if any("report" in frame for frame in frames)}',
     ["a rank still in its own loop is not in report"]),  # report_on_rank_zero_only contains "report"
    ('{rank for rank, frames in stacks.items() if frames}',  # any rank with a training thread
     ["a rank still in its own loop is not in report", "a rank elsewhere in Ray Train is not in report"]),
])
def test_lesson_06_exercise_1_fails_on_a_frame_that_only_contains_report(capsys, answer, wrong):
    namespace: dict[str, Any] = {"stacks": {0: LAB_A_RANK_0, 1: []}}
    define(namespace, "ranks_in_report(stacks)", answer)
    results = run_check_cell("06_observability_and_troubleshooting.ipynb", "exercise_1", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 06 · exercise 2: a validation loss that keeps no graph --------------------------------------------------------

@pytest.mark.parametrize("answer,wrong", [
    ("torch.no_grad()(lambda: sum(F.cross_entropy(model(x), y).item() for x, y in batches) / len(batches))()", []),
    ("sum(F.cross_entropy(model(x), y).item() for x, y in batches) / len(batches)",  # .item() but a graph per batch
     ["builds no graph: autograd saves no tensor"]),
    ("float(sum(F.cross_entropy(model(x), y) for x, y in batches) / len(batches))",  # a tensor sum: all graphs kept
     ["builds no graph: autograd saves no tensor"]),
])
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True:UserWarning")  # the tensor-sum mistake
def test_lesson_06_exercise_2_fails_when_the_validation_builds_a_graph(capsys, answer, wrong):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)).eval()  # any model: the check counts saved tensors
    namespace: dict[str, Any] = {"torch": torch, "F": F, "model": model}
    define(namespace, "mean_validation_loss(model, batches)", answer)
    results = run_check_cell("06_observability_and_troubleshooting.ipynb", "exercise_2", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 06 · exercise 3: the timeout must cover the gap between ranks at one report, not an epoch -------------------

@pytest.mark.parametrize("answer,wrong", [
    ("max(max(times) - min(times) for times in zip(*arrivals.values()))", []),
    ("max(max(times) for times in arrivals.values()) - min(min(times) for times in arrivals.values())",  # whole run
     ["equal work: the spread of one report", "the longest epoch does not matter, the gap does",
      "three ranks, one slow at the second report"]),
    ("max(times[-1] - times[0] for times in arrivals.values())",  # the longest stretch of one rank: an epoch
     ["equal work: the spread of one report", "the longest epoch does not matter, the gap does",
      "three ranks, one slow at the second report"]),
    ("max(times[0] for times in arrivals.values()) - min(times[0] for times in arrivals.values())",  # first report only
     ["the longest epoch does not matter, the gap does", "three ranks, one slow at the second report"]),
])
def test_lesson_06_exercise_3_fails_on_an_epoch_or_the_first_report_alone(capsys, answer, wrong):
    namespace: dict[str, Any] = {}
    define(namespace, "shortest_safe_timeout(arrivals)", answer)
    results = run_check_cell("06_observability_and_troubleshooting.ipynb", "exercise_3", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 07 · exercise 3: the token must not reach curl's arguments, where `ps` shows them ----------------------------

@pytest.mark.parametrize("answer,token_seen", [
    ('f"curl --silent --fail -H @{header_file} {api_url}"', False),  # the solution: curl reads the file
    ('f"curl --silent --fail -H \\"$(cat {header_file})\\" {api_url}"', True),  # the shell puts the token in argv
    ('f"curl -H \\"Authorization: Bearer $(cat {header_file} | cut -d\' \' -f3)\\" {api_url}"', True),
])
def test_lesson_07_exercise_3_fails_when_the_token_reaches_curls_command_line(tmp_path, capsys, answer, token_seen):
    """`-H "$(cat file)"` never shows the token in the command the learner writes, but the shell expands it into
    curl's arguments."""
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef\n")
    namespace: dict[str, Any] = {"Path": Path, "cluster": SimpleNamespace(token_file=token_file),
                                 "api": "http://127.0.0.1:9/api/jobs/"}  # nothing listens there: not asserted
    define(namespace, "curl_command(api_url, header_file)", answer)
    results = run_check_cell("07_ray_jobs.ipynb", "exercise_3", namespace, capsys)
    shutil.rmtree(namespace["header_file"].parent)  # the cell made it, as in the lesson
    token_check = [what for what in failed(results) if what.startswith("the token is not in curl's arguments")]
    assert bool(token_check) == token_seen, results


# ---- 08 · exercise 1: a copy of the cluster, whose new group keeps the CPU group's storage, security and labels ------

LARGE = {"limits": {"cpu": "16", "memory": "64Gi"}, "requests": {"cpu": "16", "memory": "64Gi"}}
ADD_LARGE_GROUP = """
larger = copy.deepcopy(cluster)
large = copy.deepcopy(larger["spec"]["workerGroupSpecs"][0])
large.update(groupName="cpu-large", replicas=0, minReplicas=0, maxReplicas=2)
large["template"]["spec"]["containers"][0]["resources"] = LARGE
larger["spec"]["workerGroupSpecs"].append(large)
return larger"""
FROM_SCRATCH = """
larger = copy.deepcopy(cluster)
larger["spec"]["workerGroupSpecs"].append({
    "groupName": "cpu-large", "replicas": 0, "minReplicas": 0, "maxReplicas": 2, "rayStartParams": {},
    "template": {"spec": {"containers": [{"name": "ray-worker", "image": "ray-course:2.60.0-py311",
                                          "resources": LARGE}]}}})
return larger"""
PASSES = "the cluster passes the schema and the course's checks"


@pytest.mark.parametrize("body,wrong", [
    (ADD_LARGE_GROUP, []),
    (ADD_LARGE_GROUP.replace("copy.deepcopy(cluster)", "cluster"), ["the lesson's cluster is unchanged"]),  # in place
    (ADD_LARGE_GROUP.replace("copy.deepcopy(cluster)", "dict(cluster)"),  # a shallow copy: the same list of groups
     ["the lesson's cluster is unchanged"]),
    (ADD_LARGE_GROUP.replace('["resources"] = LARGE', '["resources"]["limits"] = LARGE["limits"]'),  # requests: 4
     ["cpu-large pods have 16 CPUs and 64Gi, requested and limited", PASSES]),
    (FROM_SCRATCH,  # a group written anew: no volume, securityContext or labels
     [PASSES, "the NetworkPolicy selects its pods"]),
])
def test_lesson_08_exercise_1_fails_on_the_lesson_s_cluster_changed_or_a_group_written_anew(capsys, body, wrong):
    from helpers.tooling import kuberay

    namespace: dict[str, Any] = {"copy": copy, "kuberay": kuberay, "LARGE": LARGE,
                                 "cluster": kuberay.load_manifest("raycluster.yaml"),
                                 "policy": kuberay.load_manifest("networkpolicy.yaml")}
    exec("def with_large_group(cluster):\n" + "\n".join("    " + line for line in body.strip().splitlines()), namespace)
    results = run_check_cell("08_kuberay.ipynb", "exercise_1", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 08 · exercise 2: OOMKilled is in the last state, the scheduler's message tells GPU from volume ----------------

DIAGNOSE = """
status = pod["status"]
for condition in status.get("conditions", []):
    if condition["type"] == "PodScheduled" and condition["status"] == "False":
        if "nvidia.com/gpu" in condition["message"]:
            return "gpu"
        if "PersistentVolumeClaim" in condition["message"]:
            return "volume"
for container in status.get("containerStatuses", []):
    waiting = container.get("state", {}).get("waiting", {}).get("reason")
    if waiting in ("ErrImagePull", "ImagePullBackOff"):
        return "image"
    if waiting == "CreateContainerConfigError":
        return "secret"
    if container.get("lastState", {}).get("terminated", {}).get("reason") == "OOMKilled":
        return "memory"
return None"""


@pytest.mark.parametrize("body,wrong", [
    (DIAGNOSE, []),
    (DIAGNOSE.replace('container.get("lastState"', 'container.get("state"'),  # the container runs again: not there
     ["the memory pod: 'memory'"]),
    (DIAGNOSE.replace('if "nvidia.com/gpu" in condition["message"]:', "if True:"),  # every unschedulable pod
     ["the volume pod: 'volume'"]),
    (DIAGNOSE.replace('in ("ErrImagePull", "ImagePullBackOff")', '== "ErrImagePull"'),  # not the back-off after it
     ["the image pod: 'image'"]),
])
def test_lesson_08_exercise_2_fails_on_the_current_state_or_any_unschedulable_pod(capsys, body, wrong):
    from helpers.tooling import kuberay

    namespace: dict[str, Any] = {"kuberay": kuberay}
    exec("def diagnose(pod):\n" + "\n".join("    " + line for line in body.strip().splitlines()), namespace)
    results = run_check_cell("08_kuberay.ipynb", "exercise_2", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 08 · exercise 3: one `from` entry with both selectors, in the Jobs API's rule ---------------------------------

NOTEBOOKS_NAMESPACE = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "notebooks"}}}
JUPYTER_PODS = {"podSelector": {"matchLabels": {"app": "jupyter"}}}


UNCHANGED = "the lesson's policy is unchanged"


@pytest.mark.parametrize("peers,own_rule,wrong", [
    ([{**NOTEBOOKS_NAMESPACE, **JUPYTER_PODS}], False, []),
    ([{**NOTEBOOKS_NAMESPACE, **JUPYTER_PODS}], "in place", [UNCHANGED]),  # the lesson's policy, changed and returned
    ([NOTEBOOKS_NAMESPACE, JUPYTER_PODS], False,  # two entries: either matches, every pod of notebooks
     ["another pod in notebooks does not reach the Jobs API"]),
    ([JUPYTER_PODS], False, ["a JupyterLab pod in notebooks reaches the Jobs API"]),  # the policy's namespace only
    ([{"namespaceSelector": {}, **JUPYTER_PODS}], False,  # {}: every namespace
     ["an app=jupyter pod in another namespace does not either"]),
    ([{**NOTEBOOKS_NAMESPACE, **JUPYTER_PODS}], True, ["it does not reach the GCS"]),  # a rule of its own: every port
])
def test_lesson_08_exercise_3_fails_on_two_entries_a_pod_selector_alone_or_every_port(capsys, peers, own_rule, wrong):
    from helpers.tooling import kuberay

    def admit_jupyter(policy: dict) -> dict:
        wider = policy if own_rule == "in place" else copy.deepcopy(policy)
        if own_rule is True:
            wider["spec"]["ingress"].append({"from": copy.deepcopy(peers)})
        else:
            wider["spec"]["ingress"][1]["from"].extend(copy.deepcopy(peers))
        return wider

    results = run_check_cell("08_kuberay.ipynb", "exercise_3",
                             {"kuberay": kuberay, "admit_jupyter": admit_jupyter, "copy": copy,
                              "policy": kuberay.load_manifest("networkpolicy.yaml")}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 10 · exercise 1: a fit()'s rest, round by round, then the median; not a difference of medians ----------------

def _median_of(parts: dict, field: str) -> float:
    return statistics.median(parts[field]["rounds"])


def _rests(parts: dict, fields: tuple[str, ...] = ("fit_s", "epochs_s", "worker_group_total")) -> list[float]:
    """Each round's first field minus its others."""
    return [first - sum(others) for first, *others in zip(*(parts[field]["rounds"] for field in fields))]


@pytest.mark.parametrize("answer,wrong", [
    (lambda parts: statistics.median(_rests(parts)), []),
    # the medians of the three figures, subtracted: each median comes from another round
    (lambda parts: _median_of(parts, "fit_s") - _median_of(parts, "epochs_s") - _median_of(parts, "worker_group_total"),
     ["rest_s['ray_train_1_worker']", "rest_s['ray_train_2_workers']"]),
    # fit minus training, start-up left in
    (lambda parts: statistics.median(_rests(parts, ("fit_s", "epochs_s"))),
     ["rest_s['ray_train_1_worker']", "rest_s['ray_train_2_workers']"]),
    # the mean of the rounds, not the median
    (lambda parts: statistics.mean(_rests(parts)), ["rest_s['ray_train_1_worker']", "rest_s['ray_train_2_workers']"]),
])
def test_lesson_10_exercise_1_fails_on_a_difference_of_medians_the_start_up_left_in_or_a_mean(capsys, answer, wrong):
    """Fed the benchmark report the lesson reads (results/bench.json), whose five rounds make each mistake differ
    from the answer by 0.2 s or more."""
    from helpers.tooling import bench
    ddp = bench.recorded_report()["ddp"]
    namespace: dict[str, Any] = {"bench": bench, "ddp": ddp,
                                 "rest_s": {name: answer(parts) for name, parts in ddp["fit"].items()}}
    results = run_check_source(exercise_check_cell("10_performance.ipynb", "1"), namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 10 · exercise 2: the share of the all-reduce hidden behind backward, not the share left waiting --------------

#: Lesson 10's recorded phase table (ms per step, the median round of 5), the all-reduce columns and the step.
PHASES_10 = {"ResNet-18 · 1 worker": (0.0, 0.0, 980.7), "ResNet-18 · 2 workers · rank 0": (34.0, 170.4, 891.0),
             "ResNet-18 · 2 workers · rank 1": (62.0, 199.8, 895.5), "ViT · 1 worker": (0.0, 0.0, 10311.1),
             "ViT · 2 workers · rank 0": (164.7, 928.4, 8581.0), "ViT · 2 workers · rank 1": (266.1, 1068.6, 8581.5)}
TWO_WORKER_ROWS = [f"hidden[{row!r}]" for row in PHASES_10 if "2 workers" in row]


@pytest.mark.parametrize("answer,wrong", [
    ("{row: 1 - two['allreduce_wait'][row] / two['allreduce_total'][row] for row in two.index}", []),
    # the share the step waited for: what was not hidden
    ("{row: two['allreduce_wait'][row] / two['allreduce_total'][row] for row in two.index}", TWO_WORKER_ROWS),
    # the wait over the whole step
    ("{row: 1 - two['allreduce_wait'][row] / two['step'][row] for row in two.index}", TWO_WORKER_ROWS),
    # rank 0 only: the other ranks' rows are missing
    ("{row: 1 - two['allreduce_wait'][row] / two['allreduce_total'][row] for row in two.index if 'rank 0' in row}",
     TWO_WORKER_ROWS[1::2]),
])
def test_lesson_10_exercise_2_fails_on_the_exposed_share_another_denominator_or_rank_0_alone(capsys, answer, wrong):
    import pandas as pd

    from helpers import profiling
    phases = pd.DataFrame.from_dict(PHASES_10, orient="index", columns=["allreduce_wait", "allreduce_total", "step"])
    two = phases[phases.index.str.contains("2 workers")]
    namespace: dict[str, Any] = {"phases": phases, "profiling": profiling, "hidden": eval(answer, {"two": two})}
    results = run_check_source(exercise_check_cell("10_performance.ipynb", "2"), namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 10 · exercise 3: one rank fed by a DataLoader worker process waits far less than in the loop -------------------

IN_THE_LOOP = [[{"data_wait": wait, "step": 335.0}] for wait in (134.5, 137.3, 140.1, 143.6, 138.0)]  # 40-43%


@pytest.mark.parametrize("with_loader_workers,wrong", [
    ([{"data_wait": 2.9, "step": 231.0}], []),  # DATA_CPUS (1 here) loader workers: 1% of the step
    ([{"data_wait": 136.2, "step": 334.6}], ["data_wait fell below half of the in-loop profile's"]),  # loader_workers=0
    ([{"data_wait": 2.6, "step": 250.2}, {"data_wait": 2.9, "step": 250.3}],  # 2 workers: not the in-loop run's size
     ["a profile of one rank came back"]),
    ([{"data_wait": 80.1, "step": 280.0}], ["data_wait fell below half of the in-loop profile's"]),  # a small gain
])
def test_lesson_10_exercise_3_fails_when_the_loader_gets_no_worker_process_or_the_run_two_ranks(capsys,
                                                                                              with_loader_workers,
                                                                                              wrong):
    namespace: dict[str, Any] = {"bottleneck": {"per image, in the loop": IN_THE_LOOP},
                                 "with_loader_workers": with_loader_workers}
    results = run_check_source(exercise_check_cell("10_performance.ipynb", "3"), namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 11 · exercise 1: a trial's workers each fit on one node; the cluster's total CPUs over-count ---------------

def trials_at_once_per_node(node_cpus: list[float], workers_per_trial: int, cpus_per_worker: float) -> int:
    return sum(int(cpus // cpus_per_worker) for cpus in node_cpus) // workers_per_trial


def trials_at_once_cluster_total(node_cpus: list[float], workers_per_trial: int, cpus_per_worker: float) -> int:
    return int(sum(node_cpus) // cpus_per_worker) // workers_per_trial  # as if a worker could span nodes


@pytest.mark.parametrize("answer,passes", [(trials_at_once_per_node, True), (trials_at_once_cluster_total, False)])
def test_lesson_11_exercise_1_fails_on_the_cluster_total(capsys, answer, passes):
    from ray.train import ScalingConfig  # the lesson's earlier cells import it

    results = run_check_cell("11_hyperparameter_search.ipynb", "exercise_1",
                             {"trials_at_once": answer, "ScalingConfig": ScalingConfig}, capsys)
    assert all(results.values()) == passes, results
    if not passes:  # ([3, 3], 1, 2): 3 trials by the total, 2 by whole workers per node
        assert failed(results)[0].endswith("(AssertionError: got [2, 2, 1, 5, 1, 3])"), results


# ---- 11 · exercise 2: below the 1 - 1/reduction_factor quantile of the earlier values; the first one goes on -------

def asha_decisions_stand_in():
    """Stands in for lesson 11's `decisions` (helpers.tuning.asha_decisions on the search's history): its rows as
    that replay makes them, values in the manner of the recorded search, each decision Ray's ASHA rule (reduction
    factor 2: a value below the median of the earlier values stops). The last rows are ends at max_t, no rung."""
    import pandas as pd

    rows = [("00001", 1, 0.959, 1, [], "continue"), ("00000", 1, 0.946, 1, [0.959], "stop"),
            ("00004", 1, 0.955, 1, [0.959, 0.946], "continue"), ("00002", 1, 0.930, 1, [0.959, 0.946, 0.955], "stop"),
            ("00001", 2, 0.937, 2, [], "continue"), ("00004", 2, 0.950, 2, [0.937], "continue"),
            ("00001", 3, 0.963, None, None, "end (max_t)"), ("00004", 3, 0.955, None, None, "end (max_t)")]
    return pd.DataFrame([{"trial_id": trial, "epoch": epoch, "test_acc": value, "rung": rung, "earlier": earlier,
                          "decision": decision} for trial, epoch, value, rung, earlier, decision in rows])


ASHA_STOPS = "bool(earlier) and value < np.nanpercentile(earlier, (1 - 1 / reduction_factor) * 100)"
QUANTILE_75 = "reduction_factor=4: below the 75th percentile stops"


@pytest.mark.parametrize("answer,wrong", [
    (ASHA_STOPS, []),
    (ASHA_STOPS.replace("value <", "value <="), ["at the cutoff, not below it: go on"]),  # stops at the cutoff
    (ASHA_STOPS.replace("(1 - 1 / reduction_factor) * 100", "50"), [QUANTILE_75]),  # the median, whatever the factor
    (ASHA_STOPS.replace("(1 - 1 / reduction_factor)", "(1 / reduction_factor)"), [QUANTILE_75]),  # the 25th for 4
    (ASHA_STOPS.replace("nanpercentile(earlier", "nanpercentile(earlier + [value]"),  # its own value counted
     ["below the median of the earlier values: stop", QUANTILE_75]),
    (ASHA_STOPS.replace("bool(earlier) and ", "").replace("nanpercentile", "percentile"),  # no first-trial case:
     ["the first trial at a rung goes on",  # np.percentile([]) raises IndexError
      "every decision this search's ASHA made at a rung"]),
])
def test_lesson_11_exercise_2_fails_at_the_cutoff_on_the_median_alone_or_on_the_first_trial(capsys, answer, wrong):
    import numpy as np

    namespace: dict[str, Any] = {"np": np, "decisions": asha_decisions_stand_in()}
    define(namespace, "asha_stops(earlier, value, reduction_factor)", answer)
    results = run_check_cell("11_hyperparameter_search.ipynb", "exercise_2", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 11 · exercise 3: the best epoch of any trial, not the best trial's last; that epoch's own checkpoint -----------

# Each trial's test_acc per epoch. RECORDED is shaped like a recorded search of the lesson (its trial table's last
# values; earlier epochs made up, below them): its best epoch, 00001's last (0.963), is also the best trial's last. In
# MID_RUN_BEST, another search's, the best epoch is 00000's second (0.951), the best trial by its last result 00001.
RECORDED = {"00000": [0.921, 0.946], "00001": [0.902, 0.941, 0.957, 0.963], "00002": [0.845, 0.857, 0.859],
            "00004": [0.897, 0.936, 0.950, 0.955]}
MID_RUN_BEST = {"00000": [0.912, 0.951, 0.944], "00001": [0.905, 0.937, 0.948], "00002": [0.861, 0.899]}


def lesson_11_results(tmp_path: Path, curves: dict[str, list[float]]) -> dict[str, Any]:
    """Stand-ins for what lesson 11's cells leave: `history` (trial_histories: one row per result, with its
    checkpoint), `best` (results.get_best_result(): the trial with the best *last* test_acc, its last result),
    `valid_accuracy` (the predictor over the test images; here the test_acc the checkpoint's epoch reported, which
    section 08's check shows it reproduces within 1e-3), and section 08's `accuracy`, the best result's checkpoint's."""
    import pandas as pd
    import pyarrow.fs
    from ray.train import Checkpoint

    history = pd.DataFrame([{"trial_id": trial, "epoch": epoch, "test_acc": test_acc,
                             "checkpoint_path": str(tmp_path / f"search-{trial}" / f"checkpoint_00000{epoch}")}
                            for trial, curve in curves.items() for epoch, test_acc in enumerate(curve)])
    accuracy_by_path = dict(zip(history["checkpoint_path"], history["test_acc"]))

    def valid_accuracy(checkpoint: Checkpoint) -> float:
        return accuracy_by_path[checkpoint.path]

    filesystem = pyarrow.fs.LocalFileSystem()
    best_trial = max(curves, key=lambda trial: curves[trial][-1])
    best = SimpleNamespace(metrics=history[history["trial_id"] == best_trial].iloc[-1].to_dict())
    return {"pd": pd, "Checkpoint": Checkpoint, "filesystem": filesystem, "history": history, "best": best,
            "valid_accuracy": valid_accuracy,
            "accuracy": valid_accuracy(Checkpoint(best.metrics["checkpoint_path"], filesystem=filesystem))}


BEST_EPOCH = 'history.loc[history["test_acc"].idxmax()]'  # the solution's body of best_epoch(history)
#: The best trial by its last result, and that result: what results.get_best_result() gives.
BEST_TRIALS_LAST = 'history[history["trial_id"] == history.groupby("trial_id")["test_acc"].last().idxmax()].iloc[-1]'
ITS_ACCURACY = 'valid_accuracy(Checkpoint(best_row["checkpoint_path"], filesystem=filesystem))'
SERIES = "best_epoch returns one row, a pd.Series"
TOY_RIGHT = "best_epoch(toy) is trial a's epoch 1, not the best trial's last"
BEST_ROW_RIGHT = "best_row is a row of history with the highest test_acc"
ACCURACY_RIGHT = "best_epoch_accuracy reproduces that row's test_acc"


@pytest.mark.parametrize("curves,body,best_epoch_accuracy,wrong", [
    (RECORDED, BEST_EPOCH, ITS_ACCURACY, []),
    (RECORDED, BEST_TRIALS_LAST, "accuracy", [TOY_RIGHT]),  # passes on this search's numbers, not on the toy's
    (RECORDED, "...", "...", [SERIES, TOY_RIGHT, BEST_ROW_RIGHT, ACCURACY_RIGHT]),  # the stub
    (MID_RUN_BEST, BEST_EPOCH, ITS_ACCURACY, []),
    (MID_RUN_BEST, BEST_TRIALS_LAST, ITS_ACCURACY, [TOY_RIGHT, BEST_ROW_RIGHT]),
    (MID_RUN_BEST, BEST_EPOCH, "accuracy", [ACCURACY_RIGHT]),  # the best trial's last checkpoint, section 08's accuracy
])
def test_lesson_11_exercise_3_fails_on_the_best_trial_s_last_result_or_checkpoint(tmp_path, capsys, curves, body,
                                                                                   best_epoch_accuracy, wrong):
    namespace = lesson_11_results(tmp_path, curves)
    define(namespace, "best_epoch(history)", body)
    exec(f"best_row = best_epoch(history)\nbest_epoch_accuracy = {best_epoch_accuracy}\n", namespace)
    results = run_check_cell("11_hyperparameter_search.ipynb", "exercise_3", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results
# ---- 12 · exercise 1: the global batch stays the same with micro-batches, not only with more workers ---------------

@pytest.mark.parametrize("answer,wrong", [
    ("global_batch_size // (num_workers * accumulation_steps)", []),
    ("global_batch_size // num_workers", ["on 2 workers with 2 micro-batches per step: 32",  # micro-batches ignored
                                          "on 4 workers with 4 micro-batches per step: 8"]),
    ("global_batch_size / (num_workers * accumulation_steps)", ["a whole number of images, an int"]),  # 32.0
])
def test_lesson_12_exercise_1_fails_when_micro_batches_are_ignored(capsys, answer, wrong):
    namespace: dict[str, Any] = {}
    define(namespace, "batch_size_per_worker(global_batch_size, num_workers, accumulation_steps)", answer)
    results = run_check_cell("12_fsdp.ipynb", "exercise_1", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 12 · exercise 2: each block its own unit, and the root; the policy passed on -----------------------------

SHARD_EACH_BLOCK_AND_ROOT = """
for block in model.blocks:
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)"""


@pytest.mark.parametrize("body,wrong", [
    (SHARD_EACH_BLOCK_AND_ROOT, []),
    ("fully_shard(model, mp_policy=policy)",  # one unit: the whole model gathered at once
     ["every block is gathered on its own: fully_shard on each block"]),
    ("for block in model.blocks:\n    fully_shard(block, mp_policy=policy)",  # embed, norm and head left whole,
     ["the root is sharded too, so embed, norm and head are split",  # and in float32: the head gets bf16 inputs
      "forward runs in the policy's bfloat16"]),
    (SHARD_EACH_BLOCK_AND_ROOT.replace(", mp_policy=policy", ""), ["forward runs in the policy's bfloat16"]),
])
def test_lesson_12_exercise_2_fails_on_one_unit_a_missing_root_or_a_dropped_policy(capsys, body, wrong):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from helpers.sharding import ResidualMLP

    namespace: dict[str, Any] = {"torch": torch, "MixedPrecisionPolicy": MixedPrecisionPolicy,
                                 "fully_shard": fully_shard, "ResidualMLP": ResidualMLP,
                                 "model_config": {"width": 16, "depth": 2}}
    exec("def shard(model, policy):\n" + "\n".join("    " + line for line in body.strip().splitlines()), namespace)
    results = run_check_cell("12_fsdp.ipynb", "exercise_2", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


# ---- 12 · exercise 3: accumulate without a reduce-scatter per micro-batch, with the whole batch's gradient --------

TRAIN_STEP = """
for i, (images, labels) in enumerate(group):
    model.set_requires_gradient_sync(i == len(group) - 1)
    loss = nn.functional.cross_entropy(model(images), labels) / len(group)
    loss.backward()
optimizer.step()
optimizer.zero_grad()"""
GRADIENT = "the step's gradient equals the whole batch's: divide each loss by the number of micro-batches"


@pytest.mark.parametrize("body,wrong", [
    (TRAIN_STEP, []),
    (TRAIN_STEP.replace(" / len(group)", ""), [GRADIENT]),  # the sum of the micro-batches' gradients
    (TRAIN_STEP.replace("    model.set_requires_gradient_sync(i == len(group) - 1)\n", ""),  # a reduce per backward
     ["no unit reduce-scatters before the last micro-batch's backward"]),
    (TRAIN_STEP.replace("i == len(group) - 1", "i == len(group) - 1, recurse=False"),  # the root's unit only
     ["no unit reduce-scatters before the last micro-batch's backward"]),
    (TRAIN_STEP.replace("i == len(group) - 1", "False"),  # never reduced
     [GRADIENT, "every unit reduce-scatters in the last backward"]),
    (TRAIN_STEP.replace("optimizer.step()\noptimizer.zero_grad()", "").replace(  # a step per micro-batch
        "loss.backward()", "loss.backward()\n    optimizer.step()\n    optimizer.zero_grad()"),
     [GRADIENT, "one optimizer step"]),
])
def test_lesson_12_exercise_3_fails_on_each_accumulation_mistake(capsys, body, wrong):
    from torch import nn

    namespace: dict[str, Any] = {"nn": nn, "model_config": {"width": 16, "depth": 2}}
    exec("def train_step(model, optimizer, group):\n" + "\n".join("    " + line for line in body.strip().splitlines()),
         namespace)
    results = run_check_cell("12_fsdp.ipynb", "exercise_3", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results

"""Each lesson's exercise checks, run on the mistake the exercise targets: the check must say "not yet" and name
what does not hold. The check cell is taken from the notebook as the learner runs it; the answer is fed in as the
values the learner's cell would leave behind."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest

from helpers.exercises import check, expect_equal

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def run_check_cell(notebook: str, defines: str, answer: dict[str, Any], capsys) -> dict[str, bool]:
    """Run the one cell of `notebook` that defines `defines` (`exercise_1 = {`) in the namespace `answer` (it keeps
    what the cell defines), and return what its check printed: each expectation -> whether it held."""
    cells = [cell.source for cell in nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
             if cell.cell_type == "code" and f"{defines} = " in cell.source and "check(" in cell.source]
    assert len(cells) == 1, f"{notebook}: {len(cells)} cells define {defines}"
    answer.setdefault("check", check)
    answer.setdefault("expect_equal", expect_equal)
    exec(cells[0], answer)
    lines = capsys.readouterr().out.splitlines()
    expectations = [line[len("  - "):] for line in lines[1:] if line.startswith("  - ")]
    if lines[0].startswith("✓"):
        return dict.fromkeys(expectations, True)
    assert lines[0].startswith("✗"), lines
    return {line: False for line in expectations}  # a "not yet" lists only what does not hold


def define(namespace: dict[str, Any], signature: str, answer: str) -> None:
    """Define the learner's one-line answer, `def <signature>: return <answer>`, in `namespace`."""
    exec(f"def {signature}:\n    return {answer}\n", namespace)


def failed(results: dict[str, bool]) -> list[str]:
    return [what for what, held in results.items() if not held]


# ---- 00 · exercise 1: results one at a time, as they finish (ray.wait), not in submission order (ray.get) ---------

NAPS_BY_GET = [3.0] + [0.25] * 7  # ray.get(refs): the submission order
NAPS_BY_WAIT = [0.25] * 7 + [3.0]  # ray.wait(..., num_returns=1) in a loop, on 2 CPUs or more


@pytest.mark.parametrize("as_finished,elapsed_s,wrong", [
    (NAPS_BY_WAIT, 3.1, []),
    (NAPS_BY_GET, 3.1, ["they arrived as they finished"]),  # ray.get on the list, or ray.wait(num_returns=8)
    ([0.25] * 7 + [3.0], 4.9, ["the naps ran"]),  # one after the other: sequential calls in a loop
])
def test_lesson_00_exercise_1_fails_on_results_taken_in_submission_order(capsys, as_finished, elapsed_s, wrong):
    results = run_check_cell("00_ray_core.ipynb", "exercise_1",
                             {"as_finished": as_finished, "elapsed_s": elapsed_s, "num_cpus": 2}, capsys)
    assert [what.split(":")[0].split(" (")[0] for what in failed(results)] == wrong, results


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

"""The capstone's checks (lesson 09): run the learner's training loop on a slice of CIFAR-10 and say what holds.

`check_step("2", train_loop_per_worker, config)` runs a short `TorchTrainer.fit()` of the loop with 2 workers, a small
ViT and a few dozen images, then checks what a correct Ray Train loop does: every worker reports every epoch, each
trains on its own share of the images, the evaluation covers the test set once, and rank 0's checkpoint holds the
model that produced the reported accuracy. The loop reports the metrics of the lesson's `run_epoch`, which counts
the images each worker trained on (`train_images`) and evaluated in all (`test_images`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from helpers.cifar import CifarParquet, vit_cifar10
from helpers.exercises import check, expect_equal
from helpers.runs import new_run_name
from helpers.system import environ
from helpers.training import evaluate

#: Rows of each split the check trains and evaluates on.
CHECK_ROWS = {"train": 64, "test": 32}
CHECK_WORKERS = 2
CHECK_EPOCHS = 2
#: How long a worker waits in `ray.train.report` for the others (Ray Train waits forever by default): a loop
#: in which only some ranks report fails the check in seconds instead of hanging.
CHECK_COLLECTIVE_TIMEOUT_S = 15
COLLECTIVE_TIMEOUT_VAR = "RAY_TRAIN_COLLECTIVE_TIMEOUT_S"
#: Seconds for Ray to forward a failed run's worker logs to the notebook before the check prints its verdict.
LOG_SETTLE_S = 2


def unfinished(function: Callable) -> list[str]:
    """Names of `function` and of the functions of its module it calls whose body still holds a bare `...`."""
    names, todo, seen = [], [function], set()
    while todo:
        current = todo.pop()
        if current.__name__ in seen:
            continue
        seen.add(current.__name__)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(current)))
        except (OSError, TypeError, SyntaxError):  # no source to read: nothing to say about it
            continue
        if any(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node.value.value is Ellipsis
               for node in ast.walk(tree)):
            names.append(current.__name__)
        called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        todo += [value for name in called if inspect.isfunction(value := current.__globals__.get(name))
                 and value.__module__ == current.__module__]
    return names


def _why_failed(error: Exception) -> str:
    """The line of a failed run that tells the learner what to fix."""
    failures = getattr(error, "worker_failures", {}) or {}
    text = str(next(iter(failures.values()))) if failures else str(error)
    if "have not joined the collective operation" in text:
        missing = text.split("collective operation:", 1)[1].split("\n", 1)[0].strip()
        return (f"rank(s) {missing} never called ray.train.report: every worker reports every epoch, "
                "rank 0 with the checkpoint")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (errors or lines or [type(error).__name__])[-1]


def _checkpoint_accuracy(result, root: str) -> float:
    """Accuracy on the check's test rows of the weights in the run's last checkpoint (its one `.pt` file)."""
    if result.checkpoint is None:
        raise AssertionError("the run has no checkpoint: rank 0 passes one to ray.train.report(..., checkpoint=...)")
    with result.checkpoint.as_directory() as checkpoint_dir:
        files = sorted(Path(checkpoint_dir).glob("*.pt"))
        if len(files) != 1:
            raise AssertionError(f"the checkpoint holds {[f.name for f in files]}, not one .pt file")
        state = torch.load(files[0], map_location="cpu")
        if all(key.startswith("module.") for key in state):
            raise AssertionError("the checkpoint holds DDP's wrapper (keys 'module.…'): save model.module.state_dict()")
        model = vit_cifar10(smoke_test=True)
        model.load_state_dict(state)
    dataset: Any = CifarParquet(root, "test", CHECK_ROWS["test"])  # a Dataset by its methods (no torch in cifar)
    loader: DataLoader = DataLoader(dataset, batch_size=512)
    return evaluate(model, loader, "cpu")["accuracy"]


def check_step(step: str, loop: Callable[[dict], None], config: dict,
               make_datasets: Callable[[str, dict], dict] | None = None, strict: bool = False) -> None:
    """Run `loop` as a short `fit()` and print what holds ("✓ Step 2 passes") or what does not yet.

    `config` is the lesson's `train_loop_config`; the check overrides the size (a small ViT, `CHECK_ROWS`, 2 epochs
    of 4 steps). For a loop fed by Ray Data, `make_datasets(root, CHECK_ROWS)` builds its datasets. With
    `strict=True` anything that does not hold raises `ExerciseNotPassed`.
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if names := unfinished(loop):
        check(step, {f"{', '.join(f'`{name}`' for name in names)} still has `...`: write it, then run this cell again":
                     lambda: False}, strict, kind="Step")
        return
    check_config = {**config, "num_epochs": CHECK_EPOCHS, "global_batch_size": 16, "smoke_test": True,
                    "max_rows": CHECK_ROWS, "started_at": time.time()}
    trainer = TorchTrainer(
        loop, train_loop_config=check_config,
        datasets=make_datasets(config["root"], CHECK_ROWS) if make_datasets else None,
        scaling_config=ScalingConfig(num_workers=CHECK_WORKERS, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(config["storage_path"]), name=new_run_name(f"09_capstone_check_step{step}")),
    )
    try:
        with environ(**{COLLECTIVE_TIMEOUT_VAR: str(CHECK_COLLECTIVE_TIMEOUT_S)}):  # Ray Train passes it on to workers
            result = trainer.fit()
    except Exception as error:  # the learner's loop failed: say why, do not stop the notebook
        time.sleep(LOG_SETTLE_S)  # the workers' tracebacks reach the notebook first, the verdict after them
        check(step, {f"the run finishes ({_why_failed(error)})": lambda: False}, strict, kind="Step")
        return

    share = CHECK_ROWS["train"] // CHECK_WORKERS

    def metric(name: str):
        if name not in result.metrics:
            raise AssertionError(f"the reported metrics have no {name!r}: report what run_epoch returns")
        return result.metrics[name]

    check(step, {
        f"every worker reports every epoch: {CHECK_EPOCHS} reports":
            lambda: expect_equal(len(result.metrics_dataframe), CHECK_EPOCHS),
        f"each worker trains on its own share: {share} of the {CHECK_ROWS['train']} images":
            lambda: expect_equal(metric("train_images"), share),
        f"the evaluation covers the {CHECK_ROWS['test']} test images once, split between the workers":
            lambda: expect_equal(metric("test_images"), CHECK_ROWS["test"]),
        "rank 0's checkpoint holds the model: loaded, it reproduces the reported test_acc":
            lambda: abs(_checkpoint_accuracy(result, config["root"]) - metric("test_acc")) < 1e-6,
    }, strict, kind="Step")


# ---- references for the lesson's exercises ----------------------------------------------------------------------

def wall_after_epochs(results, num_epochs: int) -> dict[str, float]:
    """Each step's wall time for `num_epochs` epochs, from a one-epoch results table: train and evaluate repeat,
    everything else is counted once."""
    every_epoch = results["train (s)"] + results["evaluate (s)"]
    return (results["wall time (s)"] + (num_epochs - 1) * every_epoch).to_dict()


def ring_allreduce_megabytes(model: torch.nn.Module, num_workers: int) -> float:
    """Megabytes each of `num_workers` workers sends per step in a ring all-reduce of `model`'s gradients."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 2 * (num_workers - 1) / num_workers * gradient_bytes / 1e6

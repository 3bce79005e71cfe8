"""Lesson 09, the capstone: its training code, kept for `train_capstone.py`, and the checks of the learner's work.

The lesson defines the loop fed by Ray Data and the functions it calls in cells the learner edits; the copies below
are the ones `train_capstone.py` runs as a Ray job (`tests/test_lesson_code.py` keeps them equal to the cells).

The checks run the learner's code briefly on a slice of CIFAR-10 and say what holds:
- `check_step("2", train_loop_per_worker, config)` fits the loop twice under one run name, with 2 workers, a small
  ViT and a few dozen images: one epoch, then, started again, a second. It checks what a correct Ray Train loop
  does: every worker reports, each takes its share of every batch and of the test set, DDP keeps the ranks' weights
  equal, rank 0's checkpoint holds the model, and the second fit goes on from the checkpoint (epoch, weights,
  optimizer state).
- `check_run(scaling_config, run_config, ...)`: the learner's configurations, and a short run with them in which a
  worker fails once.
- `check_job(client, submission_id, ...)`: the learner's job, as the cluster received it, until it runs.
"""

from __future__ import annotations

import ast
import inspect
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray.data
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from helpers.cifar import CifarParquet, augment_batch, normalize_batch, read_split, vit_cifar10
from helpers.exercises import check, expect_equal, holds
from helpers.ingest import DTYPES, NUM_BLOCKS
from helpers.runs import new_run_name
from helpers.sizes import sized
from helpers.storage import exists, join
from helpers.system import environ
from helpers.training import device_name, evaluate, evaluate_distributed, same_weights_on_every_rank, seed_everything

#: Rows of each split the checks train and evaluate on, and the check's batch: 4 steps of 8 images per worker.
CHECK_ROWS = {"train": 64, "test": 32}
CHECK_WORKERS = 2
CHECK_BATCH_SIZE = 16
#: How long a worker waits in `ray.train.report` for the others (Ray Train waits forever by default): a loop
#: in which only some ranks report fails the check in seconds instead of hanging.
CHECK_COLLECTIVE_TIMEOUT_S = 15
COLLECTIVE_TIMEOUT_VAR = "RAY_TRAIN_COLLECTIVE_TIMEOUT_S"
#: Seconds for Ray to forward a failed run's worker logs to the notebook before the check prints its verdict.
LOG_SETTLE_S = 2
#: The files of the lesson's checkpoints: the weights, and what a resume needs besides them.
MODEL_FILE, TRAIN_STATE_FILE = "model.pt", "train_state.pt"
#: The script the lesson submits as a job, and the lines of its log worth reading in the notebook.
JOB_SCRIPT = "train_capstone.py"
JOB_SUMMARY_LINES = ("test_acc=", "best checkpoint: ", "epochs: ")
#: Seconds `check_job` watches a running job: one that cannot open its script, or import its modules, fails sooner.
JOB_SETTLE_S = 15


def run_rows(smoke_test: bool, num_gpus: float) -> dict[str, int]:
    """The rows of each split the lesson's own run and job train and test on: all of them (smoke mode: its cut) on
    a cluster with GPUs; on CPUs only, `capstone_run`'s cut, so that its epochs take minutes."""
    rows = sized("cifar_rows", smoke_test) if num_gpus else sized("capstone_run", smoke_test)["cpu_rows"]
    return dict(rows or {})


# ---- the lesson's training code, as its cells define it -------------------------------------------------------

def train_epoch(model: nn.Module, batches, optimizer, loss_fn, device: torch.device) -> dict:
    """One pass over `batches` of (images, labels); on a GPU, the forward pass in bf16 autocast."""
    model.train()
    total_loss, num_images, num_steps = 0.0, 0, 0
    for images, labels in batches:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(labels)
        num_images += len(labels)
        num_steps += 1
    return {"train_loss": total_loss / num_images, "num_images": num_images, "num_steps": num_steps}


def run_epoch(model: nn.Module, train_batches, test_batches, optimizer, device: torch.device, started_at: float) -> dict:
    """Train one pass over `train_batches`, evaluate on this process's `test_batches`; each part timed."""
    start_s = time.time() - started_at  # seconds since the step was launched
    train = train_epoch(model, train_batches, optimizer, nn.CrossEntropyLoss(), device)
    train_s = time.time() - started_at - start_s
    plain_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    test = evaluate_distributed(plain_model, test_batches, device)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return {"train_loss": train["train_loss"], "test_loss": test["loss"], "test_acc": test["accuracy"],
            "train_images": train["num_images"], "train_steps": train["num_steps"],  # this worker's
            "test_images": test["images"],  # all workers'
            "same_weights": same_weights_on_every_rank(plain_model),  # on every rank: what DDP promises
            "start_s": start_s, "train_s": train_s, "eval_s": time.time() - started_at - start_s - train_s,
            "images_per_s": train["num_images"] * world_size / train_s}


def report_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, metrics: dict) -> None:
    """Every worker reports the epoch's metrics; rank 0 attaches a checkpoint: model.pt (the weights) and
    train_state.pt (the optimizer's state and the epoch)."""
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            plain_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
            torch.save(plain_model.state_dict(), Path(checkpoint_dir) / "model.pt")  # [7] the weights, for inference
            torch.save({"optimizer": optimizer.state_dict(), "epoch": metrics["epoch"]},  # [7] what a resume needs
                       Path(checkpoint_dir) / "train_state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
        ray.train.report(metrics, checkpoint=checkpoint)  # [6] every worker: a report is a barrier


def resume(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the run's latest checkpoint, if it has one, into `model` and `optimizer`; return the first epoch to train."""
    checkpoint = ray.train.get_checkpoint()  # [8] None on a fresh start
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as checkpoint_dir:
        plain_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        plain_model.load_state_dict(torch.load(Path(checkpoint_dir) / "model.pt", map_location="cpu"))
        state = torch.load(Path(checkpoint_dir) / "train_state.pt", map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])  # [8] AdamW's running averages and step count too
    return state["epoch"] + 1


def as_pairs(batches):
    """Ray Data's batches are dicts of tensors; run_epoch takes (images, labels) pairs."""
    return ((batch["image"], batch["label"]) for batch in batches)


def train_loop_per_worker_ray_data(config: dict) -> None:
    """Step 2's loop, fed by this worker's shards of the "train" and "valid" datasets."""
    seed_everything(config["seed"])
    world_size = ray.train.get_context().get_world_size()
    device = ray.train.torch.get_device()
    train_shard = ray.train.get_dataset_shard("train")  # [1] this worker's part of each dataset
    valid_shard = ray.train.get_dataset_shard("valid")  # [1]
    model = ray.train.torch.prepare_model(vit_cifar10(config["smoke_test"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    for epoch in range(resume(model, optimizer), config["num_epochs"]):
        train_batches = train_shard.iter_torch_batches(  # [2] a new pass, shuffled, every epoch
            batch_size=config["global_batch_size"] // world_size, dtypes=DTYPES, device=device,
            prefetch_batches=config["prefetch_batches"],
            local_shuffle_buffer_size=config["shuffle_buffer"], local_shuffle_seed=config["seed"] + epoch)
        test_batches = valid_shard.iter_torch_batches(batch_size=512, dtypes=DTYPES, device=device)  # [2]
        metrics = run_epoch(model, as_pairs(train_batches), as_pairs(test_batches),  # [3] dicts -> pairs
                            optimizer, device, config["started_at"])
        report_epoch(model, optimizer, {"epoch": epoch, **metrics, "device": device_name(device)})


def cifar10_datasets(root: str, max_rows: dict[str, int], augment: bool = True) -> dict:
    datasets = {}
    for name, split in (("train", "train"), ("valid", "test")):
        dataset = ray.data.read_parquet(join(root, split))
        if split in max_rows:
            dataset = dataset.limit(max_rows[split])
        dataset = dataset.map_batches(normalize_batch)  # [1] the normalisation of CifarParquet, on the CPU pool
        datasets[name] = dataset.repartition(NUM_BLOCKS).materialize()  # as in lesson 03: run once, keep, in blocks
    if augment:
        datasets["train"] = datasets["train"].map_batches(augment_batch)  # [2] after materialize: new crops every epoch
    return datasets


# ---- the checks -----------------------------------------------------------------------------------------------

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


def _not_yet(what: str, step: str, strict: bool, kind: str = "Step") -> None:
    check(step, {what: lambda: False}, strict, kind=kind)


def _checkpoint_file(result, name: str) -> Any:
    """The object saved as `name` in the run's last checkpoint."""
    if result.checkpoint is None:
        raise AssertionError("the run has no checkpoint: rank 0 passes one to ray.train.report(..., checkpoint=...)")
    with result.checkpoint.as_directory() as checkpoint_dir:
        path = Path(checkpoint_dir) / name
        if not path.is_file():
            raise AssertionError(f"the checkpoint holds {sorted(p.name for p in Path(checkpoint_dir).iterdir())}, "
                                 f"no {name}")
        return torch.load(path, map_location="cpu")


def _weights(result) -> dict[str, torch.Tensor]:
    state = _checkpoint_file(result, MODEL_FILE)
    if all(key.startswith("module.") for key in state):
        raise AssertionError("the checkpoint holds DDP's wrapper (keys 'module.…'): save model.module.state_dict()")
    return state


def _checkpoint_accuracy(result, root: str) -> float:
    """Accuracy on the check's test rows of the weights in the run's last checkpoint."""
    model = vit_cifar10(smoke_test=True)
    model.load_state_dict(_weights(result))
    dataset: Any = CifarParquet(root, "test", CHECK_ROWS["test"])  # a Dataset by its methods (no torch in cifar)
    loader: DataLoader = DataLoader(dataset, batch_size=512)
    return evaluate(model, loader, "cpu")["accuracy"]


def _freeze_learning(result) -> None:
    """Set the learning rate saved in the run's last checkpoint to 0: a run resumed from it trains without changing
    its weights, so its next checkpoint shows which weights the resumed loop started from."""
    state = _checkpoint_file(result, TRAIN_STATE_FILE)
    for group in state["optimizer"]["param_groups"]:
        group["lr"] = 0.0
    filesystem, path = result.checkpoint.filesystem, f"{result.checkpoint.path}/{TRAIN_STATE_FILE}"
    with filesystem.open_output_stream(path) as file:
        torch.save(state, file)


def _optimizer_steps(state: dict) -> int:
    """The steps AdamW counted, from a saved optimizer state."""
    steps = {int(value["step"]) for value in state["optimizer"]["state"].values()}
    if len(steps) != 1:
        raise AssertionError(f"the optimizer's parameters counted different steps: {sorted(steps)}")
    return steps.pop()


def _fit(loop: Callable[[dict], None], config: dict, name: str, datasets: dict | None, scaling_config=None,
         run_config_changes: dict | None = None, log_level: str = "WARNING"):
    """A short fit() of `loop` under the run name `name`, with a timeout on Ray Train's collectives; Ray Train's
    console logs from `log_level` up."""
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        loop, train_loop_config=config, datasets=datasets,
        scaling_config=scaling_config or ScalingConfig(num_workers=CHECK_WORKERS, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(config["storage_path"]), name=name,
                             logging_config=LoggingConfig(log_level=log_level), **(run_config_changes or {})),
    )
    with environ(**{COLLECTIVE_TIMEOUT_VAR: str(CHECK_COLLECTIVE_TIMEOUT_S)}):  # Ray Train passes it on to workers
        return trainer.fit()


def _check_config(config: dict, num_epochs: int) -> dict:
    return {**config, "num_epochs": num_epochs, "global_batch_size": CHECK_BATCH_SIZE, "smoke_test": True,
            "max_rows": CHECK_ROWS, "started_at": time.time()}


def check_step(step: str, loop: Callable[[dict], None], config: dict,
               make_datasets: Callable[[str, dict], dict] | None = None, strict: bool = False) -> None:
    """Run `loop` as two short fits under one run name and print what holds ("✓ Step 2 passes") or what does not yet.

    `config` is the lesson's `train_loop_config`; the check overrides the size (a small ViT, `CHECK_ROWS`, 4 steps
    of 8 images per worker). The first fit trains epoch 0. The second, started again under the same name, must go
    on from its checkpoint at epoch 1; the check sets the learning rate in that checkpoint to 0, so that the resumed
    epoch leaves the weights it started from. For a loop fed by Ray Data, `make_datasets(root, CHECK_ROWS)` builds
    its datasets. With `strict=True` anything that does not hold raises `ExerciseNotPassed`.
    """
    if names := unfinished(loop):
        _not_yet(f"{', '.join(f'`{name}`' for name in names)} still has `...`: write it, then run this cell again",
                 step, strict)
        return
    datasets = make_datasets(config["root"], CHECK_ROWS) if make_datasets else None
    name = new_run_name(f"09_capstone_check_step{step}")
    try:
        first = _fit(loop, _check_config(config, 1), name, datasets)
    except Exception as error:  # the learner's loop failed: say why, do not stop the notebook
        time.sleep(LOG_SETTLE_S)  # the workers' tracebacks reach the notebook first, the verdict after them
        _not_yet(f"the run finishes ({_why_failed(error)})", step, strict)
        return

    resumed: dict[str, Any] = {}

    def run_again():
        """The second fit, started once: its Result, or why it failed."""
        if not resumed:
            try:
                first_weights = _weights(first)
                _freeze_learning(first)
                resumed.update(result=_fit(loop, _check_config(config, 2), name, datasets), weights=first_weights)
            except Exception as error:
                resumed["error"] = AssertionError(f"started again: {_why_failed(error)}")
        if "error" in resumed:
            raise resumed["error"]
        return resumed["result"]

    def metric(name: str):
        if name not in first.metrics:
            raise AssertionError(f"the reported metrics have no {name!r}: report what run_epoch returns")
        return first.metrics[name]

    share = CHECK_ROWS["train"] // CHECK_WORKERS
    per_step = CHECK_BATCH_SIZE // CHECK_WORKERS
    first_epoch: dict[str, Callable[[], object]] = {
        "the epoch ends with a report on every worker, rank 0's with a checkpoint":
            lambda: expect_equal(0 if first.metrics_dataframe is None else len(first.metrics_dataframe), 1),
        f"each worker trains on its own share: {share} of the {CHECK_ROWS['train']} images, not all of them "
        "(a DistributedSampler, from prepare_data_loader, or a dataset shard)":
            lambda: expect_equal(metric("train_images"), share),
        f"each worker's batch is global_batch_size // world_size = {per_step} images: {share // per_step} steps on its "
        f"{share}":
            lambda: expect_equal(metric("train_steps"), share // per_step),
        f"the evaluation covers the {CHECK_ROWS['test']} test images once, split between the workers, not once per "
        "worker (the test loader too goes through prepare_data_loader)":
            lambda: expect_equal(metric("test_images"), CHECK_ROWS["test"]),
        "every rank holds the same weights after the epoch: DDP averaged the gradients (prepare_model)":
            lambda: metric("same_weights") is True,
        "rank 0's checkpoint holds the model: loaded, it reproduces the reported test_acc":
            lambda: abs(_checkpoint_accuracy(first, config["root"]) - metric("test_acc")) < 1e-6,
    }
    if not all(holds(test)[0] for test in first_epoch.values()):  # the restart is checked once these hold
        check(step, {**first_epoch, "started again, it goes on from its checkpoint (checked once the above hold)":
                     lambda: False}, strict, kind="Step")
        return
    check(step, {
        **first_epoch,
        "started again under the same run name, the loop goes on at epoch 1, not 0: the run's checkpoints are of "
        "epochs [0, 1]":
            lambda: expect_equal(run_again().metrics_dataframe["epoch"].tolist(), [0, 1]),
        "it goes on with the checkpoint's weights":
            lambda: all(torch.equal(tensor, _weights(run_again())[key]) for key, tensor in resumed["weights"].items())
            or _raise("the resumed epoch, at the checkpoint's learning rate of 0, ended with other weights: load "
                      "model.pt into the model, and train_state.pt's optimizer state into the optimizer"),
        f"and with the optimizer's state: AdamW counted {2 * share // per_step} steps after the two epochs":
            lambda: expect_equal(_optimizer_steps(_checkpoint_file(run_again(), TRAIN_STATE_FILE)),
                                 2 * share // per_step),
    }, strict, kind="Step")


def _raise(message: str) -> bool:
    raise AssertionError(message)


def check_run(scaling_config, run_config, loop: Callable[[dict], None], config: dict,
              make_datasets: Callable[[str, dict], dict], strict: bool = False) -> None:
    """Check the learner's `ScalingConfig` and `RunConfig` for the lesson's run, then run `loop` briefly with them:
    3 epochs on `CHECK_ROWS`, in which rank 0 fails once in epoch 1. Print what holds, or what does not yet."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig

    from helpers.cluster import check_data_resources, check_resources
    from helpers.fault_tolerance import with_failure
    from helpers.results import MetricsHistory, read_history

    todo = [name for name, value in (("scaling_config", scaling_config), ("run_config", run_config))
            if value is Ellipsis]
    if todo:
        _not_yet(f"{' and '.join(todo)} still {'is' if len(todo) == 1 else 'are'} `...`: write "
                 f"{'it' if len(todo) == 1 else 'them'}, then run this cell again", "run", strict, kind="Your")
        return
    datasets = make_datasets(config["root"], CHECK_ROWS)
    checkpoints = getattr(run_config, "checkpoint_config", None) or CheckpointConfig()
    failures = getattr(run_config, "failure_config", None)
    expectations: dict[str, Callable[[], object]] = {
        "scaling_config is a ScalingConfig, run_config a RunConfig":
            lambda: isinstance(scaling_config, ScalingConfig) and isinstance(run_config, RunConfig),
        "the workers fit this cluster (check_resources)": lambda: _returns(check_resources, scaling_config),
        "they leave Ray Data CPUs while they train (check_data_resources)":
            lambda: _returns(check_data_resources, scaling_config, datasets),
        f"the run is stored under the course's storage path, {config['storage_path']}":
            lambda: expect_equal(str(run_config.storage_path), str(config["storage_path"])),
        "it keeps the best 2 checkpoints by test_acc (CheckpointConfig)":
            lambda: expect_equal((checkpoints.num_to_keep, checkpoints.checkpoint_score_attribute,
                                  checkpoints.checkpoint_score_order), (2, "test_acc", "max")),
        "it restarts the workers after a failure (FailureConfig, max_failures of 1 or more, or -1)":
            lambda: failures is not None and (failures.max_failures >= 1 or failures.max_failures == -1),
        "it keeps every report and failure in the run folder (callbacks=[MetricsHistory()])":
            lambda: any(isinstance(callback, MetricsHistory) for callback in run_config.callbacks or []),
        "its name is new: no run of that name in the storage path yet (new_run_name), or fit() would continue that run":
            lambda: bool(run_config.name) and not exists(join(str(run_config.storage_path), run_config.name)),
    }
    check_name = new_run_name("09_capstone_check_run")
    outcome: dict[str, Any] = {}

    def brief_run():
        if not outcome:
            try:
                outcome["result"] = _fit(with_failure(loop, epoch=1, step=0, rank=0), _check_config(config, 3),
                                         check_name, datasets, scaling_config,
                                         {"checkpoint_config": checkpoints, "failure_config": failures,
                                          "callbacks": run_config.callbacks},
                                         log_level="CRITICAL")  # not the injected failure's traceback: it is expected
            except Exception as error:
                outcome["error"] = AssertionError(_why_failed(error))
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    if all(holds(test)[0] for test in expectations.values()):  # a run with configurations that hold only
        expectations.update({
            "a run with them survives a worker that fails in epoch 1, and ends at epoch 2":
                lambda: expect_equal(brief_run().metrics["epoch"], 2) and _failed_once(read_history(brief_run())),
            "after 3 epochs it keeps the best 2 checkpoints by test_acc, and the latest":
                lambda: kept_by_rule(read_history(brief_run())),
        })
    check("run", expectations, strict, kind="Your")


def _failed_once(history) -> bool:
    """True when the run's history holds one failure; else why the check's failure never happened."""
    if (history["event"] == "failure").sum() != 1:
        raise AssertionError("no worker failed: the check makes the shard of ray.train.get_dataset_shard(\"train\") "
                             "fail; call it that way, on every epoch's iter_torch_batches")
    return True


def kept_by_rule(history) -> bool:
    """True when the checkpoints left in the run folder are the 2 best by test_acc and the latest: Ray Train keeps the
    latest whatever its score (ray/train/v2/_internal/execution/checkpoint/checkpoint_manager.py), as a restart
    resumes from it. Ties in test_acc may keep either."""
    reports = history[history["event"] == "report"].reset_index(drop=True)
    latest = reports.index[-1]
    kept, deleted = reports[reports["kept"]], reports[~reports["kept"]]
    scored = kept.drop(index=latest, errors="ignore")
    if latest not in kept.index or not 2 <= len(kept) <= 3 or (len(kept) == 3 and len(scored) != 2):
        raise AssertionError(f"kept the checkpoints of epochs {kept['epoch'].tolist()}")
    if len(deleted) and deleted["test_acc"].max() > scored["test_acc"].min():
        raise AssertionError(f"deleted a checkpoint with test_acc {deleted['test_acc'].max()}, kept one with "
                             f"{scored['test_acc'].min()}")
    return True


def _returns(preflight: Callable[..., None], *args) -> bool:
    """True once `preflight(*args)` returns; its error says what does not fit."""
    preflight(*args)
    return True


def check_job(client, submission_id: str, storage_path: str, job_name: str, strict: bool = False,
              timeout_s: float = 180) -> None:
    """Check the learner's job as the cluster received it: it runs `train_capstone.py`, with the code uploaded and
    the course's settings, starts within `timeout_s`, and still runs `JOB_SETTLE_S` later."""
    from ray.job_submission import JobStatus

    if submission_id is Ellipsis:
        _not_yet("submission_id is still `...`: submit the job with client.submit_job(...)", "job", strict,
                 kind="Your")
        return
    info = client.get_job_info(submission_id)
    runtime_env = info.runtime_env or {}
    env_vars = runtime_env.get("env_vars") or {}
    deadline = time.monotonic() + timeout_s
    while (status := client.get_job_status(submission_id)) == JobStatus.PENDING and time.monotonic() < deadline:
        time.sleep(1)
    running_until = time.monotonic() + JOB_SETTLE_S  # a job that cannot find its script or its imports fails by then
    while (status := client.get_job_status(submission_id)) == JobStatus.RUNNING and time.monotonic() < running_until:
        time.sleep(1)

    def started() -> bool:
        if status == JobStatus.PENDING:
            raise AssertionError(f"still PENDING after {timeout_s:.0f} s: see client.get_job_logs(submission_id)")
        if status in (JobStatus.FAILED, JobStatus.STOPPED):
            message = client.get_job_info(submission_id).message or ""
            last = (client.get_job_logs(submission_id).strip().splitlines() or [message])[-1]
            raise AssertionError(f"{status}: {last}")
        return True

    check("job", {
        f"it runs {JOB_SCRIPT}": lambda: JOB_SCRIPT in info.entrypoint,
        f"it names its run job_name, {job_name} (--name)": lambda: f"--name {job_name}" in info.entrypoint,
        "its code travels with it (runtime_env: working_dir, and helpers as py_modules)":
            lambda: bool(runtime_env.get("working_dir")) and bool(runtime_env.get("py_modules")),
        f"it stores its run under the course's storage path (env_vars: COURSE_STORAGE_PATH={storage_path})":
            lambda: expect_equal(env_vars.get("COURSE_STORAGE_PATH"), str(storage_path)),
        "it reads the course's data (env_vars: COURSE_DATA_DIR)": lambda: bool(env_vars.get("COURSE_DATA_DIR")),
        f"it runs: RUNNING {JOB_SETTLE_S} s after it started, or SUCCEEDED": started,
    }, strict, kind="Your")


def follow_job(client, submission_id: str, timeout_s: float) -> str:
    """Print the job's summary lines as its log grows; return its final status (SUCCEEDED, FAILED or STOPPED).
    Raise TimeoutError after `timeout_s`, the job still running."""
    deadline, printed = time.monotonic() + timeout_s, 0
    while True:
        status = client.get_job_status(submission_id)  # before the log: a terminal status means the log is whole
        lines = [line for line in client.get_job_logs(submission_id).splitlines() if line.startswith(JOB_SUMMARY_LINES)]
        for line in lines[printed:]:
            print(line)
        printed = len(lines)
        if status.is_terminal():
            return str(status)
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {submission_id} is still {status} after {timeout_s:.0f} s: "
                               f"client.stop_job({submission_id!r}) stops it")
        time.sleep(2)


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


def two_passes_agree(dataset, rows: int = 64) -> bool:
    """Whether two `take_batch(rows)` of `dataset` hand out the same images."""
    return bool((dataset.take_batch(rows)["image"] == dataset.take_batch(rows)["image"]).all())


def augments(dataset, root: str, rows: int = 64) -> bool:
    """Whether `dataset`'s first `rows` images differ from the test split's first rows, normalised only."""
    plain = normalize_batch({"image": read_split(root, "test", rows)["image"]})["image"]
    return not bool((dataset.take_batch(rows)["image"] == plain).all())

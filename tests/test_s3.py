"""An `s3://` storage path end to end, against a real S3 API server on 127.0.0.1 (moto, see tests/conftest.py).

Ray starts after the server's AWS_* variables are set, so its workers reach the bucket the way a cluster's
nodes reach a real one through their environment. Nothing may land in a local folder named `s3:`.
"""

from __future__ import annotations

import boto3
import numpy as np
import pytest
import ray
import torch
from ray.train import CheckpointConfig, Result, RunConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader

from helpers import setup, storage
from helpers.cluster import check_storage_path, course_scaling_config, start_autoscaling_coordinator
from helpers.config import REPO_ROOT
from helpers.data import load_mnist
from helpers.ddp import train_loop_per_worker
from helpers.inference import MNISTPredictor, load_model
from helpers.ingest import COMPLETE_MARKER, SMOKE_ROWS, mnist_datasets, write_mnist_parquet
from helpers.results import MetricsHistory, describe_run_folder, read_history, run_path
from helpers.runs import load_summary, save_summary
from helpers.tooling.scripts import print_result
from helpers.training import evaluate

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


@pytest.fixture(scope="module")
def on_s3(no_ray, s3_server, small_mnist, tmp_path_factory):
    """setup() with COURSE_STORAGE_PATH=s3://<bucket>/course and a small MNIST, run from an empty folder; Ray shut
    down after."""
    storage_path = f"{s3_server.bucket()}/course"
    workdir = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COURSE_STORAGE_PATH", storage_path)
        patch.setenv("COURSE_DATA_DIR", small_mnist)
        patch.chdir(workdir)
        cfg = setup()
        yield cfg, workdir
        ray.shutdown()


def _objects(uri: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for item in listing.get("Contents", [])]


def test_the_storage_path_stays_a_uri_and_every_node_reaches_it(on_s3):
    cfg, _ = on_s3
    assert cfg.storage_path.startswith("s3://course-test-") and cfg.storage_path.endswith("/course")
    assert check_storage_path(cfg.storage_path) == cfg.storage_path
    assert not any(".course-storage-check" in key for key in _objects(cfg.storage_path)), "probe left behind"


def test_a_lesson_02_run_keeps_checkpoints_and_history_in_the_bucket(on_s3, capsys):
    cfg, _ = on_s3
    start_autoscaling_coordinator()
    name = "02-on-s3"
    result = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": 2, "global_batch_size": 128, "lr": 1e-3, "seed": 0,
                           "max_steps_per_epoch": 8, "max_test_batches": None,  # the check below evaluates all
                           "data_dir": str(cfg.data_dir)},
        scaling_config=course_scaling_config(cfg, num_workers=1),
        run_config=RunConfig(storage_path=cfg.storage_path, name=name, callbacks=[MetricsHistory()],
                             checkpoint_config=CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="test_acc",
                                                                checkpoint_score_order="max")),
    ).fit()
    folder = run_path(cfg.storage_path, name)
    assert storage.uri(result.path, result.filesystem) == folder, "Result.path has no scheme: its filesystem says S3"
    keys = _objects(folder)
    assert sum(key.endswith("/model.pt") for key in keys) >= 1 and any(key.endswith("metrics_history.jsonl")
                                                                       for key in keys)

    history = read_history(result)  # from the bucket, also accepted as the URI `folder`
    # Ray Train keeps the best `num_to_keep` by score and, whatever its score, the latest checkpoint.
    on_disk = {checkpoint.path for checkpoint, _ in result.best_checkpoints} | {result.checkpoint.path}
    assert list(history["epoch"]) == [0, 1] and history["kept"].sum() == len(on_disk)
    listing = describe_run_folder(folder)
    assert "metrics_history.jsonl" in set(listing["entry"])
    print_result(result)  # what the scripts print: the checkpoint as a URI a learner can pass back
    assert f"checkpoint: {folder}/checkpoint_" in capsys.readouterr().out

    restored = Result.from_path(folder)  # a URI, as a learner would type it
    assert restored.checkpoint.path == result.checkpoint.path and restored.metrics == result.metrics

    # The best checkpoint, downloaded from the bucket by the predictor, reproduces the reported accuracy.
    best = restored.get_best_checkpoint(metric="test_acc", mode="max")
    accuracy = evaluate(load_model(best), DataLoader(load_mnist(cfg.data_dir, train=False), batch_size=512), "cpu")
    best_metrics = next(metrics for checkpoint, metrics in restored.best_checkpoints if checkpoint.path == best.path)
    assert accuracy["accuracy"] == pytest.approx(best_metrics["test_acc"], abs=1e-6)


def test_the_parquet_copy_is_written_to_and_read_from_the_bucket(on_s3):
    cfg, _ = on_s3
    root = write_mnist_parquet(cfg.data_dir, cfg.storage_path)
    copies = f"{cfg.storage_path}/datasets/mnist-parquet"
    assert storage.complete_copies(copies) == [root] and root.startswith(f"{copies}/")
    keys = _objects(copies)
    assert sum(key.endswith(".parquet") for key in keys) == 16
    assert sum(key.endswith(f"/{COMPLETE_MARKER}") for key in keys) == 2
    assert sum(key.endswith(f"/{storage.COPY_MARKER}") for key in keys) == 1
    assert write_mnist_parquet(cfg.data_dir, cfg.storage_path) == root and _objects(copies) == keys, "rewritten"

    datasets = mnist_datasets(root, SMOKE_ROWS)
    assert {name: dataset.count() for name, dataset in datasets.items()} == SMOKE_ROWS
    labels = datasets["valid"].take_batch(SMOKE_ROWS["valid"])["label"]
    np.testing.assert_array_equal(labels, load_mnist(cfg.data_dir, train=False).targets.numpy()[:SMOKE_ROWS["valid"]])


def test_batch_inference_loads_the_checkpoint_from_the_bucket_in_every_actor(on_s3):
    cfg, _ = on_s3
    result = Result.from_path(run_path(cfg.storage_path, "02-on-s3"))
    valid = mnist_datasets(write_mnist_parquet(cfg.data_dir, cfg.storage_path), {"valid": 256})["valid"]
    predictions = valid.map_batches(MNISTPredictor, fn_constructor_kwargs={"checkpoint": result.checkpoint},
                                    compute=ray.data.ActorPoolStrategy(size=1), batch_size=128).take_batch(256)
    model = load_model(result.checkpoint)
    with torch.no_grad():
        expected = model(torch.tensor(predictions["image"])).argmax(dim=1).numpy()
    np.testing.assert_array_equal(predictions["prediction"], expected)


def test_summaries_round_trip_and_nothing_lands_in_a_local_s3_folder(on_s3):
    cfg, workdir = on_s3
    save_summary(cfg.storage_path, "01_single_device", {"test_acc": 0.9})
    assert load_summary(cfg.storage_path, "01_single_device") == {"test_acc": 0.9}
    assert any(key.endswith("summaries/01_single_device.json") for key in _objects(cfg.storage_path))
    for folder in (workdir, REPO_ROOT, REPO_ROOT / "notebooks"):
        assert not (folder / "s3:").exists(), f"an s3:// path turned into the local folder {folder / 's3:'}"

"""helpers.ingest and the Ray Data preflight: Parquet written once, the two transforms agree, no silent hang."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import ray
from ray.train import ScalingConfig

from helpers import setup
from helpers.cluster import ResourceRequestError, check_data_resources, cpus_per_worker
from helpers.data import load_mnist
from helpers.ingest import (NUM_BLOCKS, SMOKE_ROWS, mnist_datasets, normalize_batch, prepare_ray_data_training,
                            transform_row, write_mnist_parquet)

LAPTOP = [{"CPU": 2.0}]


@pytest.fixture(scope="module")
def cfg():
    assert not ray.is_initialized()
    yield setup()
    ray.shutdown()


@pytest.fixture(scope="module")
def parquet_root(cfg, tmp_path_factory):
    return write_mnist_parquet(cfg.data_dir, tmp_path_factory.mktemp("storage"))


def test_per_row_and_per_batch_transforms_give_the_same_tensors(cfg):
    images = load_mnist(cfg.data_dir, train=False).data[:16].numpy()
    by_row = np.stack([transform_row({"image": image})["image"] for image in images])
    by_batch = normalize_batch({"image": images.copy()})["image"]
    assert by_batch.shape == (16, 1, 28, 28) and by_batch.dtype == np.float32
    np.testing.assert_allclose(by_row, by_batch, atol=1e-6)
    assert by_batch.min() == -1.0 and by_batch.max() == 1.0


def test_parquet_holds_all_of_mnist_and_is_written_only_once(cfg, parquet_root):
    mnist = load_mnist(cfg.data_dir, train=True)
    train = ray.data.read_parquet(str(parquet_root / "train"))
    assert train.count() == 60_000
    labels = train.select_columns(["label"]).to_pandas()["label"].to_numpy()
    assert np.array_equal(np.bincount(labels, minlength=10), np.bincount(mnist.targets.numpy(), minlength=10))
    assert ray.data.read_parquet(str(parquet_root / "test")).count() == 10_000

    files = {path: path.stat().st_mtime_ns for path in parquet_root.rglob("*.parquet")}
    assert write_mnist_parquet(cfg.data_dir, parquet_root.parent.parent) == parquet_root
    assert {path: path.stat().st_mtime_ns for path in parquet_root.rglob("*.parquet")} == files, "rewritten"
    assert not list(parquet_root.glob(".*partial*")), "a temporary folder was left behind"


def test_the_training_datasets_are_normalised_and_materialized(parquet_root):
    datasets = mnist_datasets(parquet_root, SMOKE_ROWS)
    assert {name: dataset.count() for name, dataset in datasets.items()} == SMOKE_ROWS
    batch = datasets["train"].take_batch(8)
    assert batch["image"].shape == (8, 1, 28, 28) and batch["image"].dtype == np.float32
    assert -1.0 <= batch["image"].min() < batch["image"].max() <= 1.0
    check_data_resources(ScalingConfig(num_workers=2), datasets, nodes=LAPTOP)  # nothing left to compute


def test_capped_datasets_hold_the_first_rows_in_file_order(cfg, parquet_root):
    # Without in_file_order(), limit() kept whichever rows finished first: another smoke subset each session
    # (CI once trained on one that reached 73.7% instead of 87.7%).
    for name, train in (("train", True), ("valid", False)):
        expected = load_mnist(cfg.data_dir, train=train).targets.numpy()[:SMOKE_ROWS[name]]
        for streaming in (False, True):
            dataset = mnist_datasets(parquet_root, SMOKE_ROWS, materialize=not streaming)[name]
            labels = dataset.take_batch(SMOKE_ROWS[name] + 1, batch_format="numpy")["label"]
            np.testing.assert_array_equal(labels, expected, err_msg=f"{name}, streaming={streaming}")


def test_materialized_datasets_come_in_equal_blocks_that_workers_get_whole(parquet_root):
    # One block per dataset made streaming_split(equal=True) cut it with a Ray task every epoch.
    assert NUM_BLOCKS % 8 == 0, "1, 2, 4 or 8 workers should each get whole blocks"
    for name, dataset in mnist_datasets(parquet_root, SMOKE_ROWS).items():
        rows = [entry.metadata.num_rows for bundle in dataset.iter_internal_ref_bundles() for entry in bundle.blocks]
        assert rows == [SMOKE_ROWS[name] // NUM_BLOCKS] * NUM_BLOCKS, name


def test_streaming_datasets_need_a_cpu_beside_the_workers(parquet_root):
    streaming = mnist_datasets(parquet_root, SMOKE_ROWS, materialize=False)
    with pytest.raises(ResourceRequestError) as error:
        check_data_resources(ScalingConfig(num_workers=2), streaming, nodes=LAPTOP)
    message = str(error.value)
    assert "reserve 2 of the cluster's 2 CPUs" in message and "['train', 'valid']" in message
    assert "materialize()" in message and "resources_per_worker={'CPU': 0.5}" in message
    half = ScalingConfig(num_workers=2, resources_per_worker={"CPU": cpus_per_worker(2, 2.0, reserve_for_data=1)})
    check_data_resources(half, streaming, nodes=LAPTOP)
    check_data_resources(ScalingConfig(num_workers=2), streaming, nodes=[{"CPU": 4.0}])


def test_the_live_check_fails_at_once_where_fit_would_hang(cfg, parquet_root):
    workers = int(ray.cluster_resources()["CPU"])  # every CPU to training, as a learner's laptop would
    streaming = mnist_datasets(parquet_root, SMOKE_ROWS, materialize=False)
    started = time.monotonic()
    with pytest.raises(ResourceRequestError, match="Ray Data would never get a CPU"):
        check_data_resources(ScalingConfig(num_workers=workers), streaming)
    assert time.monotonic() - started < 10


def test_an_impossible_request_fails_before_any_data_work(cfg, tmp_path):
    started = time.monotonic()
    with pytest.raises(ResourceRequestError, match="asks for 64 workers"):
        prepare_ray_data_training(dataclasses.replace(cfg, num_workers=64, storage_path=tmp_path), SMOKE_ROWS)
    assert time.monotonic() - started < 10
    assert not (tmp_path / "datasets").exists(), "Parquet was written before the request was checked"


@pytest.mark.parametrize("num_workers, total_cpus, reserve, expected", [
    (2, 2.0, 0, 1.0), (1, 2.0, 0, 2.0), (3, 8.0, 0, 2.0), (4, 2.0, 0, 1.0),
    (2, 2.0, 1, 0.5), (2, 16.0, 1, 7.0), (4, 2.0, 1, 0.25),
])
def test_cpus_per_worker(num_workers, total_cpus, reserve, expected):
    assert cpus_per_worker(num_workers, total_cpus, reserve) == expected

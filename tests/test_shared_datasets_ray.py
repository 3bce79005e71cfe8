"""Datasets that concurrent Ray drivers prepare on one storage path: MNIST's Parquet, lesson 10's synthetic images."""

from __future__ import annotations

import pytest

from helpers import storage
from tests.preparers import killed_then_concurrent as _killed_then_concurrent

pytestmark = pytest.mark.ray  # the preparers are drivers of this module's Ray

#: The synthetic dataset's size here: 4 files of ROWS_PER_FILE rows (3,360 images, 40 MiB), so that a write takes
#: long enough to be killed half-way.
SYNTHETIC_FILES = 4


@pytest.fixture
def ray_address(course_ray) -> str:
    """The address of this module's Ray, which the preparers join as drivers."""
    import ray

    return ray.get_runtime_context().gcs_address


def test_mnist_parquet_prepared_by_several_drivers_at_once_on_s3(ray_address, s3_path, small_mnist, tmp_path):
    # On S3 only (27 s here): a local folder goes through the same write_once, tested here with the synthetic images
    # below and without Ray on both kinds of storage in tests/test_shared_datasets.py.
    from helpers.ingest import write_mnist_parquet

    storage_path = s3_path
    spec = {"dataset": "mnist", "root": storage_path, "data_dir": small_mnist, "ray": ray_address}
    parquet = storage.join(storage_path, "datasets", "mnist-parquet")
    _killed_then_concurrent(spec, parquet, tmp_path / "logs", ".parquet", {"train": 2048, "test": 1024})
    copies = storage.complete_copies(parquet)
    assert write_mnist_parquet(small_mnist, storage_path) == copies[0], "a later run reads the earliest complete copy"
    assert storage.complete_copies(parquet) == copies, "a later run wrote nothing"
    for copy in copies:  # lesson 03's listing, in every copy
        for split in ("train", "test"):
            names = [entry.base_name for entry in storage.list_dir(storage.join(copy, split))]
            assert names == ["_SUCCESS"] + [f"part-{index:05d}-0.parquet" for index in range(8)]


def test_synthetic_images_prepared_by_several_drivers_at_once(ray_address, tmp_path):
    # On a local folder only: S3 is tested with MNIST above, through the same write_once.
    from helpers.streaming import GB, ROW_BYTES, ROWS_PER_FILE, find_synthetic_folder, synthetic_folder, synthetic_path

    storage_path = str(tmp_path / "storage")
    size_gb = SYNTHETIC_FILES * ROWS_PER_FILE * ROW_BYTES / GB
    rows = SYNTHETIC_FILES * ROWS_PER_FILE
    spec = {"dataset": "synthetic", "root": storage_path, "size_gb": size_gb, "ray": ray_address}
    dataset_root = synthetic_path(storage_path, size_gb)
    _killed_then_concurrent(spec, dataset_root, tmp_path / "logs", ".parquet", {"rows": rows, "distinct": rows})
    copies = storage.complete_copies(dataset_root)
    assert find_synthetic_folder(storage_path, size_gb) == synthetic_folder(storage_path, size_gb) == copies[0]
    assert storage.complete_copies(dataset_root) == copies, "a later run wrote nothing"

"""helpers.streaming against a local Ray: the synthetic dataset written once, the stream's read tasks, memory peaks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from helpers import storage
from helpers.streaming import (
    COMPLETE_MARKER,
    FOOTER_ACTORS,
    GB,
    IMAGE_SHAPE,
    MIB,
    READ_TASK_BYTES,
    ROW_BYTES,
    ROWS_PER_FILE,
    dataset_marker,
    find_synthetic_folder,
    num_rows_for,
    streaming_dataset,
    synthetic_folder,
    synthetic_path,
)
from helpers.tooling import ray_internals
from helpers.tooling.memory import (
    DATA,
    MemoryPeaks,
)
from tests.support import TINY_GB

pytestmark = pytest.mark.ray  # every test here starts Ray or uses a Ray cluster


def _read_ids(folder: str) -> np.ndarray:
    return np.sort(ray.data.read_parquet(folder).select_columns(["id"]).to_pandas()["id"].to_numpy())


def test_the_dataset_is_written_once_with_about_the_requested_bytes(course_ray, tmp_path):
    folder = synthetic_folder(str(tmp_path), TINY_GB)
    root = synthetic_path(str(tmp_path), TINY_GB)
    assert root == str(tmp_path / "datasets" / "synthetic-images-0.002gb") and storage.complete_copies(root) == [folder]
    assert find_synthetic_folder(str(tmp_path), TINY_GB) == folder
    marker = dataset_marker(folder)
    rows = num_rows_for(TINY_GB)
    assert marker["rows"] == rows and marker["image_shape"] == list(IMAGE_SHAPE)
    assert marker["bytes"] == storage.size(folder) - storage.size(storage.join(folder, COMPLETE_MARKER))
    assert marker["bytes"] == pytest.approx(TINY_GB * GB, rel=0.1), "incompressible: the bytes on disk are the size"
    np.testing.assert_array_equal(_read_ids(folder), np.arange(rows))

    files = {path: path.stat().st_mtime_ns for path in Path(root).rglob("*")}
    assert synthetic_folder(str(tmp_path), TINY_GB) == folder
    assert {path: path.stat().st_mtime_ns for path in Path(root).rglob("*")} == files, "rewritten"


def test_a_copy_of_images_in_the_old_layout_is_left_alone_and_another_written(course_ray, tmp_path):
    old = Path(synthetic_folder(str(tmp_path), TINY_GB))
    marker = json.loads((old / COMPLETE_MARKER).read_text())
    assert marker["image_type"] == "fixed_size_binary[12288]"
    del marker["image_type"]  # what earlier versions wrote, with images as lists of uint8
    (old / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert dataset_marker(str(old)) is None and find_synthetic_folder(str(tmp_path), TINY_GB) is None
    folder = synthetic_folder(str(tmp_path), TINY_GB)
    assert folder != str(old) and dataset_marker(folder)["image_type"] == "fixed_size_binary[12288]"
    assert "image_type" not in json.loads((old / COMPLETE_MARKER).read_text()), "another run may still read it"


def test_an_incomplete_copy_is_ignored_and_left_as_it_is(course_ray, tmp_path):
    root = Path(synthetic_path(str(tmp_path), TINY_GB))
    leftover = root / "20250101T000000.000000Z-0123abcd"  # as `storage.write_once` names a copy
    leftover.mkdir(parents=True)
    (leftover / "part-from-an-interrupted-write.parquet").write_bytes(b"not parquet")  # and no marker
    assert dataset_marker(str(leftover)) is None and storage.incomplete_copies(str(root)) == [str(leftover)]
    folder = synthetic_folder(str(tmp_path), TINY_GB)
    assert Path(folder).parent == root and folder != str(leftover)
    assert (leftover / "part-from-an-interrupted-write.parquet").read_bytes() == b"not parquet"
    np.testing.assert_array_equal(_read_ids(folder), np.arange(num_rows_for(TINY_GB)))
    assert json.loads((Path(folder) / COMPLETE_MARKER).read_text())["rows"] == num_rows_for(TINY_GB)


@pytest.fixture(scope="module")
def four_files(course_ray, tmp_path_factory) -> str:
    """A synthetic dataset of 4 files (3,360 rows, 40 MiB)."""
    folder = synthetic_folder(str(tmp_path_factory.mktemp("streaming")), 4 * ROWS_PER_FILE * ROW_BYTES / GB)
    assert len(list(Path(folder).glob("*.parquet"))) == 4
    return folder


def _operators(stats: str) -> dict[str, int]:
    """Each operator of a dataset's stats, and the tasks it ran."""
    return {name: int(tasks) for name, tasks in re.findall(r"^Operator \d+ (.+?): (\d+) tasks executed", stats,
                                                           re.MULTILINE)}


def test_a_read_task_packs_at_most_read_task_bytes_of_files(four_files):
    names = (ray_internals.PARQUET_READ_TASK_BYTES_VAR, ray_internals.PARQUET_FOOTER_ACTORS_VAR)
    before = {name: os.environ.get(name) for name in names}  # CI sets the footer actors (.ci/run)
    with ray_internals.parquet_read_plan(READ_TASK_BYTES, FOOTER_ACTORS):  # 32 MiB: 3 files of about 10 MiB, then 1
        packed = ray.data.read_parquet(four_files)
    assert {name: os.environ.get(name) for name in names} == before, "set only within the block"
    default = ray.data.read_parquet(four_files)  # Ray Data's 128 MiB: all 4 files in one task
    tasks = [_operators(dataset.materialize().stats())["ReadFilesParquetV2"] for dataset in (packed, default)]
    assert tasks == [2, 1]


def test_the_stream_reads_and_normalises_in_one_task_and_keeps_every_row(four_files):
    dataset = streaming_dataset(four_files).materialize()
    assert list(_operators(dataset.stats())) == ["ListFiles", "ReadFilesParquetV2->MapBatches(normalize_images)"]
    batch = dataset.take_batch(5)
    assert batch["image"].shape == (5, *IMAGE_SHAPE) and batch["image"].dtype == np.float32
    ids = np.sort(np.concatenate([batch["id"] for batch in dataset.iter_batches(batch_size=None)]))
    np.testing.assert_array_equal(ids, np.arange(4 * ROWS_PER_FILE))


def _hold_64_mib(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Ray Data task that holds 64 MiB of its own for half a second, and returns 1 KiB per row (1 MiB blocks: large
    enough for the object store, where Ray keeps objects over 100 KiB)."""
    held = np.ones(64 * MIB, dtype=np.uint8)
    time.sleep(0.5)
    return {"x": batch["id"] * 2, "kib": held[: len(batch["id"]) * 1024].reshape(-1, 1024)}


def test_memory_peaks_see_this_clusters_processes_and_its_object_store(course_ray):
    # A process titled like a Ray Data task, outside this cluster (as another user's Ray would be): not counted.
    stranger = subprocess.Popen(["bash", "-c", 'exec -a "ray::ReadFilesParquetV2" sleep 60'])
    try:
        with MemoryPeaks() as peaks:
            rows = ray.data.range(4000, override_num_blocks=4).map_batches(_hold_64_mib, batch_size=None).take_all()
    finally:
        stranger.kill()
        stranger.wait()
    assert sorted(row["x"] for row in rows) == list(range(0, 8000, 2))
    assert stranger.pid not in {seen["pid"] for seen in peaks.processes}
    holders = [seen for seen in peaks.processes if any("MapBatches(_hold_64_mib)" in title for title in seen["titles"])]
    assert holders and all(seen["kind"] == DATA for seen in holders)
    assert peaks.mib["data_max"] == max(seen["peak_mib"] for seen in holders) > 64 + 50, "a Ray worker holds ~100 MiB"
    assert peaks.mib["object_store"] > 0 and peaks.store["created_bytes"] >= 4000 * 1024
    assert peaks.store["capacity_mib"] > 75 and peaks.store["spilled_bytes"] == 0
    assert all(not title.startswith("ray::MemorySampler") for seen in peaks.processes for title in seen["titles"])

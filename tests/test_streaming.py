"""train_streaming.py's code: its flags, the synthetic dataset written once, the clean-up, the memory bookkeeping.

The script itself runs end to end in its lesson's notebook (nbval); these are the fast unit tests.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import ray

from helpers import storage
from helpers.cluster import StoragePathError
from helpers.plots import streaming_scaling
from helpers.streaming import (
    COMPLETE_MARKER,
    GB,
    IMAGE_SHAPE,
    ROW_BYTES,
    ROW_MULTIPLE,
    check_every_row_once,
    check_free_disk,
    dataset_marker,
    make_images,
    normalize_images,
    num_rows_for,
    remove_synthetic_images,
    synthetic_folder,
    synthetic_path,
)
from helpers.tooling.memory import DATA, TRAIN_WORKER, merge_peaks, process_kind
from helpers.tooling.scripts import parse_streaming_args, requested_size_gb

TINY_GB = 0.002  # 2 MiB: 168 images


def test_the_size_defaults_to_1_gb_and_to_0_01_gb_in_smoke_mode_unless_given():
    def size(data_size_gb, smoke_test):
        return requested_size_gb(argparse.Namespace(data_size_gb=data_size_gb, smoke_test=smoke_test))

    assert size(None, False) == 1.0
    assert size(None, True) == 0.01
    assert size(0.5, True) == 0.5, "an explicit --data-size-gb wins over smoke mode"
    assert size(2, False) == 2.0
    assert parse_streaming_args("x", ["--smoke-test"]).data_size_gb is None
    args = parse_streaming_args("x", ["--data-size-gb", "0.25", "--num-epochs", "3", "--num-workers", "1",
                                      "--json", "r.json"])
    assert (args.data_size_gb, args.num_epochs, args.num_workers, args.json) == (0.25, 3, 1, "r.json")


@pytest.mark.parametrize("argv, message", [
    (["--data-size-gb", "0"], "--data-size-gb must be more than 0, got 0"),
    (["--data-size-gb", "-1"], "--data-size-gb must be more than 0, got -1"),
    (["--data-size-gb", "nan"], "--data-size-gb must be more than 0"),
    (["--num-epochs", "0"], "--num-epochs must be at least 1, got 0"),
    (["--num-workers", "0"], "--num-workers must be at least 1, got 0"),
])
def test_bad_flags_fail_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_streaming_args("x", argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_dataset_larger_than_the_free_disk_is_refused_saying_what_to_do(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("helpers.streaming.shutil.disk_usage", lambda path: usage(2 * GB, int(1.5 * GB), GB // 2))
    check_free_disk(str(tmp_path / "not" / "yet"), 0.25)  # fits; a folder not created yet is fine
    with pytest.raises(StoragePathError) as error:
        check_free_disk(str(tmp_path), 1)
    assert "1 GB of images would not fit on the disk" in str(error.value)
    assert "--data-size-gb" in str(error.value) and "remove_synthetic_images()" in str(error.value)
    check_free_disk("s3://bucket/course", 100)  # a bucket has no free disk to check


def test_row_counts_make_the_size_and_split_evenly():
    assert num_rows_for(1) == 87_384 and num_rows_for(1) * ROW_BYTES == pytest.approx(GB, rel=0.001)
    for size_gb in (TINY_GB, 0.01, 0.25, 0.5, 1):
        rows = num_rows_for(size_gb)
        assert rows % ROW_MULTIPLE == 0 and rows * ROW_BYTES == pytest.approx(size_gb * GB, rel=0.1)
    assert num_rows_for(1e-9) == ROW_MULTIPLE


def test_images_are_deterministic_per_id_and_incompressible():
    batch = make_images({"id": np.arange(10, 20)})
    assert batch["image"].shape == (10, *IMAGE_SHAPE) and batch["image"].dtype == np.uint8
    assert batch["label"].tolist() == [i % 10 for i in range(10, 20)]
    again = make_images({"id": np.array([15, 10])})
    np.testing.assert_array_equal(again["image"], batch["image"][[5, 0]])
    raw = batch["image"].tobytes()
    assert len(zlib.compress(raw)) > 0.99 * len(raw)
    assert not np.array_equal(batch["image"][0], batch["image"][1])
    normalised = normalize_images({"image": batch["image"].copy()})["image"]
    assert normalised.dtype == np.float32 and normalised.min() >= -1 and normalised.max() <= 1
    np.testing.assert_allclose(normalised, batch["image"] / 255 * 2 - 1, atol=1e-6)


def _read_ids(folder: str) -> np.ndarray:
    return np.sort(ray.data.read_parquet(folder).select_columns(["id"]).to_pandas()["id"].to_numpy())


def test_the_dataset_is_written_once_with_about_the_requested_bytes(course_ray, tmp_path):
    folder = synthetic_folder(str(tmp_path), TINY_GB)
    assert folder == synthetic_path(str(tmp_path), TINY_GB) == str(tmp_path / "datasets" / "synthetic-images-0.002gb")
    marker = dataset_marker(folder)
    rows = num_rows_for(TINY_GB)
    assert marker["rows"] == rows and marker["image_shape"] == list(IMAGE_SHAPE)
    assert marker["bytes"] == storage.size(folder) - storage.size(storage.join(folder, COMPLETE_MARKER))
    assert marker["bytes"] == pytest.approx(TINY_GB * GB, rel=0.1), "incompressible: the bytes on disk are the size"
    np.testing.assert_array_equal(_read_ids(folder), np.arange(rows))

    files = {path: path.stat().st_mtime_ns for path in Path(folder).iterdir()}
    assert synthetic_folder(str(tmp_path), TINY_GB) == folder
    assert {path: path.stat().st_mtime_ns for path in Path(folder).iterdir()} == files, "rewritten"


def test_an_incomplete_folder_is_written_again(course_ray, tmp_path):
    folder = Path(synthetic_path(str(tmp_path), TINY_GB))
    folder.mkdir(parents=True)
    (folder / "part-from-an-interrupted-write.parquet").write_bytes(b"not parquet")  # and no marker
    assert dataset_marker(str(folder)) is None
    synthetic_folder(str(tmp_path), TINY_GB)
    assert not (folder / "part-from-an-interrupted-write.parquet").exists()
    np.testing.assert_array_equal(_read_ids(str(folder)), np.arange(num_rows_for(TINY_GB)))
    assert json.loads((folder / COMPLETE_MARKER).read_text())["rows"] == num_rows_for(TINY_GB)


def test_the_clean_up_removes_only_the_synthetic_datasets(tmp_path):
    datasets = tmp_path / "datasets"
    for name, size in (("synthetic-images-0.25gb", 300), ("synthetic-images-1gb", 700), ("mnist-parquet", 50),
                       ("synthetic-images-notes", 5)):
        (datasets / name).mkdir(parents=True)
        (datasets / name / "part-00000.parquet").write_bytes(b"x" * size)
    (tmp_path / "train_streaming-run").mkdir()  # a run folder beside the datasets stays too
    assert remove_synthetic_images(str(tmp_path)) == 1000
    assert sorted(path.name for path in datasets.iterdir()) == ["mnist-parquet", "synthetic-images-notes"]
    assert (tmp_path / "train_streaming-run").is_dir()
    assert remove_synthetic_images(str(tmp_path)) == 0
    assert remove_synthetic_images(str(tmp_path / "nothing-here")) == 0


@pytest.mark.parametrize("title, kind", [
    ("ray::RayTrainWorker", TRAIN_WORKER),
    ("ray::RayTrainWorker.run_train_fn", TRAIN_WORKER),
    ("ray::ReadFilesParquetV2->MapBatches(normalize_images)", DATA),
    ("ray::ReadFilesParquetV2", DATA),
    ("ray::MapBatches(normalize_images)", DATA),
    ("ray::MapBatches(make_images)->Write", DATA),
    ("ray::ListFiles", DATA),
    ("ray::SplitCoordinator.get", DATA),
    ("ray::_StatsActor", DATA),
    ("ray::IDLE", None),
    ("ray::TrainController.run", None),
    ("ray::MemorySampler", None),
    ("/usr/bin/python notebooks/train_streaming.py", None),
    ("ray::Mapper", None),
])
def test_processes_are_told_apart_by_their_titles(title, kind):
    assert process_kind(title) == kind


def test_every_row_once_per_epoch_is_checked():
    def epoch(*ranks):
        return [{"rows": rows, "id_sum": id_sum} for rows, id_sum in ranks]

    check_every_row_once([epoch((2, 1), (2, 5)), epoch((3, 3), (1, 3))], num_rows=4, num_epochs=2)  # ids 0..3
    with pytest.raises(RuntimeError, match="Epoch 1 did not see every row exactly once: the workers saw 3 rows"):
        check_every_row_once([epoch((2, 1), (2, 5)), epoch((2, 1), (1, 3))], num_rows=4, num_epochs=2)
    with pytest.raises(RuntimeError, match="ids adding up to 7"):  # as many rows, but one seen twice
        check_every_row_once([epoch((2, 1), (2, 6))], num_rows=4, num_epochs=1)
    with pytest.raises(RuntimeError, match="Expected 2 reports"):
        check_every_row_once([epoch((4, 6))], num_rows=4, num_epochs=2)


def test_peaks_of_several_nodes_merge_into_maxima_and_sums_in_mib():
    mib = 2**20
    nodes = [{"train_worker_max": 300 * mib, "data_max": 100 * mib, "data_sum": 250 * mib, "object_store": 10 * mib},
             {"train_worker_max": 200 * mib, "data_max": 150 * mib, "data_sum": 150 * mib, "object_store": 5 * mib}]
    assert merge_peaks(400 * mib, nodes) == {"driver": 400.0, "train_worker_max": 300.0, "data_max": 150.0,
                                             "data_sum": 400.0, "object_store": 15.0}


def test_the_scaling_figure_plots_time_and_each_kind_of_memory_against_the_size():
    peaks = {"driver": 500.0, "train_worker_max": 480.0, "data_max": 300.0, "data_sum": 700.0, "object_store": 400.0}
    reports = [{"size_gb_requested": size, "fit_s": 40 * size + 30, "peak_mib": peaks} for size in (1, 0.25, 0.5)]
    fig = streaming_scaling(reports)
    ax_time, ax_memory = fig.axes
    (line,) = ax_time.get_lines()
    assert list(line.get_xdata()) == [0.25, 0.5, 1] and list(line.get_ydata()) == [40.0, 50.0, 70.0]
    assert [line.get_label() for line in ax_memory.get_lines()] == list(peaks)
    assert ax_time.get_xlabel() == ax_memory.get_xlabel() == "data size (GB)"
    assert ax_memory.get_ylabel() == "peak memory (MiB)"

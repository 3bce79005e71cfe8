"""train_streaming.py's code: its flags, the synthetic dataset written once, the clean-up, the memory bookkeeping.

The script itself runs end to end in its lesson's notebook (nbval); these are the fast unit tests.

What needs Ray (the dataset written, the stream's read tasks, memory peaks): tests/test_streaming_ray.py.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import zlib
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from helpers.cluster import StoragePathError
from helpers.data import DataDamagedError
from helpers.plots import streaming_scaling
from helpers.streaming import (
    COMPLETE_MARKER,
    GB,
    IMAGE_SHAPE,
    IMAGE_TYPE,
    MIB,
    ROW_BYTES,
    ROW_MULTIPLE,
    check_every_row_once,
    check_free_disk,
    make_images,
    normalize_images,
    num_rows_for,
    remove_synthetic_images,
    runs_table,
    synthetic_folder,
    synthetic_path,
)
from helpers.tooling.memory import (
    DATA,
    OTHER,
    PEAK_KINDS,
    TRAIN_WORKER,
    merge_peaks,
    merge_store,
    own_bytes,
    process_kind,
)
from helpers.tooling.scripts import parse_streaming_args, requested_size_gb
from tests.support import TINY_GB


def test_the_size_defaults_to_1_gb_and_to_0_01_gb_in_smoke_mode_unless_given():
    def size(data_size_gb, smoke_test):
        return requested_size_gb(argparse.Namespace(data_size_gb=data_size_gb, smoke_test=smoke_test))

    assert size(None, False) == 1.0
    assert size(None, True) == 0.01
    assert size(0.5, True) == 0.5, "an explicit --data-size-gb wins over smoke mode"
    assert size(2, False) == 2.0
    assert parse_streaming_args("x", ["--smoke-test"]).data_size_gb is None
    args = parse_streaming_args("x", ["--data-size-gb", "0.25", "--num-epochs", "3", "--num-workers", "1",
                                      "--json", "r.json", "--object-store-mib", "256"])
    assert (args.data_size_gb, args.num_epochs, args.num_workers, args.json) == (0.25, 3, 1, "r.json")
    assert args.object_store_mib == 256
    assert parse_streaming_args("x", []).object_store_mib is None, "Ray's own object store unless asked"


@pytest.mark.parametrize("argv, message", [
    (["--data-size-gb", "0"], "argument --data-size-gb: must be more than 0, got 0"),
    (["--data-size-gb", "-1"], "argument --data-size-gb: must be more than 0, got -1"),
    (["--data-size-gb", "nan"], "argument --data-size-gb: must be more than 0, got nan"),
    (["--num-epochs", "0"], "argument --num-epochs: must be at least 1, got 0"),
    (["--num-workers", "0"], "argument --num-workers: must be at least 1, got 0"),
    (["--object-store-mib", "64"],
     "argument --object-store-mib: must be at least 75 (Ray's smallest object store), got 64"),
])
def test_bad_flags_fail_with_a_clear_message(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_streaming_args("x", argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_small_object_store_is_refused_on_a_cluster_saying_what_to_do(capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(SystemExit) as exit_info:
        parse_streaming_args("x", ["--object-store-mib", "256"])
    assert exit_info.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "RAY_ADDRESS=10.0.0.1:6379 joins a running cluster" in error
    assert "ray start --object-store-memory=<bytes>" in error and "leave out --object-store-mib" in error
    assert parse_streaming_args("x", []).object_store_mib is None, "without the flag, a cluster is fine"


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


def test_images_are_deterministic_per_id_incompressible_and_one_value_each():
    table = make_images({"id": np.arange(10, 20)})
    assert table.column_names == ["id", "label", "image"] and table.schema.field("image").type == IMAGE_TYPE
    pixels = np.frombuffer(table.column("image").combine_chunks().buffers()[1], np.uint8).reshape(10, *IMAGE_SHAPE)
    assert table.column("label").to_pylist() == [i % 10 for i in range(10, 20)]
    again = make_images({"id": np.array([15, 10])})
    assert again.column("image").to_pylist() == [table.column("image")[5].as_py(), table.column("image")[0].as_py()]
    raw = pixels.tobytes()
    assert len(zlib.compress(raw)) > 0.99 * len(raw)
    assert not np.array_equal(pixels[0], pixels[1])

    normalised = normalize_images(table.slice(3, 4))  # a slice starts inside the buffer: its offset is honoured
    assert normalised["id"].tolist() == [13, 14, 15, 16] and normalised["label"].tolist() == [3, 4, 5, 6]
    images = normalised["image"]
    assert images.shape == (4, *IMAGE_SHAPE) and images.dtype == np.float32
    assert images.min() >= -1 and images.max() <= 1
    np.testing.assert_allclose(images, pixels[3:7] / 255 * 2 - 1, atol=1e-6)


def test_a_damaged_synthetic_copy_is_named_with_the_folder_to_delete(tmp_path):
    copy = Path(synthetic_path(str(tmp_path), TINY_GB)) / "20250101T000000.000000Z-0123abcd"
    copy.mkdir(parents=True)
    (copy / "part-00000.parquet").write_bytes(b"x" * 50)
    (copy / COMPLETE_MARKER).write_text(json.dumps({"rows": 168, "image_type": "fixed_size_binary[12288]"}))
    with pytest.raises(DataDamagedError, match=re.escape(f"The copy of the synthetic images in {copy} is damaged")):
        synthetic_folder(str(tmp_path), TINY_GB)  # found complete: nothing written, no Ray needed


def test_the_clean_up_removes_only_the_synthetic_datasets(tmp_path):
    datasets = tmp_path / "datasets"
    for name, size in (("synthetic-images-0.25gb", 300), ("synthetic-images-1gb", 700), ("mnist-parquet", 50),
                       ("synthetic-images-notes", 5)):
        copy = datasets / name / "20250101T000000.000000Z-0123abcd"  # copies, complete or not: all removed
        copy.mkdir(parents=True)
        (copy / "part-00000.parquet").write_bytes(b"x" * size)
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
    ("ray::FooterReader.read_footers", DATA),
    ("ray::_split_single_block", DATA),
    ("ray::IDLE", OTHER),
    ("ray::TrainController.run", OTHER),
    ("ray::Mapper", OTHER),
    ("ray::MemorySampler", None),
    ("ray::MemorySampler.stop", None),
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
    nodes = [{"train_worker_max": 300 * mib, "data_max": 100 * mib, "data_sum": 250 * mib, "other_sum": 900 * mib,
              "object_store": 10 * mib, "object_store_capacity": 256 * mib, "object_store_fallback": 0,
              "spilled": 0, "restored": 0, "created": 5 * GB},
             {"train_worker_max": 200 * mib, "data_max": 150 * mib, "data_sum": 150 * mib, "other_sum": 100 * mib,
              "object_store": 5 * mib, "object_store_capacity": 128 * mib, "object_store_fallback": 3 * mib,
              "spilled": 7, "restored": 2, "created": GB}]
    peaks = merge_peaks(400 * mib, nodes)
    assert peaks == {"driver": 400.0, "train_worker_max": 300.0, "data_max": 150.0, "data_sum": 400.0,
                     "other_sum": 1000.0, "object_store": 15.0}
    assert tuple(peaks) == PEAK_KINDS
    assert merge_store(nodes) == {"capacity_mib": 384.0, "fallback_mib": 3.0, "spilled_bytes": 7, "restored_bytes": 2,
                                  "created_bytes": 6 * GB}


def test_own_memory_counts_a_process_heap_not_the_shared_memory_it_touches(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm: own_bytes is USS there")
    path = shm / f"test-own-bytes-{os.getpid()}"
    # 64 MiB of this process's own pages, touched: new anonymous pages, as malloc maps for a large buffer. (Not
    # np.ones: late in a long session malloc may hand out freed heap pages that are resident already.)
    with mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as heap:
        before = own_bytes(os.getpid())
        heap[:] = b"\x01" * (64 * MIB)
        after_heap = own_bytes(os.getpid())
        try:
            with path.open("w+b") as file:  # a shared-memory file, as Ray's object store is
                file.truncate(64 * MIB)
                with mmap.mmap(file.fileno(), 64 * MIB) as shared:
                    shared[:] = b"\x01" * (64 * MIB)  # touched, and only this process maps it: in its USS
                    after_shared = own_bytes(os.getpid())
        finally:
            path.unlink()
    assert after_heap - before >= 60 * MIB
    assert abs(after_shared - after_heap) < 8 * MIB


def _report(size_gb: float, fit_s: float, data_max: float, capacity_mib: float = 256.0) -> dict:
    peaks = {"driver": 480.0, "train_worker_max": 490.0, "data_max": data_max, "data_sum": 600.0, "other_sum": 1200.0,
             "object_store": 250.0}
    return {"size_gb_requested": size_gb, "fit_s": fit_s, "epoch_s": [fit_s / 2 - 10, fit_s / 2 - 10],
            "peak_mib": peaks, "object_store": {"capacity_mib": capacity_mib},
            "stream": {"object_store_mib_requested": 256}}


def test_the_scaling_figure_plots_each_size_median_and_spread_against_the_size():
    reports = [_report(1, 100, 350), _report(0.25, 40, 340), _report(1, 120, 360), _report(0.25, 44, 344),
               _report(1, 110, 355), _report(0.25, 42, 342)]
    fig = streaming_scaling(reports)
    ax_time, ax_memory = fig.axes
    fit, epochs = ax_time.containers  # one errorbar per figure: the median's line, and the whiskers min-max
    assert list(fit.lines[0].get_xdata()) == [0.25, 1] and list(fit.lines[0].get_ydata()) == [42.0, 110.0]
    assert list(epochs.lines[0].get_ydata()) == [22.0, 90.0]
    (whiskers,) = fit.lines[2]
    assert [tuple(segment[:, 1]) for segment in whiskers.get_segments()] == [(40.0, 44.0), (100.0, 120.0)]
    assert [container.get_label() for container in ax_memory.containers] == list(reports[0]["peak_mib"])
    data_max = ax_memory.containers[2]
    assert list(data_max.lines[0].get_ydata()) == [342.0, 355.0]
    (capacity,) = [line for line in ax_memory.get_lines() if line.get_label() == "object store capacity"]
    assert list(capacity.get_ydata()) == [256.0, 256.0]
    assert ax_time.get_xlabel() == ax_memory.get_xlabel() == "data size (GB)"
    assert ax_memory.get_ylabel() == "peak memory (MiB)"



def test_the_runs_table_gives_each_size_its_median_and_spread():
    def report(fit_s, data_max, spilled=0):
        return {"num_rows": 43680, "bytes_on_disk": GB // 2, "fit_s": fit_s, "epoch_s": [fit_s / 2, fit_s / 2],
                "peak_mib": {"data_max": data_max},
                "object_store": {"capacity_mib": 256.0, "spilled_bytes": spilled, "fallback_mib": 0.0}}
    table = runs_table({"0.5 GB": [report(40, 300), report(60, 340), report(50, 320, spilled=MIB)]})
    row = table.loc["0.5 GB"]
    assert row["fit (s)"] == "50 [40-60]" and row["an epoch (s)"] == "25 [20-30]"
    assert row["data_max (MiB)"] == "320 [300-340]"
    assert row["runs"] == 3 and row["spilled (MiB)"] == 1.0 and row["store capacity (MiB)"] == 256.0
    assert row["fallback (MiB)"] == 0.0  # none of these reports wrote to fallback files

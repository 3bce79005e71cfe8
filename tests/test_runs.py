"""helpers.runs: run folders never collide, summaries round-trip, on a local folder and on S3."""

from __future__ import annotations

import pytest

from helpers import storage
from helpers.runs import load_summary, new_run_dir, save_summary


@pytest.fixture(params=["local", "s3"])
def storage_path(request, tmp_path):
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("s3_path")


def test_new_run_dirs_are_fresh_and_never_reused(storage_path):
    first = new_run_dir(storage_path, "01_single_device")
    storage.write_text(storage.join(first, "metrics.csv"), "epoch\n0\n")
    second = new_run_dir(storage_path, "01_single_device")  # within the same second: another folder
    assert first != second and storage.is_dir(second) and storage.list_dir(second) == []
    assert storage.read_text(storage.join(first, "metrics.csv")) == "epoch\n0\n"
    assert {storage.basename(path) for path in (first, second)} == \
        {entry.base_name for entry in storage.list_dir(storage.join(storage_path, "01_single_device"))}


def test_summary_round_trip(storage_path):
    assert load_summary(storage_path, "01_single_device") is None
    path = save_summary(storage_path, "01_single_device", {"test_acc": 0.98, "device": "cpu"})
    assert path == storage.join(storage_path, "summaries", "01_single_device.json")
    assert load_summary(storage_path, "01_single_device") == {"test_acc": 0.98, "device": "cpu"}

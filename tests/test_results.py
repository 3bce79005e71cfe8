"""helpers.results: the metrics history callback, the snapshot reader, the run-folder listing (no Ray needed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.train import RunConfig

from helpers.results import (
    HISTORY_FILE,
    SNAPSHOT_FILE,
    MetricsHistory,
    describe_run_folder,
    latest_checkpoint_metrics,
    read_history,
    run_path,
)


@pytest.fixture
def run(tmp_path):
    """A run folder with two checkpoint folders, and the context Ray Train hands the callback."""
    folder = Path(run_path(str(tmp_path), "run-a"))
    for name in ("checkpoint_0", "checkpoint_1"):
        (folder / name).mkdir(parents=True)
        (folder / name / "model.pt").write_bytes(b"0" * 2_000_000)
    context = SimpleNamespace(get_run_config=lambda: RunConfig(storage_path=str(tmp_path), name="run-a"))
    return folder, context


def test_every_report_and_failure_is_appended_in_order(run):
    folder, context = run
    history = MetricsHistory()
    history.after_report(context, [{"epoch": 0, "test_acc": 0.9, "node_id": "aa"}, {"epoch": 0, "node_id": "bb"}],
                         SimpleNamespace(path=str(folder / "checkpoint_0")))
    history.after_exception(context, {1: RuntimeError("Traceback ...\nInjectedFailure: rank 1 fails")})
    history.after_report(context, [{"epoch": 1, "test_acc": 0.95}], None)
    rows = read_history(folder)
    assert list(rows["event"]) == ["report", "failure", "report"]
    assert rows["epoch"].iloc[0] == 0 and rows["checkpoint"].iloc[0] == "checkpoint_0"
    assert rows["error"].iloc[1] == "RuntimeError: InjectedFailure: rank 1 fails" and rows["rank"].iloc[1] == 1
    assert list(rows["kept"]) == [True, False, False], "a report without a checkpoint keeps nothing"
    assert rows["worker_nodes"].iloc[0] == ["aa", "bb"], "the node of every rank, in rank order"
    (folder / "checkpoint_0" / "model.pt").unlink()
    (folder / "checkpoint_0").rmdir()  # what CheckpointConfig(num_to_keep=...) does to a worse checkpoint
    assert not read_history(folder)["kept"].iloc[0]


def test_a_run_without_the_callback_says_how_to_get_a_history(tmp_path):
    with pytest.raises(FileNotFoundError, match="callbacks=\\[MetricsHistory\\(\\)\\]"):
        read_history(tmp_path)


def test_the_latest_registered_checkpoint_comes_from_ray_trains_snapshot(run):
    folder, _ = run
    assert latest_checkpoint_metrics(folder) is None
    (folder / SNAPSHOT_FILE).write_text(json.dumps({"latest_checkpoint_result": None}))
    assert latest_checkpoint_metrics(folder) is None
    (folder / SNAPSHOT_FILE).write_text(json.dumps(
        {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_1", "metrics": {"epoch": 1}}}))
    assert latest_checkpoint_metrics(folder) == {"epoch": 1}


def test_the_run_folder_listing_says_what_each_entry_is(run):
    folder, context = run
    MetricsHistory().after_report(context, [{"epoch": 0}], None)
    (folder / SNAPSHOT_FILE).write_text("{}")  # its name starts with "checkpoint_" too: not a checkpoint
    listing = describe_run_folder(folder).set_index("entry")
    assert list(listing.index) == ["checkpoint_0/", "checkpoint_1/", SNAPSHOT_FILE, HISTORY_FILE]
    assert listing.loc["checkpoint_0/", "files"] == "model.pt" and listing.loc["checkpoint_0/", "size_mb"] == 2.0
    assert listing.loc["checkpoint_1/", "what it is"].startswith("a checkpoint")
    assert listing.loc[SNAPSHOT_FILE, "what it is"].startswith("Ray Train's index of the kept checkpoints")
    assert "MetricsHistory" in listing.loc[HISTORY_FILE, "what it is"]


def test_the_history_and_the_listing_work_on_s3(s3_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a path mistaken for a local one would land
    context = SimpleNamespace(get_run_config=lambda: RunConfig(storage_path=s3_path, name="run-s3"))
    history = MetricsHistory()
    for epoch in range(3):  # an object store has no append: each report rewrites the file, losing nothing
        history.after_report(context, [{"epoch": epoch}], None)
    folder = run_path(s3_path, "run-s3")
    assert folder == f"{s3_path}/run-s3"
    assert list(read_history(folder)["epoch"]) == [0, 1, 2]
    assert list(describe_run_folder(folder)["entry"]) == [HISTORY_FILE]
    assert latest_checkpoint_metrics(folder) is None
    assert list(tmp_path.iterdir()) == [], "an s3:// path turned into a local folder"

"""helpers.runs: run folders never collide, summaries round-trip."""

from __future__ import annotations

from helpers.runs import load_summary, new_run_dir, save_summary


def test_new_run_dirs_are_fresh_and_never_reused(tmp_path):
    first = new_run_dir(tmp_path, "01_single_device")
    (first / "model.pt").write_bytes(b"weights")
    second = new_run_dir(tmp_path, "01_single_device")  # same second: gets a suffix
    assert first != second and second.is_dir() and not any(second.iterdir())
    assert (first / "model.pt").read_bytes() == b"weights"
    assert first.parent == second.parent == tmp_path / "01_single_device"


def test_summary_round_trip(tmp_path):
    assert load_summary(tmp_path, "01_single_device") is None
    path = save_summary(tmp_path, "01_single_device", {"test_acc": 0.98, "device": "cpu"})
    assert path == tmp_path / "summaries" / "01_single_device.json"
    assert load_summary(tmp_path, "01_single_device") == {"test_acc": 0.98, "device": "cpu"}

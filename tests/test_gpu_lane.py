"""helpers.tooling.gpu_lane and run_recorder, without a GPU: which lessons run, their budgets, the report's layout, and
each Ray Train run's start-up split, from real kernels and a real Ray Train run.

The lane run for real, in kernels with Ray: tests/test_gpu_lane_ray.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from helpers.tooling import gpu_lane
from helpers.tooling.gpu_lane import LESSONS, NOT_IN_LANE, NOTEBOOKS, budgets, run_lane, select
from helpers.tooling.run_recorder import summarize_runs


def trains(notebook: Path) -> bool:
    """True when a notebook's code trains a model: a TorchTrainer, a Tuner, or an optimizer step."""
    code = "\n".join(cell.source for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code")
    return any(marker in code for marker in ("TorchTrainer(", "Tuner(", "optimizer.step()", "train_single_device("))


def test_every_lesson_that_trains_is_in_the_lane_or_says_why_not():
    training = {path.name[:2] for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if trains(path)}
    assert training - NOT_IN_LANE.keys() == set(LESSONS), "a lesson that trains is missing from LESSONS"
    assert NOT_IN_LANE.keys() <= training and not set(LESSONS) & set(NOT_IN_LANE)
    for lesson in LESSONS.values():
        assert (NOTEBOOKS / lesson.notebook).is_file() and lesson.notebook.startswith(lesson.number)
        assert lesson.budget_s >= 10 * 60


def test_the_selection_keeps_the_order_given_and_refuses_lessons_outside_the_lane():
    assert [lesson.number for lesson in select(None)] == list(LESSONS)
    assert [lesson.number for lesson in select(["09", "01", "09"])] == ["09", "01"]
    with pytest.raises(ValueError, match=r"not in the GPU lane: 06, 07 .*06: its labs train only to make a hang"):
        select(["01", "06", "07"])
    with pytest.raises(ValueError, match="not in the GPU lane: 99"):
        select(["99"])


def test_budgets_are_seconds_per_lesson():
    assert budgets(["09=600", "01=90.5"]) == {"09": 600.0, "01": 90.5}
    assert budgets(None) == {}
    for wrong in ("09=0", "09=-1", "09=ten", "09"):
        with pytest.raises(ValueError, match="SECONDS > 0"):
            budgets([wrong])
    with pytest.raises(ValueError, match="'06' is not in the GPU lane"):
        budgets(["06=60"])


def test_without_a_gpu_the_lane_says_so_in_one_line_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(gpu_lane, "gpus", lambda: [])
    assert gpu_lane.main(["--lessons", "01"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "No GPU here" in captured.err


def test_a_bad_selection_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as stopped:
        gpu_lane.main(["--lessons", "08"])
    assert stopped.value.code == 2 and "not in the GPU lane: 08" in capsys.readouterr().err


def record(run: str, event: str, t: float, **fields) -> dict:
    return {"run": run, "event": event, "t": t, **fields}


def test_the_start_up_is_split_between_ray_and_the_course():
    records = [
        record("a", "fit", 100.0), record("a", "controller_started", 102.0),
        record("a", "workers_started", 110.0, num_workers=2), record("a", "training_started", 111.5),
        record("a", "report", 130.0, metrics={"test_acc": 0.5, "images_per_s": 10.0, "epoch_started_at": 120.0}),
        record("a", "report", 140.0, metrics={"test_acc": 0.75, "images_per_s": 30.0, "epoch_started_at": 131.0}),
        record("a", "report", 150.0, metrics={"test_acc": 0.7, "images_per_s": 20.0, "epoch_started_at": 141.0}),
        record("a", "finished", 151.0, error=None),
        # lesson 09's loop: seconds since the driver launched the run; a run that never reported
        record("b", "fit", 200.0), record("b", "controller_started", 201.0), record("b", "workers_started", 205.0,
                                                                                       num_workers=1),
        record("b", "training_started", 206.0), record("b", "report", 230.0, metrics={"start_s": 16.0}),
        record("c", "fit", 300.0), record("c", "controller_started", 301.0),
    ]
    a, b, c = summarize_runs(records)
    assert a == {"run": "a", "num_workers": 2, "reports": 3, "finished": True, "error": None, "controller_s": 2.0,
                 "workers_s": 8.0, "process_group_s": 1.5, "ray_startup_s": 11.5, "data_and_model_s": 8.5,
                 "to_first_report_s": 18.5, "test_acc": 0.7, "images_per_s": 20.0, "device": None}
    assert (b["data_and_model_s"], b["ray_startup_s"], b["finished"]) == (10.0, 6.0, False)
    assert (c["reports"], c["workers_s"], c["ray_startup_s"], c["data_and_model_s"]) == (0, None, None, None)


def test_the_recorder_is_named_where_ray_train_looks_for_it():
    from helpers.tooling.ray_internals import env_train_callbacks
    from helpers.tooling.run_recorder import RunRecorder, recording_env

    env = recording_env("/tmp/records.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        (callback,) = env_train_callbacks()
    assert isinstance(callback, RunRecorder) and callback.path == "/tmp/records.jsonl"


def test_a_deadline_for_the_whole_lane_cuts_budgets_and_starts_no_lesson_it_cannot_give_a_minute(tmp_path):
    lessons = [LESSONS["01"], LESSONS["09"]]
    report = run_lane(lessons, tmp_path / "out", None, {"09": 600}, [], [], deadline_s=gpu_lane.MIN_LESSON_S - 1)
    chosen = [result for result in report["lessons"] if result["lesson"] in ("01", "09")]
    assert [(result["status"], result["budget_s"]) for result in chosen] == [("not run", LESSONS["01"].budget_s),
                                                                             ("not run", 600)]
    assert all(result["error"] == f"the lane's deadline of {gpu_lane.MIN_LESSON_S - 1} s came first"
               for result in chosen)
    assert not (tmp_path / "out" / LESSONS["01"].notebook).exists(), "no kernel started"


def test_a_deadline_must_be_positive(monkeypatch, capsys):
    monkeypatch.setattr(gpu_lane, "gpus", lambda: [{"name": "a GPU", "memory_mib": 1, "driver": "1"}])
    with pytest.raises(SystemExit) as stopped:
        gpu_lane.main(["--lessons", "01", "--deadline", "0"])
    assert stopped.value.code == 2 and "argument --deadline: must be more than 0, got 0" in capsys.readouterr().err


REPORT = NOTEBOOKS / "results" / "gpu.json"


def test_the_committed_report_has_the_lanes_layout_and_the_readme_quotes_it():
    report = json.loads(REPORT.read_text())
    assert report["schema"] == gpu_lane.SCHEMA and report["mode"] == "full"
    assert {"gpus", "cuda", "torch", "ray", "python", "cpus"} <= report["machine"].keys() and report["machine"]["gpus"]
    reported = [result["lesson"] for result in report["lessons"]]
    assert reported == [number for number in LESSONS if number in reported], "the lane's lessons, in its order"
    assert set(LESSONS) - set(reported) <= {"12"}, "only a lesson added after the lane's run may be missing from it"
    for result in report["lessons"]:
        assert result["status"] in ("passed", "failed", "timed out", "not run")
        if result["status"] != "not run":
            assert {"wall_s", "budget_s", "gpu", "runs", "summaries", "cells_run", "cells"} <= result.keys()
            assert result["gpu"]["samples"] > 0 and result["wall_s"] > 0
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    rows = {line[2:4]: line for line in readme.splitlines() if line[:5].startswith("| ") and line[2:4].isdigit()}
    for result in report["lessons"]:  # the README's "one GPU" column is the report's, never a figure of its own
        assert rows[result["lesson"]].endswith(f"| {gpu_lane.table_cell(result)} |"), result["lesson"]
    for number in NOT_IN_LANE:
        assert rows[number].endswith("| not in the GPU lane |")
    for number in set(LESSONS) - set(reported):  # added after the lane's run: no GPU figure yet
        assert rows[number].endswith("| not measured yet |"), number


def test_a_recorder_that_cannot_write_warns_once_and_never_fails_the_run(tmp_path):
    from types import SimpleNamespace

    from helpers.tooling.run_recorder import RECORD_VAR, RunRecorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RECORD_VAR, str(tmp_path / "gone" / "records.jsonl"))  # its folder does not exist
        recorder = RunRecorder()
    with pytest.warns(RuntimeWarning, match="stops recording run r"):
        recorder.after_controller_start(SimpleNamespace(run_config=SimpleNamespace(name="r")))
    recorder.after_report(None, [{"test_acc": 0.5}])  # no second warning, no exception: Ray Train would fail the run
    assert recorder.path is None


def test_setup_passes_the_recorder_on_to_every_worker(monkeypatch):
    from helpers.config import load_config
    from helpers.session import runtime_env
    from helpers.tooling.run_recorder import recording_env

    for name, value in recording_env("/tmp/records.jsonl").items():
        monkeypatch.setenv(name, value)
    env_vars = runtime_env(load_config({}))["env_vars"]
    assert {name: env_vars.get(name) for name in recording_env("/tmp/records.jsonl")} == recording_env(
        "/tmp/records.jsonl"), "a Tune trial or a job's driver that calls fit() records its runs too"
    for name in recording_env("/tmp/records.jsonl"):
        monkeypatch.delenv(name)
    assert not set(recording_env("x")) & set(runtime_env(load_config({}))["env_vars"])

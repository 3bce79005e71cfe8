"""The GPU lane run for real: each notebook in full mode, and its report."""

from __future__ import annotations

import json

import nbformat
import psutil
import pytest

from helpers.system import wait_until
from helpers.tooling.gpu_lane import LESSONS, Lesson, run_lane
from tests.support import notebook

pytestmark = [pytest.mark.ray, pytest.mark.notebook]  # the lane starts Ray and runs the notebooks


#: A lesson in miniature: the course's setup(), a Ray Train run whose loop reports when its epoch began, a summary.
TRAINS = ['from helpers import setup\ncfg = setup()', '''
import time
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

def loop(config):
    time.sleep(0.5)  # the course's part: reading data, building the model
    for epoch in range(2):
        started_at = time.time()
        ray.train.report({"epoch": epoch, "test_acc": 0.5 + epoch / 4, "images_per_s": 100.0,
                          "epoch_started_at": started_at})

result = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
                      run_config=RunConfig(storage_path=cfg.storage_path, name="lane-test")).fit()''',
          'from helpers.runs import save_summary\nsave_summary(cfg.storage_path, "lane_test", {"mode": cfg.mode})']


def test_the_lane_runs_each_notebook_in_full_mode_and_reports_what_happened(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    notebook(folder / "t1_trains.ipynb", *TRAINS)
    pid_file = tmp_path / "actor.pid"
    notebook(folder / "t2_slow.ipynb", "import os, time, ray\nray.init(num_cpus=1, include_dashboard=False)",
             f"@ray.remote\nclass A:\n    def pid(self):\n        return os.getpid()\n\na = A.remote()\n"
             f"open({str(pid_file)!r}, 'w').write(str(ray.get(a.pid.remote())))", "time.sleep(600)", "print('never')")
    notebook(folder / "t3_fails.ipynb", "x = 1", "raise ValueError('the first error')", "print('never')")
    before = (folder / "t1_trains.ipynb").read_bytes()
    lessons = [Lesson("t1", "t1_trains.ipynb", 300), Lesson("t2", "t2_slow.ipynb", 300), Lesson("t3", "t3_fails.ipynb",
                                                                                                    300)]
    report_path, out = tmp_path / "gpu.json", tmp_path / "out"

    # The budget leaves a loaded 2-core machine time for ray.init() and the actor (over 12 s in one CI run); the rest
    # of it, t2 sleeps.
    report = run_lane(lessons, out, report_path, {"t2": 25}, [], ["--lessons", "t1", "t2", "t3"],
                      notebooks_dir=folder)

    assert json.loads(report_path.read_text()) == report == json.loads((out / "gpu.json").read_text())
    assert report["schema"] == 1 and report["mode"] == "full" and report["machine"]["gpus"] == []
    assert {"cuda", "torch", "ray", "python", "cpus"} <= report["machine"].keys()
    by_number = {lesson["lesson"]: lesson for lesson in report["lessons"]}
    assert [by_number[number]["status"] for number in LESSONS] == ["not run"] * len(LESSONS)
    trained, slow, failed = by_number["t1"], by_number["t2"], by_number["t3"]

    assert (trained["status"], trained["error"], trained["cells_run"], trained["cells"]) == ("passed", None, 3, 3)
    assert trained["summaries"] == {"lane_test": {"mode": "full"}}, "the lane runs lessons in full mode"
    (run,) = trained["runs"]
    assert (run["run"], run["num_workers"], run["reports"], run["finished"], run["test_acc"]) == ("lane-test", 1, 2,
                                                                                                   True, 0.75)
    assert 0 < run["ray_startup_s"] < trained["wall_s"] and 0.4 < run["data_and_model_s"] < 30
    assert run["ray_startup_s"] == pytest.approx(run["controller_s"] + run["workers_s"] + run["process_group_s"],
                                                 abs=0.05)
    executed = nbformat.read(out / "t1_trains.ipynb", as_version=4)
    assert "full" in "".join(output.get("text", "") for output in executed.cells[0].outputs)
    assert (folder / "t1_trains.ipynb").read_bytes() == before, "the committed notebook is never written"

    assert (slow["status"], slow["cells_run"], slow["failed_cell"], slow["budget_s"]) == ("timed out", 2, 2, 25)
    assert slow["error"] == "over its budget of 25 s, in cell 2" and 23 < slow["wall_s"] < 105
    actor = int(pid_file.read_text())
    assert not _alive_after(actor, 30), "the lesson's Ray outlived the lane's stop"

    assert (failed["status"], failed["failed_cell"], failed["error"]) == ("failed", 1, "ValueError: the first error")
    assert failed["gpu"] is None and failed["runs"] == [] and failed["cells_run"] == 1


def _alive_after(pid: int, seconds: float) -> bool:
    try:
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   seconds, 0.5, f"process {pid} ending")
    except TimeoutError:
        return True
    return False

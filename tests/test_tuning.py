"""Lesson 11's search, without Ray: its sizing, the replay of ASHA against Ray's own scheduler, what the course reads
from a search's folder, the script's flags, and the interruption.

The search itself runs on the 3-node cluster of tests/test_multinode.py (one cluster for the suite: starting another
would cost about a minute): its trials train on both worker nodes, their checkpoints land on the shared storage path,
the best checkpoint reproduces its accuracy, and the search continued after Ctrl-C does not run finished trials again.
Lesson 11 itself, under nbval, interrupts and restores its search in the notebook's kernel.
"""

from __future__ import annotations

import json
import pickle
import signal
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from ray.train import ScalingConfig
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from helpers.cluster import Capacity, ResourceRequestError
from helpers.config import REPO_ROOT, load_config
from helpers.tooling.scripts import SEARCH_DEFAULTS, SMOKE_SEARCH_DEFAULTS, parse_tune_args
from helpers.tuning import (
    ARRIVED_AT,
    SEARCH_SESSION,
    InterruptMidSearch,
    ResultOrder,
    asha_decisions,
    best_kept_checkpoint,
    check_search_resources,
    plan_search,
    search_state,
    trial_table,
)
from tests.support import write_run_folder

LAPTOP = Capacity(nodes=[{"CPU": 2.0}])
#: tests/test_multinode.py's cluster: a head with no CPU, two worker nodes with 1 CPU each.
THREE_NODES = Capacity(nodes=[{}, {"CPU": 1.0}, {"CPU": 1.0}])
ONE_GPU = Capacity(nodes=[{"CPU": 8.0, "GPU": 1.0}])
EIGHT_GPUS = Capacity(nodes=[{"CPU": 64.0, "GPU": 8.0}])


@pytest.mark.parametrize("capacity,variables,expected", [
    (LAPTOP, {}, (2, 2, False, {"CPU": 0.5})),  # 2 trials x 2 workers share 2 CPUs
    (THREE_NODES, {}, (2, 2, False, {"CPU": 0.5})),  # each trial on one worker node
    (Capacity(nodes=[{"CPU": 4.0}]), {}, (2, 2, False, {"CPU": 1.0})),  # whole CPUs when there are enough
    (ONE_GPU, {}, (1, 1, True, {"CPU": 8.0, "GPU": 1.0})),  # the GPU goes to one trial at a time
    (EIGHT_GPUS, {"COURSE_NUM_WORKERS": "2"}, (2, 2, True, {"CPU": 16.0, "GPU": 1.0})),  # 4 GPUs of 8 busy
])
def test_plan_search_sizes_the_trials_for_the_nodes(capacity, variables, expected):
    plan = plan_search(load_config(variables), max_concurrent_trials=2, capacity=capacity)
    assert (plan.max_concurrent_trials, plan.num_workers, plan.use_gpu, plan.resources_per_worker) == expected
    scaling = ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                            resources_per_worker=plan.resources_per_worker)
    check_search_resources(scaling, plan.max_concurrent_trials, capacity)  # the plan always fits


def test_check_search_resources_says_how_many_trials_fit():
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
    with pytest.raises(ResourceRequestError, match=r"only 2 trial\(s\) fit at once") as error:
        check_search_resources(scaling, 4, LAPTOP)
    assert str(error.value).endswith("To fix it: at most 2 trial(s) at once: max_concurrent=2 on your Basic"
                                     "VariantGenerator, or TuneConfig(max_concurrent_trials=2) without a search_alg.")
    assert "WorkerGroupStartupTimeoutError" in str(error.value)
    with pytest.raises(ResourceRequestError, match="No trial can ever start"):
        check_search_resources(ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1.0}), 1, LAPTOP)


def test_check_search_resources_names_the_script_s_flags_for_the_script():
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
    with pytest.raises(ResourceRequestError, match=r"To fix it: --max-concurrent-trials 2\.$"):
        check_search_resources(scaling, 4, LAPTOP, flags=True)
    with pytest.raises(ResourceRequestError, match=r"fewer workers per trial \(--num-workers\)"):
        check_search_resources(ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1.0}), 1, LAPTOP, flags=True)


def test_tune_ray_ddp_with_too_many_concurrent_trials_names_its_flag(monkeypatch, tmp_path):
    # The script's own sizing on a 2-CPU laptop, Ray left out: it fails before the search with its flag as the fix.
    import importlib.util

    import helpers.tuning

    spec = importlib.util.spec_from_file_location("tune_ray_ddp", REPO_ROOT / "notebooks" / "tune_ray_ddp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "start_ray", lambda cfg: None)
    monkeypatch.setattr(script, "check_storage_path", lambda path: path)
    monkeypatch.setattr(helpers.tuning, "cluster_capacity", lambda: LAPTOP)
    with pytest.raises(ResourceRequestError, match=r"To fix it: --max-concurrent-trials 4\.$") as error:
        script.main(["--max-concurrent-trials", "100", "--num-workers", "2", "--storage-path", str(tmp_path)])
    assert "TuneConfig" not in str(error.value)


def simulated_search(seed: int, max_t: int, num_trials: int = 6) -> tuple[pd.DataFrame, list[str]]:
    """A search fed to Ray 2.60's own ASHAScheduler, result by result: trials start in order, two at a time, and
    report their epochs interleaved at random; a stopped trial reports no more. Returns the results as Tune saw
    them, in order, and the scheduler's decision on each."""
    rng = np.random.default_rng(seed)
    scheduler = ASHAScheduler(time_attr="epoch", metric="test_acc", mode="max", grace_period=1, reduction_factor=2,
                              max_t=max_t)
    remaining = {f"t{index}": list(range(max_t + 1)) for index in range(num_trials)}
    quality = {trial: rng.uniform(0.1, 0.9) for trial in remaining}
    results, decisions = [], []
    while remaining:
        running = list(remaining)[:2]
        trial = running[rng.integers(len(running))]
        epoch = remaining[trial].pop(0)
        if epoch == 0:
            scheduler.on_trial_add(None, SimpleNamespace(trial_id=trial))
        value = round(quality[trial] + 0.02 * epoch + rng.normal(0, 0.05), 4)
        decisions.append(scheduler.on_trial_result(None, SimpleNamespace(trial_id=trial),
                                                   {"epoch": epoch, "test_acc": value}))
        done = decisions[-1] == TrialScheduler.STOP or not remaining[trial]
        results.append({"trial_id": trial, "epoch": epoch, "test_acc": value, "done": done, SEARCH_SESSION: 1.0})
        if done:  # Tune hands the trial's last result to the scheduler once more as the trial ends
            scheduler.on_trial_complete(None, SimpleNamespace(trial_id=trial), {"epoch": epoch, "test_acc": value})
            del remaining[trial]
    return pd.DataFrame(results), decisions


@pytest.mark.parametrize("seed", range(20))
def test_asha_decisions_replay_what_rays_scheduler_decided(seed):
    history, by_ray = simulated_search(seed, max_t=3)  # rungs at epochs 1 and 2: every later epoch meets one
    replayed = asha_decisions(history, metric="test_acc", mode="max", time_attr="epoch", grace_period=1,
                              reduction_factor=2, max_t=3)
    expected = ["end (max_t)" if epoch >= 3 else "stop" if action == TrialScheduler.STOP else "continue"
                for action, epoch in zip(by_ray, history["epoch"]) if epoch >= 1]
    assert list(replayed["decision"]) == expected


@pytest.mark.parametrize("seed", range(10))
def test_asha_decisions_stop_the_trials_rays_scheduler_stopped(seed):
    history, by_ray = simulated_search(seed, max_t=5, num_trials=8)  # rungs at 1, 2 and 4
    replayed = asha_decisions(history, metric="test_acc", mode="max", time_attr="epoch", grace_period=1,
                              reduction_factor=2, max_t=5)
    stopped_by_ray = {trial for trial, epoch, action in zip(history["trial_id"], history["epoch"], by_ray)
                      if action == TrialScheduler.STOP and epoch < 5}
    assert set(replayed.loc[replayed["decision"] == "stop", "trial_id"]) == stopped_by_ray


def test_a_restored_search_starts_asha_afresh():
    history = pd.DataFrame([
        {"trial_id": "a", "epoch": 1, "test_acc": 0.9, SEARCH_SESSION: 1.0},
        {"trial_id": "b", "epoch": 1, "test_acc": 0.5, SEARCH_SESSION: 1.0},  # below a's 0.9: stops
        {"trial_id": "c", "epoch": 1, "test_acc": 0.4, SEARCH_SESSION: 2.0},  # first at the rung after the restore
    ])
    decisions = asha_decisions(history, "test_acc", "max", time_attr="epoch", grace_period=1, reduction_factor=2,
                               max_t=3)
    assert list(decisions["decision"]) == ["continue", "stop", "continue"]
    assert list(decisions["earlier"]) == [[], [0.9], []]
    table = trial_table(history.assign(lr=1e-3, global_batch_size=128), decisions)
    assert list(table["stopped early"]) == [False, True, False]
    assert table.loc["b", "why"] == "after epoch 1: 0.500 < 0.900, the cutoff of the 1 trial(s) there before it"


def test_a_trial_that_resumed_past_a_rung_counts_there_once_it_ends():
    # Lesson 11's search after its restore: trial "a" resumed at epoch 3 (its epoch 2 ended while the search
    # stopped), so ASHA first sees it at max_t, where it stops it unrecorded; as "a" ends, ASHA records its value
    # at rung 2. Trial "c" then reaches rung 2 above the median of "b" and "a": Ray's scheduler lets it go on.
    scheduler = ASHAScheduler(time_attr="epoch", metric="test_acc", mode="max", grace_period=1, reduction_factor=2,
                              max_t=3)
    rows, by_ray = [("b", 1, 0.94, False), ("b", 2, 0.947, False), ("a", 3, 0.867, True), ("c", 1, 0.95, False),
                    ("c", 2, 0.913, False)], []
    for trial in ("b", "a", "c"):
        scheduler.on_trial_add(None, SimpleNamespace(trial_id=trial))
    for trial, epoch, value, done in rows:
        result = {"epoch": epoch, "test_acc": value}
        by_ray.append(scheduler.on_trial_result(None, SimpleNamespace(trial_id=trial), result))
        if done:
            scheduler.on_trial_complete(None, SimpleNamespace(trial_id=trial), result)
    assert by_ray[-1] == TrialScheduler.CONTINUE
    history = pd.DataFrame([{"trial_id": trial, "epoch": epoch, "test_acc": value, "done": done, SEARCH_SESSION: 2.0}
                            for trial, epoch, value, done in rows])
    decisions = asha_decisions(history, "test_acc", "max", time_attr="epoch", grace_period=1, reduction_factor=2,
                               max_t=3)
    assert list(decisions["decision"]) == ["continue", "continue", "end (max_t)", "continue", "continue"]
    assert decisions.iloc[-1]["earlier"] == [0.947, 0.867]


def test_result_order_stamps_each_result_with_its_arrival():
    order = ResultOrder()
    order.setup()
    first, second = {"epoch": 0}, {"epoch": 0}
    order.on_trial_result(0, [], None, first)
    order.on_trial_result(0, [], None, second)
    assert first[SEARCH_SESSION] == second[SEARCH_SESSION] <= first[ARRIVED_AT] <= second[ARRIVED_AT]


def write_trial(folder, trial_id: str, results: list[dict]) -> None:
    """A trial's folder as Tune 2.60 names and fills it: `<trainable>_<trial id>_<index>_<config>_<date>/`."""
    trial = folder / f"train_driver_{trial_id}_{trial_id[-1]}_global_batch_size=64,lr=0.0010_2026-11-25_18-04-51"
    trial.mkdir()
    (trial / "result.json").write_text("".join(json.dumps({"trial_id": trial_id, **r}) + "\n" for r in results))


def test_search_state_reads_the_statuses_tune_saved_and_the_results(tmp_path):
    write_trial(tmp_path, "8f957_00000", [{"epoch": 0}, {"epoch": 1, "done": True}])
    write_trial(tmp_path, "8f957_00001", [{"epoch": 0}])
    write_trial(tmp_path, "8f957_00002", [])  # started, no result yet
    trial_data = [[json.dumps({"trial_id": trial, "status": status}), "{}"] for trial, status in
                  [("8f957_00000", "TERMINATED"), ("8f957_00001", "RUNNING"), ("8f957_00002", "RUNNING"),
                   ("8f957_00003", "PENDING")]]
    (tmp_path / "experiment_state-2026-11-25_18-04-00.json").write_text(json.dumps({"trial_data": []}))
    (tmp_path / "experiment_state-2026-11-25_18-05-36.json").write_text(json.dumps({"trial_data": trial_data}))
    state = search_state(str(tmp_path))  # the newest state file
    assert state.to_dict("index") == {
        "8f957_00000": {"status": "TERMINATED", "results": 2}, "8f957_00001": {"status": "RUNNING", "results": 1},
        "8f957_00002": {"status": "RUNNING", "results": 0}, "8f957_00003": {"status": "PENDING", "results": 0}}


def test_interrupt_mid_search_presses_ctrl_c_once_a_trial_finished_and_another_reported_its_first_epoch():
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        press = InterruptMidSearch()
        running, pending = SimpleNamespace(status="RUNNING"), SimpleNamespace(status="PENDING")
        press.on_trial_result(0, [running, running, pending], running, {"epoch": 0})  # nothing has finished
        trials = [SimpleNamespace(status="TERMINATED"), running, pending]
        press.on_trial_result(0, trials, running, {"epoch": 1})  # mid-run, but not just begun
        assert pressed == []
        restored = pickle.loads(pickle.dumps(press))  # what Tuner.restore brings back
        press.on_trial_result(0, trials, running, {"epoch": 0})
        press.on_trial_result(0, trials, running, {"epoch": 0})  # once only
        restored.on_trial_result(0, trials, running, {"epoch": 0})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pressed == [signal.SIGINT]


def test_tune_script_flags_default_to_the_mode(monkeypatch):
    monkeypatch.delenv("COURSE_SMOKE_TEST", raising=False)  # full mode unless --smoke-test (CI sets it)
    args = parse_tune_args("x", ["--storage-path", "/tmp/x"])
    assert (args.num_samples, args.epochs, args.max_concurrent_trials) == (SEARCH_DEFAULTS["num_samples"],
                                                                           SEARCH_DEFAULTS["epochs"], None)
    args = parse_tune_args("x", ["--smoke-test", "--num-samples", "3", "--max-concurrent-trials", "1"])
    assert (args.num_samples, args.epochs, args.max_concurrent_trials) == (3, SMOKE_SEARCH_DEFAULTS["epochs"], 1)
    for wrong in (["--epochs", "2"], ["--num-samples", "0"], ["--max-concurrent-trials", "0"]):
        with pytest.raises(SystemExit):
            parse_tune_args("x", wrong)


def test_the_best_kept_checkpoint_comes_from_the_run_not_from_tune_s_last_result(tmp_path):
    # A trial stopped by Ctrl-C after Tune had its epoch 1: its run still finished epoch 2, whose checkpoint, the best
    # and the latest, replaced epoch 1's (num_to_keep=1). Tune's last result names epoch 1's, deleted since.
    run = tmp_path / "search-00000"
    reports = [(f"checkpoint_{epoch}", {"epoch": epoch, "test_acc": acc}) for epoch, acc in enumerate([0.5, 0.7, 0.8])]
    write_run_folder(run, reports, [2], history=False)
    checkpoint, metrics = best_kept_checkpoint(str(run), "test_acc")
    assert (metrics["epoch"], metrics["test_acc"], checkpoint.path) == (2, 0.8, str(run / "checkpoint_2"))
    # Kept: the best by test_acc (epoch 1) and the latest (epoch 2): the best, not the latest.
    reports = [(f"checkpoint_{epoch}", {"epoch": epoch, "test_acc": acc}) for epoch, acc in enumerate([0.5, 0.9, 0.8])]
    write_run_folder(tmp_path / "kept-two", reports, [1, 2], history=False)
    assert best_kept_checkpoint(str(tmp_path / "kept-two"), "test_acc")[1]["epoch"] == 1

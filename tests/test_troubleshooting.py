"""helpers.troubleshooting: the measurements lesson 06's labs rely on.

From a real Ray Data shard iterator, and against the pinned Ray's controller log: tests/test_troubleshooting_ray.py.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys

import pandas as pd
import pytest
import torch

from helpers.troubleshooting import (
    ITERATOR_LINES,
    compare_rounds,
    controller_records,
    iterator_times,
    memory_limit,
    native_stack,
    process_memory_mb,
    startup_phases,
    training_thread,
    worker_stack,
)


def test_iterator_times_reads_units_and_missing_lines():
    text = ("Dataset iterator time breakdown:\n* Total time overall: 12.58s\n"
            "    * Total time user thread is blocked by Ray Data iter_batches: 101.97ms\n"
            "    * Total time spent waiting for the first batch after starting iteration: 250.0us\n")
    times = iterator_times(text)
    assert times["total_s"] == pytest.approx(12.58) and times["blocked_s"] == pytest.approx(0.10197)
    assert times["first_batch_s"] == pytest.approx(250e-6) and times["initialize_s"] == 0.0
    assert iterator_times("") == dict.fromkeys(ITERATOR_LINES, 0.0)


#: A py-spy dump of a RayTrainWorker whose loop waits in ray.train.report (Ray 2.60, lesson 06's lab A).
HUNG_RANK = """Process 2362: ray::RayTrainWorker
Python v3.11.7 (/usr/bin/python3.11)

Thread 2362 (active): "MainThread"
    Worker.main_loop (ray/_private/worker.py:1069)
Thread 2631 (idle): "TrainingThread(train_fn_with_final_checkpoint_flush)"
    Worker.get_objects (ray/_private/worker.py:1007)
    TrainContext._sync_checkpoint_dir_name_across_ranks (ray/train/v2/_internal/execution/context.py:254)
    report (ray/train/v2/api/train_fn_utils.py:125)
    report_on_rank_zero_only (3608596061.py:8)
    Thread.run (threading.py:982)
"""


def test_training_thread_keeps_the_loop_thread_innermost_first():
    frames = training_thread(HUNG_RANK)
    assert frames[0].startswith("Worker.get_objects") and frames[-1].startswith("Thread.run")
    assert "report_on_rank_zero_only (3608596061.py:8)" in frames
    finished = HUNG_RANK.split("Thread 2631")[0]
    assert training_thread(finished) == [], "a rank whose loop returned has no training thread"


#: `py-spy dump --native` of rank 0 of lesson 06's lab B (torch 2.14, gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL): its loop
#: waits in an all_reduce that rank 1 never calls. The other threads are cut short.
NATIVE_DUMP = ("""Process 15245: ray::RayTrainWorker
Thread 15245 (idle): "MainThread"
    \x1b[32mepoll_wait (libc.so.6)\x1b[0m
    Worker.main_loop (ray/_private/worker.py:1069)
""" + """Thread 15391 (idle): "TrainingThread(train_fn_with_final_checkpoint_flush)"
    0x7fb73baa3f16 (libc.so.6)
    pthread_cond_timedwait (libc.so.6)
    gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)
    c10d::ProcessGroupGloo::RecvWork::wait (libtorch_cpu.so)
    c10d::ProcessGroupGloo::monitoredBarrier(c10d::BarrierOptions const&, bool)::{lambda#1}::operator (libtorch_cpu.so)
    c10d::ProcessGroupGloo::monitoredBarrier (libtorch_cpu.so)
    c10d::ProcessGroupWrapper::runCollectiveChecks (libtorch_cpu.so)
    c10d::ProcessGroupWrapper::allreduce (libtorch_cpu.so)
    c10d::ops::(anonymous namespace)::allreduce_CPU (libtorch_cpu.so)
    c10::impl::make_boxed_from_unboxed_functor<c10::impl::detail::Wrap<...> >::call (libtorch_cpu.so)
    torch::autograd::VariableHooks::basic_autograd_not_implemented_fallback (libtorch_cpu.so)
    c10d::ProcessGroup::allreduce (libtorch_cpu.so)
    pybind11::detail::function_ref<c10::intrusive_ptr<c10d::Work>(c10d::ProcessGroup*)>::callback (libtorch_python.so)
    pybind11::cpp_function::initialize<...>(...)::{lambda#1}::_FUN (libtorch_python.so)
    pybind11::cpp_function::dispatcher (libtorch_python.so)
    all_reduce (torch/distributed/distributed_c10d.py:3906)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    log_on_rank_zero (hang2.py:12)
    construct_train_func.<locals>.train_fn (ray/train/v2/_internal/util.py:89)
    RayTrainWorker.run_train_fn.<locals>.train_fn_with_final_checkpoint_flush (ray/train/v2/_internal/worker.py:152)
    ThreadRunner.run.<locals>._run_target (ray/train/v2/_internal/execution/worker_group/thread_runner.py:37)
    Thread.run (threading.py:982)
    Thread._bootstrap_inner (threading.py:1045)
    Thread._bootstrap (threading.py:1002)
""")


def test_native_stack_keeps_the_collective_s_cpp_frames_and_the_python_ones_up_to_the_loop():
    assert native_stack(NATIVE_DUMP, until="log_on_rank_zero") == [
        "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)",
        "c10d::ProcessGroupGloo::RecvWork::wait (libtorch_cpu.so)",
        "c10d::ProcessGroupGloo::monitoredBarrier (libtorch_cpu.so)",
        "c10d::ProcessGroupWrapper::runCollectiveChecks (libtorch_cpu.so)",
        "c10d::ProcessGroupWrapper::allreduce (libtorch_cpu.so)",
        "c10d::ops::allreduce_CPU (libtorch_cpu.so)",
        "c10d::ProcessGroup::allreduce (libtorch_cpu.so)",
        "all_reduce (torch/distributed/distributed_c10d.py:3906)",
        "_exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)",
        "log_on_rank_zero (hang2.py:12)",
    ]
    with pytest.raises(RuntimeError, match="no training thread in this dump"):  # py-spy's error, or a finished loop
        native_stack(NATIVE_DUMP.split("Thread 15391")[0], until="log_on_rank_zero")


#: How long a new Python process may take to start and say it is ready (well under 1 s on an idle machine).
READY_WITHIN_S = 60


def test_worker_stack_reads_a_live_python_process_without_colour_codes(monkeypatch):
    monkeypatch.setenv("CLICOLOR_FORCE", "1")  # set in a Jupyter kernel: py-spy then colours its output
    # It says "ready" from the line it then sleeps on (one line: its stack reads the same before and after the sleep
    # starts), and the test waits for that line, not for a guessed time.
    program = "import time\ndef waits_here():\n    print('ready', flush=True); time.sleep(60)\nwaits_here()"
    sleeper = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([sleeper.stdout], [], [], READY_WITHIN_S)[0], f"not ready within {READY_WITHIN_S} s"
        assert sleeper.stdout.readline() == "ready\n"
        stack = worker_stack(sleeper.pid)
        assert "\n    waits_here (<string>:3)" in stack and "\x1b" not in stack, stack
    finally:
        sleeper.kill()
        sleeper.wait()


def test_memory_limit_makes_torch_raise_its_own_error_and_is_lifted_after():
    with pytest.raises(RuntimeError, match="can't allocate memory"), memory_limit(50):
        torch.empty(200 * 2**20, dtype=torch.uint8).fill_(1)
    torch.empty(200 * 2**20, dtype=torch.uint8).fill_(1)  # the limit is gone


def test_process_memory_mb_sees_memory_that_is_kept_and_not_memory_that_is_freed():
    start = process_memory_mb()
    kept = torch.ones(100 * 2**20, dtype=torch.uint8)
    assert process_memory_mb() - start > 80
    del kept
    assert process_memory_mb() - start < 20


def test_compare_rounds_calls_overlapping_ranges_no_measurable_difference():
    rounds = pd.DataFrame({"condition": ["a"] * 3 + ["b"] * 3 + ["c"] * 3,
                           "share": [0.40, 0.45, 0.50, 0.41, 0.48, 0.52, 0.05, 0.06, 0.04]})
    table = compare_rounds(rounds, baseline="a", value="share")
    assert list(table["verdict"]) == ["baseline", "no measurable difference", "measured: lower"]
    assert table.loc["c", "change vs a"] == pytest.approx(0.05 - 0.45)


def test_train_metrics_are_the_train_dashboard_s_and_are_read_for_one_run_by_rank():
    from helpers.tooling.ray_internals import train_dashboard_panels
    from helpers.troubleshooting import TRAIN_METRICS, train_metric_samples

    # What the Train Metrics row of the installed Ray's Grafana dashboard plots, the controller's state aside.
    plotted = {name for panel in train_dashboard_panels() if panel["row"] == "Train Metrics"
               for name in panel["metrics"]}
    assert plotted - {"ray_train_controller_state"} == set(TRAIN_METRICS)
    page = "\n".join([
        "# TYPE ray_train_report_total_blocked_time_s gauge",
        'ray_train_report_total_blocked_time_s{ray_train_run_name="mine",ray_train_run_id="1",'
        'ray_train_worker_world_rank="1",ray_train_worker_actor_id="a"} 2.5',
        'ray_train_report_total_blocked_time_s{ray_train_run_name="other",ray_train_run_id="2",'
        'ray_train_worker_world_rank="0",ray_train_worker_actor_id="b"} 9.0',
        "# TYPE ray_train_worker_group_start_total_time_s gauge",
        'ray_train_worker_group_start_total_time_s{ray_train_run_name="mine",ray_train_run_id="1"} 12.25',
        "# TYPE ray_node_cpu_utilization gauge",
        'ray_node_cpu_utilization{instance="x"} 50.0', ""])
    assert train_metric_samples("mine", page) == {("ray_train_report_total_blocked_time_s", "1"): 2.5,
                                                  ("ray_train_worker_group_start_total_time_s", "controller"): 12.25}


def test_train_metrics_table_orders_metrics_and_ranks_and_leaves_missing_values_blank():
    from helpers.troubleshooting import train_metrics_table

    table = train_metrics_table({("ray_train_report_total_blocked_time_s", "10"): 1.0,
                                 ("ray_train_report_total_blocked_time_s", "2"): 2.5,
                                 ("ray_train_checkpoint_transfer_total_time_s", "2"): 0.25,
                                 ("ray_train_worker_group_start_total_time_s", "controller"): 12.25})
    assert list(table.columns) == ["controller", "rank 2", "rank 10"]  # ranks as numbers, not as text
    assert list(table.index) == ["starting the worker group", "inside ray.train.report()",
                                 "  of which copying the checkpoint to storage"]
    assert table.loc["starting the worker group"].tolist() == ["12.25 s", "", ""]
    assert table.loc["inside ray.train.report()"].tolist() == ["", "2.50 s", "1.00 s"]
    assert train_metrics_table({}).empty


def _record(run_name: str, seconds: float, message: str) -> dict:
    return {"run_name": run_name, "timestamp_ns": int(seconds * 1e9), "message": message}


CONTROLLER_LOG = [  # the messages Ray 2.60's controller writes as it starts a worker group
    (0.0, "No checkpoint manager snapshot found."),
    (2.5, "Attempting to start training worker group of size 2 with the following resources: [{'CPU': 1}] * 2"),
    (2.6, "[Worker Group Initialization] Placement group ready in 0.01s."),
    (8.0, "[Worker Group Initialization] 2 worker actors created in 5.53s."),
    (12.6, "[Worker Group Initialization] Train context initialized on workers in 4.60s."),
    (12.7, "[Worker Group Initialization] after_worker_group_start callbacks completed in 0.13s.\n  breakdown"),
    (12.8, "[Worker Group Initialization] Train function launched on workers in 0.02s."),
    (12.9, "[Worker Group Initialization] Worker group startup completed in 10.36s total."),
]


def test_startup_phases_read_the_controllers_own_clock(tmp_path):
    lines = [_record("mine", t, m) for t, m in CONTROLLER_LOG] + [_record("other", 1.0, CONTROLLER_LOG[2][1])]
    (tmp_path / "ray-train-sys-controller-abc.log").write_text("\n".join(map(json.dumps, lines[::-1])) + "\n")
    (tmp_path / "ray-train-app-controller-abc.log").write_text("not read\n")
    records = controller_records("mine", str(tmp_path))
    assert [r["message"] for r in records] == [m for _, m in CONTROLLER_LOG]
    assert startup_phases(records) == {
        "controller_setup": 2.5, "placement_group": 0.01, "worker_processes": 5.53, "train_context": 4.60,
        "process_group_and_callbacks": 0.13, "train_function_shipped": 0.02, "worker_group_total": 10.36}
    with pytest.raises(RuntimeError, match="train_context"):
        startup_phases(records[:4])

"""helpers.profiling: a real torch.profiler trace read as the phases of a step, with and without DDP's all-reduce."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from helpers import profiling
from helpers.system import free_ports


def _profiled_steps(model: nn.Module, trace: profiling.StepTrace, steps: int = 3, data_s: float = 0.0,
                    phases: tuple[str, ...] = profiling.PHASES) -> None:
    """The lesson's loop on random batches; `data_s` seconds of real work (a sort) make each batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=trace,
                 schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as profiler:
        for _ in range(1 + steps):
            with record_function("data_wait" if "data_wait" in phases else "unlabelled"):
                started = time.perf_counter()
                while time.perf_counter() - started < data_s:
                    np.sort(np.random.default_rng(0).random(10_000))
                images, labels = torch.randn(16, 32), torch.randint(0, 4, (16,))
            with record_function("forward"):
                loss = nn.functional.cross_entropy(model(images), labels)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            profiler.step()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))


def test_every_profiled_step_splits_into_parts_that_add_up(tmp_path):
    trace = profiling.StepTrace(tmp_path)
    _profiled_steps(_model(), trace, steps=3, data_s=0.02)
    assert len(trace.steps) == 3
    for step in trace.steps:
        assert sum(step[part] for part in profiling.PARTS) == pytest.approx(step["step"])
        assert step["data_wait"] >= 20  # ms: the work that made the batch
        assert step["forward"] > 0 and step["backward"] > 0 and step["optimizer"] > 0
        assert step["allreduce_total"] == 0  # one process, no DDP
        assert step["allreduce_wait"] < 1
    phases = trace.phases
    assert phases["rank"] == 0 and phases["steps"] == 3
    events = json.loads(gzip.decompress(trace.path.read_bytes()))["traceEvents"]
    assert trace.path == tmp_path / "trace-rank0.json.gz"
    assert {"data_wait", "forward", "backward", "optimizer"} <= {event.get("name") for event in events}


def test_a_step_without_a_phase_label_is_refused_saying_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="label every phase with record_function"):
        _profiled_steps(_model(), profiling.StepTrace(tmp_path), phases=("forward", "backward", "optimizer"))


def test_phases_before_the_profiler_finished_say_what_to_do():
    with pytest.raises(RuntimeError, match="warmup"):
        _ = profiling.StepTrace().phases


def _ddp_rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 2048), nn.ReLU(), nn.Linear(2048, 4)))
        trace = profiling.StepTrace(folder)
        _profiled_steps(model, trace, steps=3)
        gathered = profiling.gather_ranks(trace.phases)
        if rank == 0:
            with open(os.path.join(folder, "gathered.json"), "w") as file:
                json.dump(gathered, file)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: now and then Kineto's profiler thread is still joinable when C++
    # destroys it, and std::terminate aborts a process whose work (the file above) is already done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_under_ddp_each_rank_sees_the_all_reduce_and_rank_0_gathers_both(tmp_path):
    (port,) = free_ports(host="127.0.0.1")
    mp.spawn(_ddp_rank, args=(port, str(tmp_path)), nprocs=2)
    gathered = json.loads((tmp_path / "gathered.json").read_text())
    assert [phases["rank"] for phases in gathered] == [0, 1]
    for phases in gathered:
        assert phases["allreduce_total"] > 0  # gloo's all-reduce of the gradients ran in every step
        assert 0 <= phases["allreduce_wait"] <= phases["allreduce_total"]
        assert sum(phases[part] for part in profiling.PARTS) == pytest.approx(phases["step"])
    assert {path.name for path in tmp_path.glob("trace-rank*.json.gz")} == {"trace-rank0.json.gz",
                                                                            "trace-rank1.json.gz"}


def test_overlapping_all_reduces_count_once_and_only_inside_the_window():
    # microseconds in, milliseconds out: [0, 4000] and [2000, 6000] overlap, [9000, 12000] is cut at 10000
    intervals = [(2000.0, 6000.0), (0.0, 4000.0), (9000.0, 12000.0), (20000.0, 21000.0)]
    assert profiling._union_ms(intervals, 1000.0, 10000.0) == pytest.approx(6.0)
    assert profiling._union_ms([], 0.0, 10.0) == 0.0


def test_the_per_image_recipe_in_ray_data_form_makes_normalised_crops():
    images = np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    batch = profiling.augment_each_image({"image": images, "label": np.arange(8)})
    assert batch["image"].shape == (8, 3, 32, 32) and batch["image"].dtype == np.float32
    assert -3 < batch["image"].mean() < 3


def test_an_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="resnet18_mnist"):
        profiling.build_model("resnet50")


def test_the_phase_table_has_a_row_per_variant_and_rank_and_images_per_s_follow_the_slowest_rank():
    def ranks(*steps):
        return [{"rank": r, "steps": 2, **dict.fromkeys((*profiling.PARTS, "allreduce_total"), 1.0), "step": s}
                for r, s in enumerate(steps)]
    runs = {"1 worker": [ranks(100.0), ranks(120.0), ranks(110.0)],
            "2 workers": [ranks(200.0, 250.0), ranks(210.0, 200.0), ranks(220.0, 230.0)]}
    table = profiling.phase_table(runs)
    assert list(table.index) == ["1 worker", "2 workers · rank 0", "2 workers · rank 1"]
    assert table.loc["1 worker", "step"] == 110.0  # the median round
    assert table.loc["2 workers · rank 0", "step"] == 220.0  # the median round by its slowest rank: 230 ms
    assert table.loc["2 workers · rank 1", "step"] == 230.0
    assert profiling.images_per_s(runs["2 workers"], 128) == pytest.approx([128 / 0.25, 128 / 0.21, 128 / 0.23])


PROFILE_IN_A_THREAD = """
import threading, torch
from torch.profiler import ProfilerActivity, profile
from helpers import profiling

def train():
    {before}
    with profile(activities=[ProfilerActivity.CPU]):
        torch.randn(8) * 2

thread = threading.Thread(target=train)  # as Ray Train runs the training function
thread.start()
thread.join()
"""


@pytest.mark.parametrize(("before", "noise"), [("pass", True), ("profiling.StepTrace()", False)])
def test_a_step_trace_keeps_kinetos_thread_complaint_out_of_stderr(before, noise):
    run = subprocess.run([sys.executable, "-c", PROFILE_IN_A_THREAD.format(before=before)], capture_output=True,
                         text=True, env={**os.environ, "KINETO_LOG_LEVEL": "6"}, check=True)
    assert ("External init callback must run in same thread" in run.stderr) == noise, run.stderr


@pytest.mark.parametrize(("ray_gave_a_gpu", "activities"), [(False, [ProfilerActivity.CPU]),
                                                             (True, [ProfilerActivity.CPU, ProfilerActivity.CUDA])])
def test_kineto_starts_with_the_gpu_only_in_a_process_that_has_one(monkeypatch, ray_gave_a_gpu, activities):
    # A GPU machine: torch sees its GPUs in every Ray worker, those Ray gave none too (Ray 2.60 leaves their
    # CUDA_VISIBLE_DEVICES alone). has_a_gpu (tests/test_cluster_ray.py) says whether Ray gave this one a GPU.
    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profiling, "has_a_gpu", lambda: ray_gave_a_gpu)
    monkeypatch.setattr(profiling, "_kineto_started", False)
    monkeypatch.setattr(torch.profiler, "profile", lambda activities: started.append(activities) or nullcontext())
    profiling.start_kineto_quietly()
    assert started == [activities]


@pytest.mark.parametrize("source", profiling.CIFAR_LOADERS)
def test_each_cifar_loader_makes_normalised_batches_and_is_timed_alone(source):
    """Lesson 10 times these loaders against each other: each must make the batches the model trains on."""
    from helpers.cifar import cifar10_parquet_root
    from helpers.config import load_config

    root = cifar10_parquet_root(load_config().data_dir)
    torch.manual_seed(0)  # the shuffle, the crops and TrivialAugment's draws: one batch, the same in every run
    images, labels = next(iter(profiling.cifar_loader(root, source, 256)))
    assert images.shape == (256, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64
    # Normalised: not the 0-1 of ToDtype alone (mean near 0.47, std near 0.25). The per-image recipes pad their crops
    # with black before normalising, and TrivialAugment darkens some images: their means run to about -0.45.
    assert -0.6 < images.mean().item() < 0.6 and 0.7 < images.std().item() < 1.5, "normalised with CIFAR-10's stats"
    assert profiling.input_images_per_s(root, source, num_batches=2, batch_size=16) > 0


def test_an_unknown_cifar_loader_names_the_choices():
    with pytest.raises(ValueError, match="cifar_crop_flip_per_image"):
        profiling.cifar_loader("unused", "cifar_resized", 8)


def event(name: str, start_ms: float, end_ms: float, device=None, annotation: bool = False):
    """A `profiler.events()` entry as torch builds it (FunctionEvent), from milliseconds; on the CPU by default."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(id=0, name=name, thread=1, start_us=start_ms * 1e3, end_us=end_ms * 1e3,
                         device_type=DeviceType.CPU if device is None else device, is_user_annotation=annotation)


def test_a_trace_with_the_gpus_side_keeps_the_cpus_phases_and_adds_how_long_the_device_was_busy():
    """What `profiler.events()` holds with ProfilerActivity.CUDA, as torch builds it (FunctionEvent): the CPU's
    labelled ranges, the same labels again as GPU annotations, and the device's kernels and copies. A step of 10 ms
    on the CPU whose GPU ran 1 ms of kernels, 2 ms of a copy overlapping 1 ms of them, and 1 ms after the step."""
    from torch.autograd import DeviceType

    cpu = [event("ProfilerStep#1", 0, 10), event("data_wait", 0, 4), event("forward", 4, 6),
           event("backward", 6, 8), event("optimizer", 8, 10)]
    gpu = [event(name, start + 0.5, end + 0.5, DeviceType.CUDA, annotation=True)  # the labels on the GPU's timeline
           for name, start, end in (("ProfilerStep#1", 0, 10), ("data_wait", 0, 4), ("forward", 4, 6))]
    kernels = [event("sm90_xmma_gemm", 5, 6, DeviceType.CUDA), event("Memcpy HtoD (Pinned -> Device)", 5.5, 7.5,
                                                                         DeviceType.CUDA),
               event("void at::native::elementwise_kernel", 9.5, 11, DeviceType.CUDA)]

    (cpu_only,) = profiling.step_phases(cpu)
    (with_gpu,) = profiling.step_phases(cpu + gpu + kernels)

    assert "device_busy" not in cpu_only, "a CPU trace has no device column"
    assert {key: with_gpu[key] for key in cpu_only} == pytest.approx(cpu_only), "the GPU's rows change no phase"
    assert with_gpu["device_busy"] == pytest.approx(3.0)  # [5, 7.5] and [9.5, 10]: the copy overlaps the gemm
    table = profiling.phase_table({"on a GPU": [[{"rank": 0, "steps": 1, **with_gpu}]]})
    assert table.loc["on a GPU", "device_busy"] == 3.0 and table.loc["on a GPU", "data_wait"] == 4.0


def test_on_nccl_the_all_reduce_is_read_from_its_kernels_and_its_time_alone_on_the_device():
    """Two GPU workers: the CPU's `nccl:all_reduce` range covers only the launch; NCCL's kernel ran 2.5 ms on the
    device, 1 ms of it beside backward's last kernel and 1.5 ms alone, while the CPU waited at the step's end."""
    from torch.autograd import DeviceType

    cpu = [event("ProfilerStep#1", 0, 12), event("data_wait", 0, 1), event("forward", 1, 3),
           event("backward", 3, 6), event(f"{profiling.AUTOGRAD}: AddmmBackward0", 4, 5.9),
           event("nccl:all_reduce", 5.8, 5.85), event("optimizer", 6, 7)]
    kernels = [event("sm90_xmma_gemm_bwd", 4, 8, DeviceType.CUDA),
               event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7, 9.5, DeviceType.CUDA),
               event("multi_tensor_apply_kernel", 9.5, 11, DeviceType.CUDA)]

    (cpu_view,) = profiling.step_phases(cpu)
    (step,) = profiling.step_phases(cpu + kernels)

    assert cpu_view["allreduce_total"] == pytest.approx(0.05), "on the CPU: the launch"
    assert step["allreduce_total"] == pytest.approx(2.5) and step["allreduce_wait"] == pytest.approx(1.5)
    assert step["backward"] == pytest.approx(3.0), "backward keeps the CPU's launches"
    assert step["other"] == pytest.approx(12 - 1 - 2 - 3 - 1.5 - 1), "the wait for the GPU at the step's end"
    assert step["device_busy"] == pytest.approx(7.0)
    assert profiling.hidden_share(pd.Series(step)) == pytest.approx(1 - 1.5 / 2.5)


def test_on_nccl_an_all_reduce_alone_on_a_starved_gpu_while_the_cpu_launches_is_not_a_wait():
    """A launch-bound step: the first bucket's all-reduce runs alone on the GPU (3.5-4.5 ms) while the CPU is still in
    backward; only the 1 ms alone after the CPU's last phase (7-8 ms) is the step's wait for the all-reduce."""
    from torch.autograd import DeviceType

    cpu = [event("ProfilerStep#1", 0, 9), event("data_wait", 0, 1), event("forward", 1, 3),
           event("backward", 3, 6), event(f"{profiling.AUTOGRAD}: AddmmBackward0", 3, 5.9),
           event("nccl:all_reduce", 3.4, 3.45), event("nccl:all_reduce", 5.8, 5.85), event("optimizer", 6, 7)]
    kernels = [event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3.5, 4.5, DeviceType.CUDA),
               event("sm90_xmma_gemm_bwd", 4.5, 6.5, DeviceType.CUDA),
               event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 6.5, 8, DeviceType.CUDA)]

    (step,) = profiling.step_phases(cpu + kernels)

    assert step["allreduce_total"] == pytest.approx(2.5) and step["allreduce_wait"] == pytest.approx(1.0)
    assert step["other"] == pytest.approx(9 - 1 - 2 - 3 - 1 - 1) and step["other"] >= 0, "no time counted twice"


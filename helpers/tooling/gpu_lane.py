"""The GPU lane: every lesson that trains, run top to bottom in full mode on this machine's GPU, and what happened.

`make gpu-check` (`python -m helpers.tooling.gpu_lane`) runs the lessons of LESSONS one at a time, each in a fresh
kernel within its time budget, in full mode (COURSE_SMOKE_TEST=0), on one storage path of their own that they
share, as a learner's would. While a lesson runs, it samples how busy the GPU is. It keeps the executed notebooks in
an output folder (never over the committed ones) and writes a report, `notebooks/results/gpu.json` by default:

- the machine: GPU model and memory, driver, CUDA, torch, Ray, CPUs;
- per lesson: passed, failed (with the first error) or timed out; wall time against its budget; the GPU's busy share
  (mean and highest sample) and its peak memory; the summaries the lesson saved (its headline figures); and every
  Ray Train run it started, with its start-up split between Ray and the course (`helpers.tooling.run_recorder`),
  test accuracy and images/s.

Without a GPU it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from helpers.config import REPO_ROOT
from helpers.tooling.flags import positive
from helpers.tooling.run_recorder import read_records, recording_env, summarize_runs

NOTEBOOKS = REPO_ROOT / "notebooks"
DEFAULT_REPORT = NOTEBOOKS / "results" / "gpu.json"
#: The report's layout; a change that removes or renames a field bumps it.
SCHEMA = 1
#: How often the GPU's busy share and memory are read while a lesson runs.
SAMPLE_S = 0.5
#: With a deadline for the whole lane, a lesson starts only with at least this many seconds left.
MIN_LESSON_S = 60


@dataclass(frozen=True)
class Lesson:
    """A lesson the lane runs, and the seconds it may take on one GPU."""

    number: str
    notebook: str
    budget_s: int


#: Every lesson that trains, with its budget: its full-mode time on a 2-core CPU (the README's table), rounded up. A
#: GPU that needs longer than a 2-core laptop is a failure worth seeing.
LESSONS = {lesson.number: lesson for lesson in (
    Lesson("01", "01_single_gpu_pytorch.ipynb", 20 * 60),
    Lesson("02", "02_ray_train_ddp.ipynb", 15 * 60),
    Lesson("03", "03_ray_data_ingest.ipynb", 15 * 60),
    Lesson("04", "04_checkpoints_and_results.ipynb", 25 * 60),
    Lesson("05", "05_fault_tolerance.ipynb", 50 * 60),
    Lesson("09", "09_capstone_cifar10_vit.ipynb", 60 * 60),
    Lesson("10", "10_performance.ipynb", 35 * 60),
    Lesson("11", "11_hyperparameter_search.ipynb", 25 * 60),
    Lesson("12", "12_fsdp.ipynb", 15 * 60),
)}
#: The lessons that train but are not in the lane, and why (tests/test_gpu_lane.py fails on any other).
NOT_IN_LANE = {
    "06": "its labs train only to make a hang, a slow input and an out-of-memory error on purpose",
}


class NoGpuError(RuntimeError):
    """This machine has no GPU the lane can use."""


# ---- the GPU -------------------------------------------------------------------------------------------------------

def _nvml():
    """NVML through nvidia-ml-py (`pynvml`), initialised; None where it is not installed or finds no driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, or no NVIDIA driver: NVMLError_* has no common base worth naming
        return None


def _smi(query: str) -> list[list[str]]:
    """`nvidia-smi --query-gpu=<query>` as rows of fields, one per GPU; [] without nvidia-smi or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]


def gpus() -> list[dict[str, Any]]:
    """This machine's NVIDIA GPUs: model, memory in MiB, driver; [] when there is none."""
    nvml = _nvml()
    if nvml is not None:
        driver = nvml.nvmlSystemGetDriverVersion()
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            found.append({"name": name.decode() if isinstance(name, bytes) else name,
                          "memory_mib": nvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
                          "driver": driver.decode() if isinstance(driver, bytes) else driver})
        return found
    return [{"name": name, "memory_mib": int(float(memory)), "driver": driver}
            for name, memory, driver in _smi("name,memory.total,driver_version")]


class GpuSampler:
    """Reads every GPU's busy share (NVML's utilization: the share of time a kernel ran) and its memory in use,
    every SAMPLE_S seconds, in a thread, between `start()` and `stop()`."""

    def __init__(self, interval_s: float = SAMPLE_S):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (busy %, memory MiB), the busiest GPU at each read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = _nvml()

    def _read(self) -> tuple[float, float] | None:
        if self._nvml is not None:
            readings = []
            for index in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                readings.append((float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                                 self._nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20))
        else:
            readings = [(float(busy), float(memory)) for busy, memory in _smi("utilization.gpu,memory.used")]
        return max(readings) if readings else None

    def _run(self) -> None:
        while not self._stop.is_set():
            reading = self._read()
            if reading is not None:
                self.samples.append(reading)
            self._stop.wait(self.interval_s)

    def start(self) -> GpuSampler:
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the busy share's mean and highest sample, the peak memory, the number of samples."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self.samples:
            return {"busy_mean_pct": None, "busy_max_pct": None, "memory_peak_mib": None, "samples": 0}
        busy = [sample[0] for sample in self.samples]
        return {"busy_mean_pct": round(sum(busy) / len(busy), 1), "busy_max_pct": max(busy),
                "memory_peak_mib": round(max(sample[1] for sample in self.samples)), "samples": len(busy)}


def machine(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The machine a report was made on: its GPUs, CUDA, torch, Ray, Python and CPUs."""
    import ray
    import torch  # no CUDA call here: the lane's own process keeps the GPU free for the lessons

    return {"gpus": found, "cuda": torch.version.cuda, "torch": torch.__version__, "ray": ray.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}


# ---- one lesson ----------------------------------------------------------------------------------------------------

def _this_python_kernels():
    """A kernel manager whose kernels run this interpreter (the course's), whatever kernel specs are installed."""
    from jupyter_client.manager import AsyncKernelManager

    class ThisPython(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            return [sys.executable, "-m", "ipykernel_launcher", "-f", self.connection_file, *(extra_arguments or [])]

    return ThisPython


def _first_error(error: BaseException) -> str:
    """The error a failed cell raised, in one line: `Name: message`."""
    name, value = getattr(error, "ename", None), getattr(error, "evalue", None)
    if name:
        return f"{name}: {value}".splitlines()[0][:500]
    return "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1][:500]


#: Run in a lesson's kernel when the lane stops it early: Ray's processes end with `ray.shutdown()`, not with a kernel
#: that is killed in the middle of a cell.
STOP_RAY = "import ray\nray.shutdown()"


def _stop_ray(client, notebook) -> None:
    """Interrupt the running cell, then shut down the kernel's Ray (within a minute); the kernel is killed after."""
    import nbformat
    from nbclient.util import run_sync

    try:
        run_sync(client.km.interrupt_kernel)()
        notebook.cells.append(nbformat.v4.new_code_cell(STOP_RAY))
        client.timeout = 60
        client.execute_cell(notebook.cells[-1], len(notebook.cells) - 1)
    except Exception as error:  # a kernel that does not answer is killed anyway; say so and go on
        print(f"  (could not shut down the lesson's Ray: {_first_error(error)})", file=sys.stderr)
    finally:
        if notebook.cells and notebook.cells[-1].source == STOP_RAY:
            notebook.cells.pop()


def run_notebook(path: Path, out_path: Path, budget_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Execute the notebook `path` top to bottom in a fresh kernel with `env`, stopping it at `budget_s`; save the
    executed copy (as far as it ran) to `out_path`. Returns status, error, cell counts and seconds."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    notebook = nbformat.read(path, as_version=4)
    code = [index for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    for index in code:  # the executed copy holds only this run's outputs
        notebook.cells[index].outputs, notebook.cells[index].execution_count = [], None
    client = NotebookClient(notebook, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                            record_timing=True, shutdown_kernel="immediate",
                            kernel_manager_class=_this_python_kernels())
    status, error, failed_cell, ran = "passed", None, None, 0
    started = time.monotonic()
    deadline = started + budget_s
    try:
        with client.setup_kernel(env=env):
            try:
                for index in code:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CellTimeoutError(f"budget of {budget_s:g} s spent before cell {index}")
                    client.timeout = max(1, int(remaining))
                    client.execute_cell(notebook.cells[index], index)
                    ran += 1
            finally:
                if ran < len(code):  # stopped early: end the lesson's Ray before its kernel, so none outlives it
                    _stop_ray(client, notebook)
    except CellTimeoutError:
        status, failed_cell = "timed out", code[ran] if ran < len(code) else None
        error = f"over its budget of {budget_s:g} s, in cell {failed_cell}"
    except CellExecutionError as cell_error:
        status, failed_cell, error = "failed", code[ran], _first_error(cell_error)
    except Exception as other:  # the kernel died or did not start: the lesson failed, the lane goes on
        status, failed_cell, error = "failed", code[ran] if ran < len(code) else None, _first_error(other)
    wall_s = time.monotonic() - started
    out_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, out_path)
    return {"status": status, "error": error, "failed_cell": failed_cell, "cells_run": ran, "cells": len(code),
            "wall_s": round(wall_s, 1)}


def _summaries(storage_path: Path, since: float) -> dict[str, Any]:
    """The lesson summaries (`helpers.runs.save_summary`) written under `storage_path` since `since` (epoch s)."""
    folder = storage_path / "summaries"
    if not folder.is_dir():
        return {}
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))
            if path.stat().st_mtime >= since}


def lesson_env(storage_path: Path, record_file: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """A lesson kernel's environment in the lane: full mode, the lane's storage path, every Ray Train run recorded."""
    env = dict(os.environ if base is None else base)
    env.update({"COURSE_SMOKE_TEST": "0", "COURSE_STORAGE_PATH": str(storage_path), "PYTHONUNBUFFERED": "1",
                **recording_env(str(record_file))})
    # `helpers` imports in the kernel from this checkout, whether or not it is installed there.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_lesson(lesson: Lesson, out_dir: Path, storage_path: Path, budget_s: float | None = None,
               notebooks_dir: Path = NOTEBOOKS, sample: bool = True) -> dict[str, Any]:
    """Run one lesson in the lane: its result, the GPU's busy share while it ran, its summaries and Ray Train runs."""
    budget = lesson.budget_s if budget_s is None else budget_s
    record_file = out_dir / f"{lesson.number}-runs.jsonl"
    since = time.time()
    sampler = GpuSampler().start() if sample else None
    print(f"lesson {lesson.number}: {lesson.notebook}, budget {budget:g} s ...", flush=True)
    result = run_notebook(notebooks_dir / lesson.notebook, out_dir / lesson.notebook, budget,
                          lesson_env(storage_path, record_file))
    gpu = sampler.stop() if sampler else None
    runs = summarize_runs(read_records(str(record_file)))
    print(f"lesson {lesson.number}: {result['status']} in {result['wall_s']:g} s"
          + (f", GPU busy {gpu['busy_mean_pct']}% on average" if gpu and gpu["samples"] else "")
          + (f": {result['error']}" if result["error"] else ""), flush=True)
    return {"lesson": lesson.number, "notebook": lesson.notebook, "budget_s": budget, **result, "gpu": gpu,
            "summaries": _summaries(storage_path, since), "runs": runs,
            "executed": str(out_dir / lesson.notebook)}


# ---- the lane ------------------------------------------------------------------------------------------------------

def select(numbers: list[str] | None) -> list[Lesson]:
    """The lessons to run, in the order given (all of LESSONS, in order, when None). ValueError on any other."""
    if not numbers:
        return list(LESSONS.values())
    unknown = [number for number in numbers if number not in LESSONS]
    if unknown:
        reasons = "; ".join(f"{number}: {NOT_IN_LANE[number]}" for number in unknown if number in NOT_IN_LANE)
        raise ValueError(f"not in the GPU lane: {', '.join(unknown)} (it runs {', '.join(LESSONS)})"
                         + (f"; {reasons}" if reasons else ""))
    return [LESSONS[number] for number in dict.fromkeys(numbers)]


def budgets(overrides: list[str] | None) -> dict[str, float]:
    """`NN=SECONDS` pairs as {lesson: seconds}. ValueError on a lesson outside the lane or a budget that is not > 0."""
    found = {}
    for pair in overrides or []:
        number, _, seconds = pair.partition("=")
        if number not in LESSONS:
            raise ValueError(f"--budget {pair}: lesson {number!r} is not in the GPU lane ({', '.join(LESSONS)})")
        try:
            found[number] = float(seconds)
        except ValueError:
            found[number] = 0.0
        if not found[number] > 0:
            raise ValueError(f"--budget {pair}: use NN=SECONDS with SECONDS > 0, e.g. 09=600")
    return found


def run_lane(lessons: list[Lesson], out_dir: Path, report_path: Path | None, budget_overrides: dict[str, float],
             found_gpus: list[dict[str, Any]], argv: list[str], notebooks_dir: Path = NOTEBOOKS,
             storage_path: Path | None = None, deadline_s: float | None = None) -> dict[str, Any]:
    """Run `lessons` one at a time; write the report to `report_path` and to `out_dir/gpu.json` after each lesson,
    so that a lane stopped half-way keeps what it measured. With `deadline_s`, the whole lane ends within it: each
    lesson's budget is cut to the time left, and a lesson with less than MIN_LESSON_S left does not start."""
    ends = None if deadline_s is None else time.monotonic() + deadline_s
    out_dir = out_dir.resolve()  # the kernels run in notebooks/: every path they get is absolute
    out_dir.mkdir(parents=True, exist_ok=True)
    storage_path = (storage_path or out_dir / "storage").resolve()
    report: dict[str, Any] = {
        "schema": SCHEMA, "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m helpers.tooling.gpu_lane " + " ".join(argv), "machine": machine(found_gpus),
        "mode": "full", "lessons": []}
    results: dict[str, dict[str, Any]] = {}
    for lesson in lessons:
        budget = budget_overrides.get(lesson.number, lesson.budget_s)
        left = None if ends is None else ends - time.monotonic()
        if left is not None and left < MIN_LESSON_S:
            results[lesson.number] = {"lesson": lesson.number, "notebook": lesson.notebook, "status": "not run",
                                      "budget_s": budget, "error": f"the lane's deadline of {deadline_s:g} s came first"}
        else:
            results[lesson.number] = run_lesson(lesson, out_dir, storage_path, budget if left is None else
                                                min(budget, left), notebooks_dir, sample=bool(found_gpus))
        # every lesson of the lane, in order (those not run yet say so), then any other notebook (the tests')
        report["lessons"] = [results.get(number, {"lesson": number, "notebook": lane_lesson.notebook,
                                                  "status": "not run", "budget_s": lane_lesson.budget_s})
                             for number, lane_lesson in LESSONS.items()]
        report["lessons"] += [result for number, result in results.items() if number not in LESSONS]
        text = json.dumps(report, indent=1) + "\n"
        for path in filter(None, (out_dir / "gpu.json", report_path)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return report


def table_cell(result: dict[str, Any]) -> str:
    """A lesson's result in the README's lesson table: its time and the GPU's busy share, or what stopped it."""
    if result["status"] == "not run":
        return "not measured yet"
    minutes = f"{result['wall_s'] / 60:.1f} min"
    text = {"passed": minutes, "timed out": f"over {minutes} (stopped at its budget)",
            "failed": f"failed at cell {result['failed_cell']} after {minutes}"}[result["status"]]
    gpu = result.get("gpu") or {}
    return text + (f", GPU busy {gpu['busy_mean_pct']:g}%" if gpu.get("busy_mean_pct") is not None else "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.tooling.gpu_lane",
        description="Run every lesson that trains, in full mode, on this machine's GPU, one at a time, and report.")
    parser.add_argument("--lessons", nargs="+", metavar="NN", help=f"lessons to run, in this order "
                        f"(default: all of {' '.join(LESSONS)})")
    parser.add_argument("--budget", action="append", metavar="NN=SECONDS",
                        help="a lesson's time budget instead of its default (repeat for several)")
    parser.add_argument("--deadline", type=positive(float), default=None, metavar="SECONDS",
                        help="end the whole lane within SECONDS: budgets are cut to the time left, and a lesson "
                             f"with less than {MIN_LESSON_S} s left does not start")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the executed notebooks, the runs' records and the storage path go "
                             "(default: runs/gpu-lane/<time>)")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT,
                        help=f"the report's path (default: {DEFAULT_REPORT.relative_to(REPO_ROOT)})")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        lessons, overrides = select(args.lessons), budgets(args.budget)
    except ValueError as error:
        parser.error(str(error))
    found = gpus()
    if not found:
        print("No GPU here (neither NVML nor nvidia-smi finds one): the GPU lane runs the lessons on a GPU; "
              "run `make gpu-check` on a machine with an NVIDIA GPU and its driver.", file=sys.stderr)
        return 2
    out_dir = args.out or REPO_ROOT / "runs" / "gpu-lane" / datetime.now().strftime("%Y%m%d-%H%M%S")
    report = run_lane(lessons, out_dir, args.report, overrides, found, argv, deadline_s=args.deadline)
    chosen = [result for result in report["lessons"] if result["lesson"] in {lesson.number for lesson in lessons}]
    passed = sum(result["status"] == "passed" for result in chosen)
    print(f"{passed} of {len(chosen)} lessons passed on {found[0]['name']}; report: {args.report}; "
          f"executed notebooks: {out_dir}")
    return 0 if passed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())

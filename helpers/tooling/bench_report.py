"""The benchmark's report (`python -m helpers.tooling.bench`): the machine it ran on, the tables the command
prints and lesson 10 shows, and the committed reports lessons 03 and 10 read."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path

import pandas as pd
import psutil
import torch

from helpers.config import REPO_ROOT
from helpers.rounds import spread_text

PARTS = ("device", "ddp", "data")
#: Where lesson 10 reads the committed report, `bench.json`.
RESULTS_DIR = REPO_ROOT / "notebooks" / "results"


def machine(argv: list[str] | None = None) -> dict:
    """What the figures were measured on, stored with them."""
    import ray

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "helpers.tooling.bench", *(sys.argv[1:] if argv is None else argv)]),
    }


# ---- the tables ----------------------------------------------------------------------------------------------------

def format_report(report: dict) -> str:
    """The report as the tables the command prints: median [min-max] per figure, then each comparison."""
    lines = [f"machine: {report['machine']['cpu']} ({report['machine']['logical_cpus']} logical CPUs), "
             f"GPU: {report['machine']['gpu'] or 'none'}; {report['rounds']} round(s)"]
    for part in PARTS:
        if part not in report:
            continue
        lines.append(f"\n== {part} ==")
        figures = dict(report[part]["images_per_s"])
        figures.update({name: value for name, value in report[part].get("limits", {}).items()})
        for name, value in figures.items():
            unit = "" if name in report[part].get("limits", {}) else " images/s"
            lines.append(f"{name:<32} {spread_text(value, 1, unit)}")
        for comparison in report[part]["comparisons"]:
            ratio = comparison["ratio"]
            lines.append(f"{comparison['a'] + ' / ' + comparison['b']:<58}{spread_text(ratio, 3, 'x')}: "
                         f"{comparison['verdict']}")
    return "\n".join(lines)


def figures_table(figures: dict[str, dict], digits: int = 1) -> pd.DataFrame:
    """One row per figure: its median, min and max over the rounds."""
    return pd.DataFrame({name: {key: round(value[key], digits) for key in ("median", "min", "max")}
                         for name, value in figures.items()}).T


def comparisons_table(comparisons: list[dict]) -> pd.DataFrame:
    """One row per comparison `a / b`: the within-round ratio's median, min and max, and the verdict."""
    return pd.DataFrame([{"a / b": f"{c['a']} / {c['b']}", **{key: round(c["ratio"][key], 3)
                                                             for key in ("median", "min", "max")},
                          "verdict": c["verdict"]} for c in comparisons]).set_index("a / b")


def recorded_report(name: str = "bench") -> dict:
    """A committed report, `notebooks/results/<name>.json`, as lesson 10 reads it."""
    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing. Record it with: python -m helpers.tooling.bench --json {path}")
    return json.loads(path.read_text())

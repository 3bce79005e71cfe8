"""The course's benchmark, as a command (not a test): where the time of a training step goes.

    python -m helpers.tooling.bench              # all three parts, 5 rounds each (50 min on 2 CPU cores)
    python -m helpers.tooling.bench device ddp --rounds 7 --json bench.json
    python -m helpers.tooling.bench --quick      # one short round of everything (CI; no verdicts)

Parts, all in one process that starts (or joins, through RAY_ADDRESS) one Ray for all of them:
- `device`: one training process on this machine's device (the GPU when there is one). ResNet-18 on batches
  already on the device, in float32, bf16 autocast, `channels_last`, and both; the same loop fed by a DataLoader
  (0 and N workers, pinned memory on a GPU) and by Ray Data's `iter_torch_batches` (`prefetch_batches` 1 and 4);
  lesson 09's ViT in float32 and bf16. And the device's limits: a large matmul's FLOP/s, memory copy GB/s,
  and each model's training FLOPs per image, so that a figure can be read as a fraction of the limit.
- `ddp`: lesson 01's plain loop, then Ray Train with 1 and N workers; `fit()`'s start-up split into the phases
  Ray Train's controller logs with its own clock.
- `data`: lesson 02's DataLoader-fed run against lesson 03's Ray Data-fed run (materialized and shuffled, the same
  not shuffled, and streaming), over whole epochs, each epoch's start-up included.

How it stays honest on a small, shared machine (+-20% between two windows here):
- every part runs its variants in `rounds` rounds, each round in a rotated order, so that no variant always runs
  first or last, and a slow spell of the machine hits every variant of that round;
- every figure is a median with its min and max over the rounds;
- every comparison is a ratio taken *within* each round, and `compare` states a verdict only when all the rounds
  agree ("faster in every round"); otherwise the difference is inside the spread ("no measurable difference").

This module is the command; the parts' measurements are in `bench_parts`, the report and its tables in `bench_report`,
the rounds, spreads and verdicts in `helpers.rounds`, the FLOP count in `helpers.profiling`. Lessons 03 and 10 read
the recorded report through the names below.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from helpers.config import load_config, load_dotenv_file
from helpers.tooling.bench_parts import (
    bench_data,
    bench_ddp,
    bench_device,
    copy_gb_per_s,
    loop_images_per_s,
    matmul_tflops,
    rest_of_fit,
)
from helpers.tooling.bench_report import (
    PARTS,
    comparisons_table,
    figures_table,
    format_report,
    machine,
    recorded_report,
)
from helpers.tooling.flags import positive

ROUNDS = 5
#: The sizes of a full run, and of `--quick` (one round; it checks that everything runs, it concludes nothing).
FULL = {"rounds": ROUNDS, "ddp_steps": 40, "ddp_repeats": 2, "data_rows": 5120, "data_epochs": 2,
        "data_not_shuffled": True, "device_rows": 6400, "vit_batch_size": 128}
QUICK = {"rounds": 1, "ddp_steps": 5, "ddp_repeats": 1, "data_rows": 512, "data_epochs": 1,
         "data_not_shuffled": False, "device_rows": 1024, "vit_batch_size": 16}
#: Steps per measurement on the device (after 2 warm-up steps): (ResNet-18, ViT).
DEVICE_STEPS = {"cpu": (20, 2), "cuda": (200, 100)}
QUICK_DEVICE_STEPS = (2, 1)

__all__ = [  # what lessons 03 and 10 and the tests use as `bench.<name>`, from the modules that hold it
    "PARTS", "comparisons_table", "copy_gb_per_s", "figures_table", "format_report",
    "loop_images_per_s", "main", "matmul_tflops", "parse_args", "recorded_report", "rest_of_fit",
]


# ---- the command --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The command line: parts (default all of them) and the flags, in any order."""
    parser = argparse.ArgumentParser(prog="python -m helpers.tooling.bench", description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="*", default=[], metavar="PART",
                        help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--rounds", type=positive(), default=None, help=f"rounds per part (default {ROUNDS}; --quick: 1)")
    parser.add_argument("--num-workers", type=positive(int, 2, ": the N compared with 1 worker"), default=2,
                        help="the N of N workers, compared with 1 (default 2)")
    parser.add_argument("--quick", action="store_true", help="one short round of everything: checks, no verdicts")
    parser.add_argument("--json", type=Path, default=None, help="also write the report to this file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, checked: an unknown part or a count below 1 stops with a usage error."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    if unknown := sorted(set(args.parts) - set(PARTS)):
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    args.parts = [part for part in PARTS if part in args.parts] or list(PARTS)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    parts = args.parts
    sizes = dict(QUICK if args.quick else FULL)
    if args.rounds is not None:
        sizes["rounds"] = args.rounds

    import ray

    from helpers.cluster import start_autoscaling_coordinator
    from helpers.session import start_ray

    load_dotenv_file()
    cfg = load_config()
    report = {"machine": machine(argv), "rounds": sizes["rounds"], "sizes": sizes, "ray_init_s": start_ray(cfg)}
    try:
        start_autoscaling_coordinator()  # as the lessons do
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if "device" in parts:
            steps = QUICK_DEVICE_STEPS if args.quick else DEVICE_STEPS["cuda" if torch.cuda.is_available() else "cpu"]
            report["device"] = bench_device(sizes, steps, args.num_workers)
        if "ddp" in parts:
            report["ddp"] = bench_ddp(sizes, args.num_workers, use_gpu)
        if "data" in parts:
            report["data"] = bench_data(sizes, args.num_workers)
    finally:
        ray.shutdown()
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nreport written to {args.json}")
    return report


if __name__ == "__main__":
    main()

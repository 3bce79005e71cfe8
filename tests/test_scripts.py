"""The course's command-line scripts: their flags, and requests they refuse at once with the course's error.

The scripts' training runs are tested on a real multi-node cluster (tests/test_multinode.py), with 1 and 2
workers; two workers there take every CPU of the cluster, as one worker per CPU does on a laptop.

The refusals that start Ray first: tests/test_scripts_ray.py.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT


def _parser_call(script: Path) -> tuple[str, dict[str, object]]:
    """The `parse_*` function of helpers.tooling.scripts that `script` calls, and the keywords it passes."""
    calls = [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id.startswith("parse_")]
    assert len(calls) == 1, f"{script.name} should parse its flags with one parse_* call, found {len(calls)}"
    return calls[0].func.id, {kw.arg: ast.literal_eval(kw.value) for kw in calls[0].keywords}


def test_every_script_is_in_script_parsers_with_the_parser_it_calls():
    # kuberay.entrypoint_errors checks a RayJob's flags with SCRIPT_PARSERS: it must parse as the script does.
    from helpers.tooling import scripts

    names = sorted(path.name for path in (REPO_ROOT / "notebooks").glob("*.py"))
    assert sorted(scripts.SCRIPT_PARSERS) == names, "add each script of notebooks/ to SCRIPT_PARSERS"
    for name in names:
        function, keywords = _parser_call(REPO_ROOT / "notebooks" / name)
        parser = scripts.SCRIPT_PARSERS[name]
        expected = (parser.func.__name__, parser.keywords) if isinstance(parser, functools.partial) else (
            parser.__name__, {})
        assert (function, keywords) == expected, f"{name} parses with {function}({keywords}), the table says {expected}"
        assert getattr(scripts, function) is (parser.func if isinstance(parser, functools.partial) else parser)


def test_parse_script_args_names_the_scripts_it_knows():
    from helpers.tooling.scripts import parse_script_args

    assert parse_script_args("tune_ray_ddp.py", ["--num-samples", "3"]).num_samples == 3
    assert parse_script_args("train_ray_ddp_with_ray_data.py", ["--name", "run-1"]).name == "run-1"
    with pytest.raises(ValueError, match="train.py is not one of the course's scripts .*SCRIPT_PARSERS"):
        parse_script_args("train.py", [])


def test_train_fsdp_s_flags_default_to_lesson_12_s_sharded_run(monkeypatch):
    from helpers.tooling.scripts import SMOKE_FSDP_STEPS, parse_fsdp_args

    monkeypatch.setenv("COURSE_SMOKE_TEST", "1")
    args = parse_fsdp_args("x", [])
    assert (args.ddp, args.bf16, args.checkpoint_activations, args.accumulation_steps, args.memory_budget_mb,
            args.max_failures, args.name) == (False, False, False, 1, None, 0, None)
    assert args.steps_per_epoch == SMOKE_FSDP_STEPS, "unset: the mode's steps per epoch"
    args = parse_fsdp_args("x", ["--bf16", "--checkpoint-activations", "--accumulation-steps", "4",
                                 "--memory-budget-mb", "512.5", "--max-failures", "0", "--steps-per-epoch", "3",
                                 "--name", "run-1"])
    assert (args.bf16, args.checkpoint_activations, args.accumulation_steps, args.memory_budget_mb,
            args.max_failures, args.steps_per_epoch, args.name) == (True, True, 4, 512.5, 0, 3, "run-1")
    for refused in (["--accumulation-steps", "0"], ["--max-failures", "-1"], ["--memory-budget-mb", "0"],
                    ["--ddp", "--bf16"]):  # bf16 is FSDP2's MixedPrecisionPolicy: the DDP loop ignores it
        with pytest.raises(SystemExit):
            parse_fsdp_args("x", refused)


def test_use_gpu_flags_default_to_the_configuration():
    from helpers.tooling.scripts import parse_args

    assert parse_args("x", []).use_gpu is None, "unset: COURSE_USE_GPU decides (auto: GPUs when the cluster has any)"
    assert parse_args("x", ["--use-gpu"]).use_gpu is True
    assert parse_args("x", ["--no-use-gpu"]).use_gpu is False


def test_a_course_error_raised_in_a_worker_is_printed_as_one_line():
    from ray.train import WorkerGroupError

    from helpers.data import DataNotFoundError
    from helpers.tooling.scripts import run_script

    def worker_without_data():  # what fit() raises when a worker's load_mnist fails (Ray Train 2.60)
        raise WorkerGroupError("Training failed", {0: ValueError("other"),
                                                   1: DataNotFoundError("MNIST is not in /data on node ab")})

    with pytest.raises(SystemExit, match="^error: MNIST is not in /data on node ab$"):
        run_script(worker_without_data)

    def worker_bug():
        raise WorkerGroupError("Training failed", {0: ZeroDivisionError()})

    with pytest.raises(WorkerGroupError):  # anything else keeps its traceback
        run_script(worker_bug)


def test_positive_numbers_are_one_argparse_type_with_a_clear_error():
    import argparse

    from helpers.tooling.flags import positive

    assert positive()("3") == 3 and positive(float)("0.5") == 0.5 and positive(int, 3)("3") == 3
    for parse, text, message in [(positive(), "0", "must be at least 1, got 0"),
                                 (positive(float), "nan", "must be more than 0, got nan"),
                                 (positive(float), "-1", "must be more than 0, got -1"),
                                 (positive(int, 3, ": why"), "2", "must be at least 3: why, got 2")]:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$".replace("(", r"\(")):
            parse(text)
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=positive())
    with pytest.raises(SystemExit):
        parser.parse_args(["--n", "1.5"])  # argparse's own "invalid int value: '1.5'"


@pytest.mark.parametrize("name", ["train_capstone.py", "train_fsdp.py", "train_ray_ddp.py",
                                  "train_ray_ddp_with_ray_data.py", "train_streaming.py", "tune_ray_ddp.py"])
def test_parsing_a_scripts_flags_does_not_load_dotenv(name, tmp_path, monkeypatch):
    from helpers.tooling.scripts import parse_script_args

    (tmp_path / ".env").write_text("COURSE_NUM_WORKERS=3\nCOURSE_SMOKE_TEST=1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COURSE_NUM_WORKERS", raising=False)
    monkeypatch.setenv("COURSE_SMOKE_TEST", "0")
    args = parse_script_args(name, [])
    assert "COURSE_NUM_WORKERS" not in os.environ and (args.num_workers, args.smoke_test) == (None, False)
    monkeypatch.setenv("COURSE_NUM_WORKERS", "4")
    assert parse_script_args(name, ["--smoke-test"]).num_workers == 4, "unset flags take the configuration"

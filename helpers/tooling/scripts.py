"""What the course's command-line training scripts share: flags, the summary lines, error handling."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import ray
from ray.train import Result, WorkerGroupError

from helpers.cluster import ResourceRequestError, StoragePathError
from helpers.config import ConfigError, load_config, load_dotenv_file
from helpers.data import DataNotFoundError
from helpers.results import read_history
from helpers.session import LOCAL_RAY
from helpers.sizes import SIZES, sized
from helpers.storage import uri
from helpers.tooling.flags import add_course_flags, add_name_flag, config_defaults, positive


def parse_args(description: str, argv: list[str] | None = None, resumable: bool = False) -> argparse.Namespace:
    """`--num-workers --epochs --use-gpu/--no-use-gpu --smoke-test --storage-path`, defaulting to the configuration;
    `--name` too for a script whose loop resumes from its checkpoints (`resumable`).

    Unset, `--num-workers` and `--use-gpu` are None: the course sizes the run for the cluster, as `setup()` does
    (COURSE_NUM_WORKERS, COURSE_USE_GPU=auto: one worker per GPU when the cluster has GPUs, else 2 on CPU).
    """
    return config_defaults(_training_parser(description, resumable).parse_args(argv))


def _training_parser(description: str, resumable: bool) -> argparse.ArgumentParser:
    """The parser of `parse_args`, for a script that adds its own flags to it."""
    parser = argparse.ArgumentParser(description=description)
    add_course_flags(parser, "results and checkpoints", "tiny epochs (CI)")
    parser.add_argument("--epochs", type=positive(), default=2, help="training epochs")
    parser.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="one GPU per worker, or none (default: COURSE_USE_GPU, auto: GPUs when the cluster "
                             "has any)")
    if resumable:
        add_name_flag(parser, "the run", " from its latest checkpoint")
    return parser


#: train_fsdp.py's optimizer steps per epoch without --steps-per-epoch (lesson 12's training run), and in smoke mode.
FSDP_STEPS = SIZES["full"]["fsdp_steps"]["train"]
SMOKE_FSDP_STEPS = SIZES["smoke"]["fsdp_steps"]["train"]


def parse_fsdp_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """`parse_args`' flags with `--name` (resumable), and lesson 12's: `--ddp`, `--bf16`, `--checkpoint-activations`,
    `--accumulation-steps`, `--steps-per-epoch`, `--memory-budget-mb`, `--max-failures`.

    `--steps-per-epoch` is None when not given: the mode's (FSDP_STEPS, SMOKE_FSDP_STEPS) is filled in.
    """
    parser = _training_parser(description, resumable=True)
    parser.add_argument("--ddp", action="store_true",
                        help="replicate the model on every worker (lesson 02's DDP) instead of sharding it (FSDP2)")
    parser.add_argument("--bf16", action="store_true",
                        help="compute in bfloat16, reduce gradients in float32 (FSDP2's MixedPrecisionPolicy; "
                             "not with --ddp)")
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="keep only each block's input for backward, and run its forward again there")
    parser.add_argument("--accumulation-steps", type=positive(), default=1,
                        help="micro-batches per optimizer step (gradient accumulation; default 1)")
    parser.add_argument("--steps-per-epoch", type=positive(), default=None,
                        help=f"optimizer steps per epoch (default {FSDP_STEPS}, {SMOKE_FSDP_STEPS} with "
                             "--smoke-test)")
    parser.add_argument("--memory-budget-mb", type=positive(float), default=None,
                        help="fail a worker whose tensors outgrow this many MiB, as a GPU of that size would "
                             "(default: no budget)")
    parser.add_argument("--max-failures", type=positive(int, 0), default=0,
                        help="worker-group failures to recover from, each from the latest checkpoint (default 0)")
    args = config_defaults(parser.parse_args(argv))
    if args.bf16 and args.ddp:
        parser.error("--bf16 is FSDP2's mixed precision: leave out --ddp, or --bf16")
    if args.steps_per_epoch is None:
        args.steps_per_epoch = sized("fsdp_steps", args.smoke_test)["train"]
    return args


#: tune_ray_ddp.py's search without flags: trials, and epochs per trial (ASHA may stop a trial earlier).
SEARCH_DEFAULTS = SIZES["full"]["search"]
#: ... and in smoke mode (COURSE_SMOKE_TEST=1, --smoke-test).
SMOKE_SEARCH_DEFAULTS = SIZES["smoke"]["search"]


def parse_tune_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """`--num-workers --smoke-test --storage-path` (workers per trial), `--num-samples --max-concurrent-trials
    --epochs --name`, defaulting to the configuration; unset, `--num-samples` and `--epochs` follow the mode
    (SEARCH_DEFAULTS, SMOKE_SEARCH_DEFAULTS) and `--max-concurrent-trials` is sized for the cluster."""
    parser = argparse.ArgumentParser(description=description)
    add_course_flags(parser, "the search, its trials' runs and checkpoints", "tiny trials (CI)")
    parser.add_argument("--num-samples", type=positive(), default=None,
                        help=f"trials to run (default {SEARCH_DEFAULTS['num_samples']}, "
                             f"{SMOKE_SEARCH_DEFAULTS['num_samples']} with --smoke-test)")
    parser.add_argument("--max-concurrent-trials", type=positive(), default=None,
                        help="trials that train at once (default: 2, fewer when their workers do not fit)")
    parser.add_argument("--epochs", type=positive(int, 3, ": ASHA compares trials after their second epoch (epoch 1)"),
                        default=None,
                        help=f"epochs per trial, if ASHA does not stop it earlier (default {SEARCH_DEFAULTS['epochs']}, "
                             f"{SMOKE_SEARCH_DEFAULTS['epochs']} with --smoke-test; at least 3)")
    add_name_flag(parser, "the search", ", its finished trials kept")
    args = config_defaults(parser.parse_args(argv))
    defaults = sized("search", args.smoke_test)
    args.num_samples = defaults["num_samples"] if args.num_samples is None else args.num_samples
    args.epochs = defaults["epochs"] if args.epochs is None else args.epochs
    return args


#: train_streaming.py's default size in GB (GiB), and its smoke test's (COURSE_SMOKE_TEST=1), without --data-size-gb.
DEFAULT_SIZE_GB = SIZES["full"]["streaming_gb"]
SMOKE_SIZE_GB = SIZES["smoke"]["streaming_gb"]
#: The smallest object store Ray starts (Ray 2.60: OBJECT_STORE_MINIMUM_MEMORY_BYTES in ray/_private/ray_constants.py).
MIN_OBJECT_STORE_MIB = 75


def parse_streaming_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """`--data-size-gb --num-epochs --object-store-mib --num-workers --smoke-test --storage-path --json`, defaulting
    to the configuration.

    `--data-size-gb` is None when not given: `requested_size_gb` picks 1 GB, or 0.01 GB in smoke mode.
    `--object-store-mib` is None when not given (Ray's default object store), and refused with RAY_ADDRESS set.
    """
    parser = argparse.ArgumentParser(description=description)
    add_course_flags(parser, "the dataset and the run",
                     f"a tiny dataset ({SMOKE_SIZE_GB:g} GB) unless --data-size-gb is given (CI)")
    parser.add_argument("--data-size-gb", type=positive(float), default=None,
                        help=f"GB (GiB) of images to write and stream (default {DEFAULT_SIZE_GB:g}, "
                             f"{SMOKE_SIZE_GB:g} with --smoke-test)")
    parser.add_argument("--num-epochs", type=positive(), default=2, help="passes over the whole dataset")
    parser.add_argument("--object-store-mib", type=positive(int, MIN_OBJECT_STORE_MIB, " (Ray's smallest object store)"),
                        default=None,
                        help="start the local Ray with an object store of this many MiB, to stream a dataset "
                             "larger than it (default: Ray's, 30%% of RAM); not with RAY_ADDRESS")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report to this JSON file")
    args = config_defaults(parser.parse_args(argv))
    if args.object_store_mib is not None and (address := load_config().ray_address) and address != LOCAL_RAY:
        parser.error(f"--object-store-mib sizes the object store of the Ray this script starts, but RAY_ADDRESS="
                     f"{address} joins a running cluster, whose nodes sized their object stores when they "
                     "started. To fix it: leave out --object-store-mib, or start each node with `ray start "
                     "--object-store-memory=<bytes>` (KubeRay: rayStartParams object-store-memory), or unset "
                     "RAY_ADDRESS to run on a local Ray.")
    return args


#: Each script in notebooks/ and the parser its `main` reads its flags with: `parser(description, argv)`.
#: tests/test_scripts.py fails when a script is missing here or parses with another function.
SCRIPT_PARSERS: dict[str, Callable[[str, list[str] | None], argparse.Namespace]] = {
    "train_ray_ddp.py": parse_args,
    "train_ray_ddp_with_ray_data.py": functools.partial(parse_args, resumable=True),
    "train_capstone.py": functools.partial(parse_args, resumable=True),
    "train_fsdp.py": parse_fsdp_args,
    "train_streaming.py": parse_streaming_args,
    "tune_ray_ddp.py": parse_tune_args,
}


def parse_script_args(script: str, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed as the course script `script` (its file name, e.g. "tune_ray_ddp.py") parses its flags."""
    if script not in SCRIPT_PARSERS:
        raise ValueError(f"{script} is not one of the course's scripts ({', '.join(SCRIPT_PARSERS)}): name one of "
                         "those, or add the new script and its parser to SCRIPT_PARSERS in helpers/tooling/scripts.py")
    return SCRIPT_PARSERS[script](script, argv)


def requested_size_gb(args: argparse.Namespace) -> float:
    """The dataset's size in GB: `--data-size-gb` when given, else 0.01 in smoke mode and 1 otherwise."""
    if args.data_size_gb is not None:
        return float(args.data_size_gb)
    return float(sized("streaming_gb", args.smoke_test))


def print_result(result: Result) -> None:
    """Print the run's final metrics, its checkpoint and the nodes its workers ran on."""
    metrics = result.metrics
    shown = {"test_acc": ".4f", "test_loss": ".4f", "images_per_s": ".0f"}  # those the loop reports
    print(" ".join(f"{key}={metrics[key]:{spec}}" for key, spec in shown.items() if key in metrics))
    print(f"checkpoint: {uri(result.checkpoint.path, result.checkpoint.filesystem)}")  # s3://... on S3
    nodes = read_history(result).iloc[-1]["worker_nodes"]  # one node id per rank, from MetricsHistory
    print(f"workers ran on {len(set(nodes))} node(s): {', '.join(node[:8] for node in nodes)}")


#: The course's own errors: each says what to change, so a script prints it without a traceback.
COURSE_ERRORS = (ConfigError, DataNotFoundError, ResourceRequestError, StoragePathError)


def _course_error(error: BaseException) -> BaseException | None:
    """`error` if it is one of the course's errors, or the first one a Ray Train worker raised; else None."""
    if isinstance(error, COURSE_ERRORS):
        return error
    if isinstance(error, WorkerGroupError):  # `worker_failures`: what each failed worker raised, by rank
        for failure in error.worker_failures.values():
            if isinstance(failure, COURSE_ERRORS):
                return failure
    return None


def run_script(main: Callable[[], object]) -> None:
    """Run a script's `main()`: the course's own errors as one line (no traceback), also when a Ray Train worker
    raised them (e.g. a node without the data); Ray shut down always. `.env` is loaded first, for the configuration
    the script's flags default to."""
    try:
        load_dotenv_file()
        main()
    except (*COURSE_ERRORS, WorkerGroupError) as error:
        if (cause := _course_error(error)) is None:
            raise
        raise SystemExit(f"error: {cause}") from None
    finally:
        ray.shutdown()

"""The course commands' flags, defined once: a positive-number `type=` and the flag groups the scripts compose.

Building a parser reads nothing: no `.env`, no configuration. The flags that default to the configuration are None
when not given, and `config_defaults` fills them in after parsing, from the environment as it is then (the scripts
load `.env` where their `main` runs: `helpers.tooling.scripts.run_script`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def positive(kind: type = int, minimum: float | None = None, why: str = "") -> Callable[[str], Any]:
    """An argparse `type=`: the flag's value as `kind`, refused with a usage error unless it is at least `minimum`
    (default: a whole number >= 1, or a number > 0 for a float; `why` is added to the error)."""
    bound = f"at least {minimum:g}" if minimum is not None else ("at least 1" if kind is int else "more than 0")

    def parse(text: str) -> Any:
        value = kind(text)  # not a number: argparse's "invalid int value: 'two'"
        ok = value >= minimum if minimum is not None else (value >= 1 if kind is int else value > 0)
        if not ok:  # `not >=` also refuses nan
            raise argparse.ArgumentTypeError(f"must be {bound}{why}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own message
    return parse


def add_course_flags(parser: argparse.ArgumentParser, stores: str, smoke_test_help: str) -> None:
    """`--num-workers --smoke-test --storage-path`, which every course script takes; None unless given (see
    `config_defaults`). `stores` says what goes to the storage path."""
    parser.add_argument("--num-workers", type=positive(), default=None,
                        help="Ray Train workers (default: COURSE_NUM_WORKERS, else one per GPU, else 2)")
    parser.add_argument("--smoke-test", action="store_true", default=None, help=smoke_test_help)
    parser.add_argument("--storage-path", default=None,
                        help=f"where {stores} go: a shared folder or a URI such as s3://bucket/prefix")


def add_name_flag(parser: argparse.ArgumentParser, what: str, continued: str) -> None:
    """`--name`: the run's (or search's) name under the storage path, continued when it exists."""
    parser.add_argument("--name", default=None, help=f"{what}'s name under the storage path: a {what.split()[-1]} "
                                                     f"of that name is continued{continued} (default: a new name)")


def config_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the course flags not given taken from the configuration (environment; COURSE_NUM_WORKERS,
    COURSE_SMOKE_TEST, COURSE_STORAGE_PATH), as the scripts' defaults."""
    from helpers.config import load_config

    cfg = load_config()
    if args.num_workers is None:
        args.num_workers = cfg.num_workers
    if args.smoke_test is None:
        args.smoke_test = cfg.smoke_test
    if args.storage_path is None:
        args.storage_path = cfg.storage_path
    return args

"""What the course's command-line training scripts share: flags, the summary line, error handling."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import ray
from ray.train import Result

from helpers.cluster import ResourceRequestError, StoragePathError
from helpers.config import ConfigError, load_config, load_dotenv_file
from helpers.data import DataNotFoundError


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """`--num-workers --epochs --use-gpu --smoke-test --storage-path`, defaulting to the course configuration."""
    load_dotenv_file()
    cfg = load_config()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--num-workers", type=int, default=cfg.num_workers, help="Ray Train workers")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs")
    parser.add_argument("--use-gpu", action="store_true", default=cfg.use_gpu is True, help="one GPU per worker")
    parser.add_argument("--smoke-test", action="store_true", default=cfg.smoke_test, help="tiny epochs (CI)")
    parser.add_argument("--storage-path", default=str(cfg.storage_path), help="where results and checkpoints go")
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.epochs < 1:
        parser.error("--num-workers and --epochs must be at least 1")
    return args


def print_result(result: Result) -> None:
    """Raise the run's error, or print its final metrics and checkpoint."""
    if result.error:
        raise result.error
    metrics = result.metrics
    print(f"test_acc={metrics['test_acc']:.4f} test_loss={metrics['test_loss']:.4f} "
          f"images_per_s={metrics['images_per_s']:.0f}")
    print(f"checkpoint: {result.checkpoint.path}")


def run_script(main: Callable[[], object]) -> None:
    """Run a script's `main()`: the course's own errors as one line (no traceback); Ray shut down always."""
    try:
        main()
    except (ConfigError, DataNotFoundError, ResourceRequestError, StoragePathError) as error:
        raise SystemExit(f"error: {error}") from None
    finally:
        ray.shutdown()

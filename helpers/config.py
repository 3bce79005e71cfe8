"""The course's one configuration: read from the environment and a `.env` file.

Every knob is an environment variable (documented in `.env.example`), so the same
notebook runs unchanged on a CPU laptop, a GPU box and a Ray cluster.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from dotenv import find_dotenv, load_dotenv

#: The repository root when `helpers` is installed from a checkout (editable install).
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Anyscale workspaces (and many clusters) mount shared storage here.
CLUSTER_STORAGE = Path("/mnt/cluster_storage")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_AUTO = ("auto", "")


class ConfigError(ValueError):
    """A configuration variable holds a value the course cannot use."""


@dataclass(frozen=True)
class CourseConfig:
    """The effective settings of the course, validated."""

    smoke_test: bool
    data_dir: Path
    storage_path: Path
    num_workers: int
    use_gpu: bool | Literal["auto"]
    accelerator_type: str | None
    ray_address: str | None

    @property
    def mode(self) -> str:
        """'smoke' (tiny runs, for CI and quick checks) or 'full' (the lesson's real size)."""
        return "smoke" if self.smoke_test else "full"

    def with_gpu(self, available: bool) -> CourseConfig:
        """Resolve `use_gpu='auto'` against whether the cluster has a GPU."""
        if self.use_gpu == "auto":
            return replace(self, use_gpu=available)
        if self.use_gpu and not available:
            raise ConfigError(
                "COURSE_USE_GPU=true but the Ray cluster has no GPU. "
                "Set COURSE_USE_GPU=auto (or false) to train on CPU, or connect to a cluster "
                "with GPUs through RAY_ADDRESS."
            )
        return self

    def as_env(self) -> dict[str, str]:
        """These settings as COURSE_* variables, to hand to Ray workers."""
        gpu = "auto" if self.use_gpu == "auto" else ("1" if self.use_gpu else "0")
        return {
            "COURSE_SMOKE_TEST": "1" if self.smoke_test else "0",
            "COURSE_DATA_DIR": str(self.data_dir),
            "COURSE_STORAGE_PATH": str(self.storage_path),
            "COURSE_NUM_WORKERS": str(self.num_workers),
            "COURSE_USE_GPU": gpu,
            "COURSE_ACCELERATOR_TYPE": self.accelerator_type or "",
        }


def _bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={environ[name]!r} is not valid: use one of {', '.join(_TRUE + _FALSE)}.")


def _gpu(environ: Mapping[str, str], name: str) -> bool | Literal["auto"]:
    raw = environ.get(name, "").strip().lower()
    if raw in _AUTO:
        return "auto"
    try:
        return _bool(environ, name, default=False)
    except ConfigError:
        raise ConfigError(
            f"{name}={environ[name]!r} is not valid: use auto (detect), true/1 or false/0."
        ) from None


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name}={environ[name]!r} is not valid: use a whole number >= 1, e.g. {default}.")
    return value


def _accelerator(environ: Mapping[str, str], name: str) -> str | None:
    raw = environ.get(name, "").strip()
    if raw == "":
        return None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", raw):
        raise ConfigError(f"{name}={environ[name]!r} is not valid: use an accelerator type such as T4, A10G or H100.")
    return raw


def _path(environ: Mapping[str, str], name: str, default: Path) -> Path:
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    path = Path(raw).expanduser()
    if not path.is_absolute():
        # Relative paths are taken from the repository root, not from wherever the kernel runs.
        path = REPO_ROOT / path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={raw!r} is not valid: it names a file; use a folder path.")
    return path.resolve()


def default_storage_path() -> Path:
    """`/mnt/cluster_storage/ray-train-course` when that shared mount exists, else `<repo>/runs`."""
    if CLUSTER_STORAGE.is_dir():
        return CLUSTER_STORAGE / "ray-train-course"
    return REPO_ROOT / "runs"


def load_config(environ: Mapping[str, str] | None = None) -> CourseConfig:
    """Build the validated configuration from `environ` (default: `os.environ`).

    Raises ConfigError naming the variable and the accepted values when one is malformed.
    """
    env = os.environ if environ is None else environ
    return CourseConfig(
        smoke_test=_bool(env, "COURSE_SMOKE_TEST", default=False),
        data_dir=_path(env, "COURSE_DATA_DIR", REPO_ROOT / "data"),
        storage_path=_path(env, "COURSE_STORAGE_PATH", default_storage_path()),
        num_workers=_positive_int(env, "COURSE_NUM_WORKERS", default=2),
        use_gpu=_gpu(env, "COURSE_USE_GPU"),
        accelerator_type=_accelerator(env, "COURSE_ACCELERATOR_TYPE"),
        ray_address=env.get("RAY_ADDRESS", "").strip() or None,
    )


def load_dotenv_file(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Load `.env` into `os.environ` without overriding variables already set.

    Looks for `.env` from the current folder upwards (notebooks run in `notebooks/`).
    Returns the file loaded, or None when there is none.
    """
    found = Path(path) if path is not None else Path(find_dotenv(usecwd=True) or "")
    if not found.name or not found.is_file():
        return None
    load_dotenv(found, override=False)
    return found

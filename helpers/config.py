"""The course's one configuration: read from the environment and a `.env` file.

Every knob is an environment variable (documented in `.env.example`), so the same
notebook runs unchanged on a CPU laptop, a GPU box and a Ray cluster.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from dotenv import find_dotenv, load_dotenv

from helpers.storage import is_uri

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
    #: Whether a process that finds no MNIST in `data_dir` may download it there (COURSE_DATA_DOWNLOAD, default: yes).
    #: Lesson 08's pods set it to 0: their data folder is filled once, before training, by a Job of its own.
    data_download: bool
    #: An absolute local path (a folder, an NFS mount) or a URI such as s3://bucket/prefix.
    storage_path: str
    #: None until `setup()` sizes the run for the cluster (COURSE_NUM_WORKERS unset).
    num_workers: int | None
    use_gpu: bool | Literal["auto"]
    #: None: each worker gets its share of the CPUs of the node it runs on (COURSE_CPUS_PER_WORKER unset).
    cpus_per_worker: float | None
    accelerator_type: str | None
    #: RAY_ADDRESS as given; in what `setup()` returns, the cluster the kernel joined (None: it started a local Ray).
    ray_address: str | None
    #: Lesson 08, read in this process only (not handed to workers): the folder with KubeRay's CRDs and chart
    #: (COURSE_KUBERAY_DIR; None: <data dir>/kuberay-v<version>, downloaded), and whether its cluster commands run
    #: against kubectl's current context (COURSE_KUBERNETES=1).
    kuberay_dir: Path | None = None
    kubernetes: bool = False
    #: In what `setup()` returns, the CPUs it planned for each worker (its `workers` line: COURSE_CPUS_PER_WORKER,
    #: else the worker's share of the node that hosts it); None before. Lesson 02 types it into its ScalingConfig.
    worker_cpus: float | None = None

    @property
    def mode(self) -> str:
        """'smoke' (tiny runs, for CI and quick checks) or 'full' (the lesson's real size)."""
        return "smoke" if self.smoke_test else "full"

    def as_env(self) -> dict[str, str]:
        """These settings as COURSE_* variables, to hand to Ray workers (empty: unset, decided by setup())."""
        gpu = "auto" if self.use_gpu == "auto" else ("1" if self.use_gpu else "0")
        return {
            "COURSE_SMOKE_TEST": "1" if self.smoke_test else "0",
            "COURSE_DATA_DIR": str(self.data_dir),
            "COURSE_DATA_DOWNLOAD": "" if self.data_download else "0",
            "COURSE_STORAGE_PATH": self.storage_path,
            "COURSE_NUM_WORKERS": "" if self.num_workers is None else str(self.num_workers),
            "COURSE_USE_GPU": gpu,
            "COURSE_CPUS_PER_WORKER": "" if self.cpus_per_worker is None else f"{self.cpus_per_worker:g}",
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


_Number = TypeVar("_Number", int, float)


def _positive(environ: Mapping[str, str], name: str, parse: type[_Number], accepted: str) -> _Number | None:
    raw = environ.get(name, "").strip()
    if raw == "":
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = 0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={environ[name]!r} is not valid: use {accepted}.")
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
    if is_uri(raw):
        raise ConfigError(f"{name}={raw!r} is not valid: use a local folder (or a shared mount every node sees); "
                          "torchvision reads MNIST from local files.")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        # Relative paths are taken from the repository root, not from wherever the kernel runs.
        path = REPO_ROOT / path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={raw!r} is not valid: it names a file; use a folder path.")
    return path.resolve()


#: The folder under a Ray session where Ray unpacks runtime envs (ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME):
#: a submitted job's copy of its working_dir lives there, shared by the jobs with the same code, until Ray evicts it
#: from the node's cache (once no job uses it and the cache passes RAY_RUNTIME_ENV_WORKING_DIR_CACHE_SIZE_GB).
RAY_RUNTIME_ENV_DIR = "runtime_resources"


def _storage(environ: Mapping[str, str], name: str, default: str) -> str:
    raw = environ.get(name, "").strip()
    if is_uri(raw):  # s3://, gs://, ...: a remote filesystem, never a local folder named "s3:"
        return raw.rstrip("/")
    path = _path(environ, name, Path(default))
    if RAY_RUNTIME_ENV_DIR in path.parts:
        # `ray job submit --working-dir .` runs the job in Ray's copy of the folder: <repo>/runs lands in it.
        given = f"{name}={raw!r} is" if raw else f"{name} is not set, and its default is"
        raise ConfigError(
            f"{given} {path}, inside Ray's copy of this job's working_dir, which other jobs share and Ray may "
            f"delete, checkpoints and all. Set {name} to storage that outlives the job, e.g. in the job's runtime env: "
            f"--runtime-env-json '{{\"env_vars\": {{\"{name}\": \"/mnt/cluster_storage/ray-train-course\"}}}}'.")
    return str(path)


def default_storage_path() -> str:
    """`/mnt/cluster_storage/ray-train-course` when that shared mount exists, else `<repo>/runs`."""
    if CLUSTER_STORAGE.is_dir():
        return str(CLUSTER_STORAGE / "ray-train-course")
    return str(REPO_ROOT / "runs")


def load_config(environ: Mapping[str, str] | None = None) -> CourseConfig:
    """Build the validated configuration from `environ` (default: `os.environ`).

    Raises ConfigError naming the variable and the accepted values when one is malformed.
    """
    env = os.environ if environ is None else environ
    return CourseConfig(
        smoke_test=_bool(env, "COURSE_SMOKE_TEST", default=False),
        data_dir=_path(env, "COURSE_DATA_DIR", REPO_ROOT / "data"),
        data_download=_bool(env, "COURSE_DATA_DOWNLOAD", default=True),
        storage_path=_storage(env, "COURSE_STORAGE_PATH", default_storage_path()),
        num_workers=_positive(env, "COURSE_NUM_WORKERS", int, "a whole number >= 1, e.g. 2"),
        use_gpu=_gpu(env, "COURSE_USE_GPU"),
        cpus_per_worker=_positive(env, "COURSE_CPUS_PER_WORKER", float, "a number of CPUs > 0, e.g. 2 or 0.5"),
        accelerator_type=_accelerator(env, "COURSE_ACCELERATOR_TYPE"),
        ray_address=env.get("RAY_ADDRESS", "").strip() or None,
        kuberay_dir=_path(env, "COURSE_KUBERAY_DIR", Path()) if env.get("COURSE_KUBERAY_DIR", "").strip() else None,
        kubernetes=_bool(env, "COURSE_KUBERNETES", default=False),
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

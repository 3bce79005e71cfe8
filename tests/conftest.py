"""Fixtures shared by the test modules.

Starting Ray takes about 8 s on the 2-core CI machine and writing MNIST as Parquet about 13 s, so the modules that
train in this process (test_cluster, test_fault_tolerance, test_ingest) share one of each:

- `course_ray`: the course's `setup()`, run by the first module that asks for it; later modules get the same
  configuration while that Ray is still up.
- `no_ray`: a module that starts its own Ray (with other settings) or its own cluster asks for this instead; it
  shuts the shared Ray down first. Whatever is still up at the end of the session is shut down then.
- `mnist_parquet`: lesson 03's Parquet copy of MNIST in one folder for the session, written once
  (`write_mnist_parquet` finds it complete the next time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from helpers import CourseConfig, setup
from helpers.ingest import write_mnist_parquet

_started: dict[str, CourseConfig] = {}  # the configuration setup() returned, while its Ray is up


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end() -> Iterator[None]:
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def course_ray() -> CourseConfig:
    """setup()'s configuration, with its local Ray up (started here unless a previous module left it running)."""
    if "cfg" not in _started or not ray.is_initialized():
        assert not ray.is_initialized(), "a Ray that setup() did not start is running"
        _started["cfg"] = setup()
    return _started["cfg"]


@pytest.fixture(scope="module")
def no_ray() -> None:
    """No Ray in this process when the module starts."""
    ray.shutdown()
    _started.clear()


@pytest.fixture(scope="session")
def _parquet_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
def mnist_parquet(course_ray: CourseConfig, _parquet_storage: Path) -> str:
    """The root of the Parquet copy of MNIST (train/ and test/), in a folder of this session."""
    return write_mnist_parquet(course_ray.data_dir, str(_parquet_storage))

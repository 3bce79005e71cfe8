"""Fixtures shared by the test modules in tests/.

- `course_ray`: the course's `setup()` with its local Ray up. Starting Ray takes about 8 s on the 2-core CI machine,
  so the modules that train in this process share one: the first module that asks for it starts it, and later
  modules get the same configuration while that Ray is still up.
- `no_ray`: a module that starts its own Ray (with other settings) or its own cluster asks for this instead; it shuts
  the shared Ray down first. Whatever is still up at the end of the session is shut down then.
- `mnist_parquet`: lesson 03's Parquet copy of MNIST in one folder for the session (about 13 s to write), written
  once; `write_mnist_parquet` finds it complete the next time.
- `small_mnist`: a data dir holding the first 2,048 training and 1,024 test images of MNIST in torchvision's raw
  layout, for the runs that test a path (S3, Ray Jobs, the autoscaler, several nodes) rather than the lessons'
  numbers: lesson 02's loop evaluates the whole test set on every worker, most of a smoke run's time with the real
  10,000 images.
- `s3_server`, `s3_path`: a real S3 API server on 127.0.0.1 (moto's server mode), for tests of `s3://` storage paths.
- `ray_tmpdir`: a private RAY_TMPDIR for one test, where a recorded cluster's file goes.
- `root`: a dataset's root that does not exist yet, local and on S3, for the shared datasets' race.
"""

from __future__ import annotations

import gzip
import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
import pytest
import ray

if TYPE_CHECKING:
    from helpers import CourseConfig

# Figures made by the unit tests render off-screen. (Not through MPLBACKEND: the notebooks' kernels inherit the
# environment and must keep Jupyter's inline backend.)
matplotlib.use("Agg")

#: Fixtures that start Ray in the test process. A test's tier is its module's: `pytestmark` at the module's top (`ray`
#: or `notebook`; none for the fast tier); collection fails when a test that uses one of these lacks `ray`.
RAY_FIXTURES = {"course_ray", "no_ray", "mnist_parquet"}
#: The tiers' markers; a module that mixes tiers fails collection too.
TIERS = ("ray", "notebook")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items
                if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("ray") is None]
    if untiered:
        raise pytest.UsageError("These tests start Ray (they use one of " + ", ".join(sorted(RAY_FIXTURES)) +
                                ") but are not marked `ray`: move them to a module with "
                                "`pytestmark = pytest.mark.ray`\n  " + "\n  ".join(untiered))
    tiers: dict[str, set[str]] = {}
    for item in items:
        tier = "+".join(name for name in TIERS if item.get_closest_marker(name)) or "fast"
        tiers.setdefault(item.nodeid.split("::")[0], set()).add(tier)
    mixed = {module: sorted(found) for module, found in tiers.items() if len(found) > 1}
    if mixed:
        raise pytest.UsageError("A test module holds tests of one tier, set by its `pytestmark`; these mix tiers:\n  " +
                                "\n  ".join(f"{module}: {', '.join(found)}" for module, found in sorted(mixed.items())))


_started: dict[str, CourseConfig] = {}  # the configuration setup() returned, while its Ray is up


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end() -> Iterator[None]:
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def course_ray() -> CourseConfig:
    """setup()'s configuration, with its local Ray up (started here unless a previous module left it running)."""
    if "cfg" not in _started or not ray.is_initialized():
        from helpers import setup

        assert not ray.is_initialized(), "a Ray that setup() did not start is running"
        _started["cfg"] = setup()
    return _started["cfg"]


@pytest.fixture(scope="module")
def no_ray() -> None:
    """No Ray in this process when the module starts."""
    ray.shutdown()
    _started.clear()


#: The images `small_mnist` keeps per split: enough for smoke mode's steps and lesson 03's SMOKE_ROWS.
SMALL_MNIST = {"train": 2048, "t10k": 1024}


@pytest.fixture(scope="session")
def small_mnist(tmp_path_factory) -> str:
    """A data dir with the first SMALL_MNIST images of each split, cut from the configured MNIST."""
    from helpers.config import load_config
    from helpers.data import MNIST_RAW_FILES, load_mnist

    source_dir = load_config().data_dir
    load_mnist(source_dir, train=True)  # present, downloaded, or the course's error saying what to set
    source, target = source_dir / "MNIST" / "raw", tmp_path_factory.mktemp("small-data")
    (target / "MNIST" / "raw").mkdir(parents=True)
    for name in MNIST_RAW_FILES:  # IDX: a magic number, the count, the other sizes, then the records
        raw = source / name
        data = raw.read_bytes() if raw.is_file() else gzip.decompress(raw.with_name(f"{name}.gz").read_bytes())
        count = SMALL_MNIST[name.split("-")[0]]
        header, record = (16, 28 * 28) if "images" in name else (8, 1)
        small = data[:4] + count.to_bytes(4, "big") + data[8:header] + data[header:header + count * record]
        (target / "MNIST" / "raw" / name).write_bytes(small)
    return str(target)


@pytest.fixture(scope="session")
def _parquet_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
def mnist_parquet(course_ray: CourseConfig, _parquet_storage: Path) -> str:
    """The root of the Parquet copy of MNIST (train/ and test/), in a folder of this session."""
    from helpers.ingest import write_mnist_parquet

    return write_mnist_parquet(course_ray.data_dir, str(_parquet_storage))


#: The environment the S3 clients (pyarrow's, boto3's, and so Ray Train's) read while the server runs:
#: dummy credentials, the server as endpoint, a fixed region.
_SET = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION",
        "AWS_EC2_METADATA_DISABLED")
#: Variables that would send the clients elsewhere (a service-specific endpoint wins over AWS_ENDPOINT_URL; a profile
#: that does not exist makes boto3 fail; a session token belongs to other credentials): unset while the server runs.
_UNSET = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN")


@dataclass(frozen=True)
class S3Server:
    """A running moto S3 server: its address, and a way to get a fresh bucket on it."""

    endpoint_url: str

    def bucket(self, name: str | None = None) -> str:
        """Create the bucket `name` (a unique name when None) and return its URI, `s3://<name>`."""
        import boto3

        name = name or f"course-test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server on 127.0.0.1 (a free port) per test module, with the AWS_* variables pointing at it.

    While the fixture lives, `os.environ` holds AWS_ENDPOINT_URL (the server), dummy AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY, and AWS_DEFAULT_REGION/AWS_REGION=us-east-1 (AWS_PROFILE, AWS_ENDPOINT_URL_S3 and
    AWS_SESSION_TOKEN are unset); the previous values come back at the end, also when a test fails. So a plain
    `s3://bucket/...` path works as a learner would set it: `pyarrow.fs.FileSystem.from_uri`, boto3 and
    `helpers.storage` reach the server with no extra arguments.

    Ray's processes inherit these variables only when Ray is started after the fixture set them: a Ray session
    already running keeps the environment it started with. A test that trains on S3 therefore starts its own
    local Ray (`ray.init()`) inside the fixture's lifetime, and shuts it down before it returns.
    """
    from moto.server import ThreadedMotoServer

    # moto's server logs every request through werkzeug's logger; keep its errors only.
    werkzeug_logger = logging.getLogger("werkzeug")
    previous_level = werkzeug_logger.level
    werkzeug_logger.setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint_url = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as environment:  # the session's environment, as it was, afterwards
            for name in _UNSET:
                environment.delenv(name, raising=False)
            for name, value in {
                "AWS_ENDPOINT_URL": endpoint_url,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
            }.items():
                environment.setenv(name, value)
            yield S3Server(endpoint_url=endpoint_url)
    finally:
        server.stop()
        werkzeug_logger.setLevel(previous_level)


@pytest.fixture
def s3_path(s3_server: S3Server) -> str:
    """`s3://<fresh bucket>/course`: a storage path in a new, empty bucket on the module's S3 server."""
    return f"{s3_server.bucket()}/course"


@pytest.fixture
def ray_tmpdir(monkeypatch) -> Iterator[Path]:
    """A private RAY_TMPDIR for this test (short: Ray's socket paths live under it), with its `ray` folder."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    (folder / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    """test_shared_datasets: a dataset's root that does not exist yet, under `tmp_path` or in a fresh S3 bucket."""
    from helpers import storage

    if request.param == "local":
        return str(tmp_path / "storage" / "datasets" / "test-set")
    return storage.join(request.getfixturevalue("s3_path"), "datasets", "test-set")

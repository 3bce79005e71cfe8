"""A real S3 API server on 127.0.0.1 (moto's server mode), for tests of `s3://` storage paths.

Test modules import the fixtures they use: `from s3_server import s3_path, s3_server  # noqa: F401 (fixtures)`.
(Not a tests/conftest.py: the nbval tests import the root conftest.py by its module name.)
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

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
    previous = {name: os.environ.get(name) for name in _SET + _UNSET}
    try:
        for name in _UNSET:
            os.environ.pop(name, None)
        os.environ.update({
            "AWS_ENDPOINT_URL": endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        })
        yield S3Server(endpoint_url=endpoint_url)
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
        werkzeug_logger.setLevel(previous_level)


@pytest.fixture
def s3_path(s3_server: S3Server) -> str:
    """`s3://<fresh bucket>/course`: a storage path in a new, empty bucket on the module's S3 server."""
    return f"{s3_server.bucket()}/course"

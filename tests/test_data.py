"""helpers.data: offline MNIST through torchvision, and the missing-data error."""

from __future__ import annotations

import re
import socket
import time

import pytest
import torch
from torchvision import datasets

from helpers.config import load_config
from helpers.data import DataNotFoundError, can_reach, load_mnist, mnist_is_present


def test_offline_mnist_loads_from_the_configured_data_dir():
    data_dir = load_config().data_dir
    train, test = load_mnist(data_dir, train=True), load_mnist(data_dir, train=False)
    assert (len(train), len(test)) == (60_000, 10_000)
    assert [int(train.targets[i]) for i in range(10)] == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert [int(test.targets[i]) for i in range(10)] == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and label == 5
    assert image.min() >= -1 and image.max() <= 1  # the seed's Normalize((0.5,), (0.5,))


def test_partial_data_is_not_present(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"")
    assert not mnist_is_present(tmp_path)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_missing_and_not_downloadable_fails_fast_with_what_to_do(tmp_path, monkeypatch):
    # Mirrors that refuse connections stand in for a machine without internet.
    monkeypatch.setattr(datasets.MNIST, "mirrors", [f"http://127.0.0.1:{_closed_port()}/mnist/"])
    start = time.monotonic()
    with pytest.raises(DataNotFoundError) as error:
        load_mnist(tmp_path / "empty", train=True)
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert str(tmp_path / "empty" / "MNIST" / "raw") in message
    assert "COURSE_DATA_DIR" in message and "online" in message
    assert not (tmp_path / "empty").exists(), "a failed load must not leave folders behind"


def test_can_reach():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert can_reach(f"http://127.0.0.1:{server.getsockname()[1]}/")
    assert not can_reach(f"http://127.0.0.1:{_closed_port()}/", timeout=1)


@pytest.fixture
def local_mirror(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving MNIST's .gz files, made from the offline copy; counts each download."""
    import gzip
    import hashlib
    import http.server
    import threading
    from collections import Counter

    raw = load_config().data_dir / "MNIST" / "raw"
    served, resources = tmp_path / "mirror", []
    served.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        data = gzip.compress((raw / name).read_bytes(), compresslevel=1)
        (served / f"{name}.gz").write_bytes(data)
        resources.append((f"{name}.gz", hashlib.md5(data).hexdigest()))
    downloads = Counter()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def do_GET(self):
            downloads[self.path] += 1
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(datasets.MNIST, "mirrors", [f"http://127.0.0.1:{server.server_address[1]}/"])
    monkeypatch.setattr(datasets.MNIST, "resources", resources)
    yield downloads
    server.shutdown()


def _train_images(data_dir: str, mirrors: list[str], resources: list[tuple[str, str]]) -> int:
    """In a new process: load MNIST's training set from `data_dir`, downloading it from the given mirror if needed."""
    datasets.MNIST.mirrors, datasets.MNIST.resources = mirrors, resources
    return len(load_mnist(data_dir, train=True))


def test_processes_on_one_node_download_one_copy_under_a_lock(local_mirror, tmp_path):
    import multiprocessing

    source = (datasets.MNIST.mirrors, datasets.MNIST.resources)
    assert _train_images(str(tmp_path / "alone"), *source) == 60_000  # torchvision's requests for one copy
    one_copy = dict(local_mirror)
    local_mirror.clear()
    data_dir = tmp_path / "node-local" / "data"  # not there yet, as the driver's data dir on a new node
    with multiprocessing.get_context("spawn").Pool(3) as pool:  # three workers of one node, at once
        assert pool.starmap(_train_images, [(str(data_dir), *source)] * 3) == [60_000] * 3
    assert dict(local_mirror) == one_copy, "three processes on one node downloaded more than one copy"
    assert mnist_is_present(data_dir)


def test_a_data_dir_that_cannot_be_created_on_a_node_says_so(local_mirror):
    with pytest.raises(DataNotFoundError) as error:
        load_mnist("/proc/course-data", train=False)
    message = str(error.value)
    # Where: this machine, or its Ray node when Ray runs in this process (the suite shares one between modules).
    assert re.search(rf"on (this machine|node [0-9a-f]{{8}}) \({re.escape(socket.gethostname())}\), and the folder "
                     "cannot be created there", message), message
    assert "on a mount every node shares" in message

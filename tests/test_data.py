"""helpers.data: offline MNIST through torchvision, and the missing-data error."""

from __future__ import annotations

import gzip
import re
import socket
import time

import pytest
import torch
from torchvision import datasets

from helpers.config import load_config
from helpers.data import (
    MNIST_RAW_FILES,
    DataDamagedError,
    DataNotFoundError,
    can_reach,
    check_mnist_files,
    load_mnist,
    mnist_is_present,
)
from helpers.system import free_ports
from tests.support import FAILS_FAST_S


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
    return free_ports(host="127.0.0.1")[0]


def test_missing_and_not_downloadable_fails_fast_with_what_to_do(tmp_path, monkeypatch):
    # Mirrors that refuse connections stand in for a machine without internet.
    monkeypatch.setattr(datasets.MNIST, "mirrors", [f"http://127.0.0.1:{_closed_port()}/mnist/"])
    start = time.monotonic()
    with pytest.raises(DataNotFoundError) as error:
        load_mnist(tmp_path / "empty", train=True)
    assert time.monotonic() - start < FAILS_FAST_S
    message = str(error.value)
    assert str(tmp_path / "empty" / "MNIST" / "raw") in message
    assert "COURSE_DATA_DIR" in message and "online" in message
    assert not (tmp_path / "empty").exists(), "a failed load must not leave folders behind"


def test_with_downloads_off_missing_data_fails_at_once_saying_how_to_fill_it(tmp_path, monkeypatch):
    # COURSE_DATA_DOWNLOAD=0 (lesson 08's pods): no mirror is tried, and the error says how to fill the folder.
    import helpers.data

    monkeypatch.setenv("COURSE_DATA_DOWNLOAD", "0")
    monkeypatch.setattr(helpers.data, "can_reach", lambda url, timeout=3.0: pytest.fail(f"it tried to reach {url}"))
    for download in (None, False):  # the setting, or the argument
        with pytest.raises(DataNotFoundError, match=r"downloads are off here \(COURSE_DATA_DOWNLOAD=0\)") as error:
            load_mnist(tmp_path / "empty", train=True, download=download)
        assert "deploy/kuberay/data-job.yaml" in str(error.value) and "COURSE_DATA_DOWNLOAD=1" in str(error.value)
    assert not (tmp_path / "empty").exists()
    # Present and whole, the data loads whatever the setting says.
    assert len(load_mnist(load_config().data_dir, train=False, download=False)) == 10_000


def test_fill_mnist_keeps_a_whole_copy_and_says_so(tmp_path, capsys):
    import shutil

    from helpers.data import fill_mnist

    shutil.copytree(load_config().data_dir / "MNIST" / "raw", tmp_path / "MNIST" / "raw")
    assert fill_mnist(tmp_path) == tmp_path / "MNIST" / "raw"
    assert capsys.readouterr().out == (f"MNIST was already in {tmp_path / 'MNIST' / 'raw'}, whole: "
                                       "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, train-images-idx3-ubyte, "
                                       "train-labels-idx1-ubyte\n")


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


# --- Damaged files: named, with the fix, before torchvision reads them ------------------------------------------------

def _tiny_mnist(data_dir, count: int = 5, compress: bool = False):
    """A data dir with `count` images and labels per split in MNIST's raw layout (IDX, optionally .gz only)."""
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in MNIST_RAW_FILES:
        if "images" in name:
            data = b"\x00\x00\x08\x03" + b"".join(n.to_bytes(4, "big") for n in (count, 28, 28)) + bytes(count * 784)
        else:
            data = b"\x00\x00\x08\x01" + count.to_bytes(4, "big") + bytes(range(count))
        (raw / f"{name}.gz").write_bytes(gzip.compress(data)) if compress else (raw / name).write_bytes(data)
    return raw


def test_a_truncated_mnist_file_names_the_file_and_the_fix_within_seconds(tmp_path):
    raw = _tiny_mnist(tmp_path)
    check_mnist_files(tmp_path)  # whole: quiet
    damaged = raw / "train-images-idx3-ubyte"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    start = time.monotonic()
    with pytest.raises(DataDamagedError) as error:
        load_mnist(tmp_path, train=True)
    assert time.monotonic() - start < FAILS_FAST_S
    message = str(error.value)
    assert f"{damaged}: 1,000 bytes, expected 3,936 (a 16-byte header and 5 images of 28x28 bytes)" in message
    assert "delete the damaged file(s) and re-run online" in message
    assert f"copy the four files {', '.join(MNIST_RAW_FILES)} from a good copy into {raw}" in message
    assert isinstance(error.value, DataNotFoundError), "scripts print the course's data errors as one line"


@pytest.mark.parametrize("name, data, expected", [
    ("t10k-labels-idx1-ubyte", b"\x00\x00", "2 bytes, too short for its 8-byte header"),
    ("t10k-labels-idx1-ubyte", b"<html>not MNIST</html>", "not an IDX file of 1-dimensional uint8 data"),
    ("t10k-images-idx3-ubyte", b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") + (32).to_bytes(4, "big") * 2,
     "records of shape (32, 32), expected (28, 28)"),
    ("t10k-labels-idx1-ubyte", b"\x00\x00\x08\x01" + (4).to_bytes(4, "big") + bytes(4),
     "t10k-*: 5 images but 4 labels"),
], ids=["short", "not-idx", "shape", "counts"])
def test_a_file_that_is_not_mnist_s_is_named_with_what_is_wrong(tmp_path, name, data, expected):
    raw = _tiny_mnist(tmp_path)
    (raw / name).write_bytes(data)
    with pytest.raises(DataDamagedError, match=re.escape(expected)):
        check_mnist_files(tmp_path)


def test_gz_files_alone_are_checked_and_decompressed_for_torchvision(tmp_path):
    raw = _tiny_mnist(tmp_path, count=7, compress=True)
    assert len(load_mnist(tmp_path, train=False)) == 7  # torchvision reads only the decompressed files
    assert all((raw / name).is_file() for name in MNIST_RAW_FILES)
    (raw / "train-images-idx3-ubyte").unlink()
    gz = raw / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:40])  # cut short: its trailer is gone
    with pytest.raises(DataDamagedError, match=re.escape(f"{gz}: ")):
        load_mnist(tmp_path, train=True)
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(DataDamagedError, match=re.escape(f"{gz}: not a readable gzip file")):
        load_mnist(tmp_path, train=True)

"""helpers.data: offline MNIST through torchvision, and the missing-data error."""

from __future__ import annotations

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

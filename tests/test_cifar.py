"""helpers.cifar (lesson 09): where CIFAR-10 comes from, its preprocessing, the Dataset and the ViT."""

from __future__ import annotations

import hashlib
import http.server
import io
import pickle
import re
import shutil
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchvision import datasets

from helpers import cifar
from helpers.cifar import (
    CROP_PADDING,
    MEAN,
    STD,
    CifarParquet,
    augment_batch,
    augmented_collate,
    cifar10_parquet_root,
    cifar10_to_parquet,
    download_cifar10,
    normalize_batch,
    read_split,
    vit_cifar10,
)
from helpers.config import load_config
from helpers.data import DataDamagedError, DataNotFoundError
from tests.support import FAILS_FAST_S

DATA_DIR = load_config().data_dir


def _crops(image: np.ndarray) -> list[np.ndarray]:
    """Every crop `augment_batch` can make of one (3, 32, 32) image: 81 positions, flipped or not."""
    pad = CROP_PADDING
    padded = np.pad(image, ((0, 0), (pad, pad), (pad, pad)))
    windows = [padded[:, dy:dy + 32, dx:dx + 32] for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)]
    return windows + [window[..., ::-1] for window in windows]


def test_the_offline_subset_is_found_in_the_data_dir_and_read_with_its_schema():
    root = cifar10_parquet_root(DATA_DIR)
    assert root == str(DATA_DIR / "cifar10-parquet")
    test = read_split(root, "test")
    assert test["image"].shape == (2000, 32, 32, 3) and test["image"].dtype == np.uint8
    assert np.bincount(test["label"]).tolist() == [200] * 10
    first = read_split(root, "train", max_rows=7)
    assert first["image"].shape == (7, 32, 32, 3) and first["label"].dtype == np.int64


def test_no_local_copy_and_no_bucket_is_a_clear_error_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar, "can_reach", lambda url, timeout=3.0: False)  # offline, whatever this machine is
    started = time.monotonic()
    with pytest.raises(DataNotFoundError) as error:
        cifar10_parquet_root(tmp_path)
    assert time.monotonic() - started < FAILS_FAST_S
    message = str(error.value)
    assert str(tmp_path / "cifar10-parquet") in message and "COURSE_DATA_DIR" in message
    assert "python -m helpers.cifar download" in message


def test_online_without_a_local_copy_reads_rays_public_bucket(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(cifar, "can_reach", lambda url, timeout=3.0: asked.append(url) or True)
    (tmp_path / "cifar10-parquet" / "train").mkdir(parents=True)  # half a copy does not count
    assert cifar10_parquet_root(tmp_path) == "s3://anonymous@ray-example-data/cifar10-parquet"
    assert asked and "s3" in asked[0]


def _local_copy(tmp_path: Path) -> Path:
    """A writable copy of the offline subset's test file, as both splits of `<tmp_path>/cifar10-parquet`."""
    local = tmp_path / "cifar10-parquet"
    for split in ("train", "test"):
        (local / split).mkdir(parents=True)
        shutil.copyfile(DATA_DIR / "cifar10-parquet" / "test" / "test-00000.parquet", local / split / "part-0.parquet")
    return local


@pytest.mark.parametrize("damage, expected", [
    (lambda data: data[:len(data) // 2], "not readable as Parquet"),
    (lambda data: b"garbage " * 100, "not readable as Parquet"),
], ids=["truncated", "garbage"])
def test_a_damaged_cifar_parquet_file_is_named_with_the_fix(tmp_path, damage, expected):
    local = _local_copy(tmp_path)
    assert cifar10_parquet_root(tmp_path) == str(local)  # whole: found as before
    damaged = local / "train" / "part-0.parquet"
    damaged.write_bytes(damage(damaged.read_bytes()))
    started = time.monotonic()
    with pytest.raises(DataDamagedError) as error:
        cifar10_parquet_root(tmp_path)
    assert time.monotonic() - started < FAILS_FAST_S
    message = str(error.value)
    assert f"{damaged}: {expected}" in message
    assert f"replace the damaged file(s) with good ones (the layout of {cifar.CIFAR10_BUCKET}), or remove {local}" \
        in message
    with pytest.raises(DataDamagedError, match=re.escape(str(damaged))):  # read directly: the same message
        read_split(str(local), "train")


def test_a_cifar_parquet_file_without_the_columns_or_a_split_without_files_is_named(tmp_path):
    local = _local_copy(tmp_path)
    pq.write_table(pq.read_table(local / "test" / "part-0.parquet").rename_columns(["pixels", "label"]),
                   local / "test" / "part-0.parquet")
    (local / "train" / "part-0.parquet").unlink()
    with pytest.raises(DataDamagedError) as error:
        cifar10_parquet_root(tmp_path)
    assert f"{local / 'test' / 'part-0.parquet'}: no column image (its columns: pixels, label)" in str(error.value)
    assert f"{local / 'train'}: no .parquet file" in str(error.value)


def test_a_damaged_downloaded_copy_is_named_with_the_folder_to_delete(tmp_path):
    copy = tmp_path / "cifar10-parquet" / "20250101T000000.000000Z-0123abcd"  # as `download_cifar10` writes one
    shutil.move(_local_copy(tmp_path / "source"), copy)
    (copy / "_COMPLETE.json").write_text('{"rows": {"train": 2000, "test": 2000}}')
    (copy / "test" / "part-0.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataDamagedError, match=re.escape(f"To fix it: delete the folder {copy}: online, `python -m "
                                                         "helpers.cifar download` writes a new copy")):
        cifar10_parquet_root(tmp_path)


def test_normalize_standardises_each_channel_and_puts_channels_first():
    pixels = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    pixels[1] = 255
    images = normalize_batch({"image": pixels})["image"]
    assert images.shape == (2, 3, 32, 32) and images.dtype == np.float32 and images.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(images[0, :, 0, 0], -MEAN / STD, rtol=1e-6)
    np.testing.assert_allclose(images[1, :, 5, 7], (1 - MEAN) / STD, rtol=1e-6)


def test_augment_crops_and_flips_each_image_and_draws_anew_every_call():
    images = normalize_batch(read_split(cifar10_parquet_root(DATA_DIR), "test", max_rows=32))["image"]
    first = augment_batch({"image": images.copy()})["image"]
    assert first.shape == images.shape and first.dtype == np.float32
    for original, augmented in zip(images, first):
        assert any(np.array_equal(augmented, crop) for crop in _crops(original))
    second = augment_batch({"image": images.copy()})["image"]
    assert not np.array_equal(first, second), "two epochs drew the same crops for 32 images"
    unchanged = sum(np.array_equal(a, o) for a, o in zip(first, images))
    assert unchanged < 8, "most images came out uncropped and unflipped"


def test_the_dataset_and_collate_give_the_loader_augmented_float_batches():
    dataset = CifarParquet(cifar10_parquet_root(DATA_DIR), "test", max_rows=10)
    assert len(dataset) == 10
    image, label = dataset[3]
    assert image.shape == (3, 32, 32) and isinstance(label, int)
    images, labels = augmented_collate([dataset[i] for i in range(4)])
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
    assert labels.tolist() == [dataset[i][1] for i in range(4)] and labels.dtype == torch.int64


def test_full_mode_builds_the_seeds_vit_and_smoke_mode_a_small_one():
    seed_vit, small = vit_cifar10(smoke_test=False), vit_cifar10(smoke_test=True)
    assert (len(seed_vit.encoder.layers), seed_vit.hidden_dim, seed_vit.patch_size) == (12, 384, 4)
    assert seed_vit.encoder.layers[0].self_attention.num_heads == 8
    assert seed_vit.encoder.layers[0].mlp[0].out_features == 768
    assert len(small.encoder.layers) == 2
    assert small(torch.zeros(3, 3, 32, 32)).shape == (3, 10)


def test_written_parquet_has_the_buckets_schema(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(12) % 10
    cifar10_to_parquet(images, labels, str(tmp_path / "train"), num_files=3)
    assert len(list((tmp_path / "train").glob("*.parquet"))) == 3
    shared = pq.read_schema(next((DATA_DIR / "cifar10-parquet" / "train").glob("*.parquet")))
    written = pq.read_schema(next((tmp_path / "train").glob("*.parquet")))
    assert written.field("image").type.extension_name == shared.field("image").type.extension_name
    assert written.field("label").type == shared.field("label").type
    back = read_split(str(tmp_path), "train")
    assert np.array_equal(back["image"], images) and back["label"].tolist() == labels.tolist()


@pytest.fixture
def cifar_mirror(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving a small CIFAR-10 archive in torchvision's format (10 + 5 images)."""
    rng = np.random.default_rng(1)

    def batch(n: int) -> bytes:
        return pickle.dumps({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(range(n))})

    members = {"data_batch_1": batch(10), "test_batch": batch(5),
               "batches.meta": pickle.dumps({"label_names": list(cifar.CLASSES)})}
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    served = tmp_path / "mirror"
    served.mkdir()
    (served / "cifar-10-python.tar.gz").write_bytes(archive.getvalue())

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    md5 = {name: hashlib.md5(data).hexdigest() for name, data in members.items()}
    monkeypatch.setattr(datasets.CIFAR10, "url", f"http://127.0.0.1:{server.server_address[1]}/cifar-10-python.tar.gz")
    monkeypatch.setattr(datasets.CIFAR10, "tgz_md5", hashlib.md5(archive.getvalue()).hexdigest())
    monkeypatch.setattr(datasets.CIFAR10, "train_list", [["data_batch_1", md5["data_batch_1"]]])
    monkeypatch.setattr(datasets.CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(datasets.CIFAR10, "meta", {**datasets.CIFAR10.meta, "md5": md5["batches.meta"]})
    yield members
    server.shutdown()


def test_download_writes_torchvisions_cifar10_as_parquet_the_lesson_then_reads(cifar_mirror, tmp_path):
    data_dir = tmp_path / "data"
    root = download_cifar10(data_dir)
    assert cifar10_parquet_root(data_dir) == root and Path(root).parent == data_dir / "cifar10-parquet"
    assert download_cifar10(data_dir) == root and len(list((data_dir / "cifar10-parquet").iterdir())) == 1
    train, test = read_split(root, "train"), read_split(root, "test")
    assert (len(train["label"]), len(test["label"])) == (10, 5)
    source = pickle.loads(cifar_mirror["data_batch_1"])["data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    assert np.array_equal(train["image"], source) and train["label"].tolist() == list(range(10))


def test_download_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.CIFAR10, "url", "http://127.0.0.1:9/cifar-10-python.tar.gz")  # nothing listens
    with pytest.raises(DataNotFoundError, match="cannot be downloaded"):
        download_cifar10(tmp_path)


def test_ray_datas_tasks_import_the_preprocessing_without_torch():
    # Ray Data's task processes import helpers.cifar for normalize_batch and augment_batch: with torch and torchvision
    # each new process took about 3 s more, and the first pass over the augmented images ran 7x slower (2 cores).
    import subprocess
    import sys

    code = ("import sys, helpers.cifar; "
            "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'torchvision'}))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"

"""CIFAR-10 for the capstone (lesson 09): one Parquet source for every step, its preprocessing, and the ViT.

The Parquet layout is that of Ray's public bucket (`s3://ray-example-data/cifar10-parquet/{train,test}`):
column `image`, a uint8 tensor of shape (32, 32, 3); column `label`, int64. Ray Data reads it with
`read_parquet`; the DataLoader steps read the same files through `CifarParquet`, a map-style `Dataset`.

Importing this module imports no torch: Ray Data's task processes import it to run `normalize_batch` and
`augment_batch`, and torch with torchvision cost each new process about 3 s. Measured on 2 cores, a pipeline's
first pass over the augmented training images ran at about 3,100 images/s with those imports, 21,000 without.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from helpers import storage
from helpers.data import DataDamagedError, DataNotFoundError, can_reach
from helpers.sizes import SIZES

if TYPE_CHECKING:
    import torch
    from torchvision.models import VisionTransformer

#: Ray's public copy of CIFAR-10 as Parquet (50,000 / 10,000 rows), read without credentials.
CIFAR10_BUCKET = "s3://anonymous@ray-example-data/cifar10-parquet"
#: Where a `COURSE_DATA_DIR` holds its own copy: the offline subset (`train/`, `test/`), or `download_cifar10`'s
#: full dataset (in a copy folder of its own there: see `write_cifar10_parquet`).
LOCAL_FOLDER = "cifar10-parquet"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: Per-channel mean and standard deviation of CIFAR-10's training images (RGB, in [0, 1]).
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)
#: Rows per split in smoke mode (COURSE_SMOKE_TEST=1): 4 steps of 128 images, 256 to test.
SMOKE_ROWS = SIZES["smoke"]["cifar_rows"]
#: The tutorial's ViT (full mode), and a small one with the same structure for smoke runs.
VIT_SIZES = {mode: sizes["vit"] for mode, sizes in SIZES.items()}
#: Zero padding of the random crop, in pixels on each side.
CROP_PADDING = 4


def cifar10_parquet_root(data_dir: str | Path) -> str:
    """The folder or bucket holding `train/` and `test/`: `<data_dir>/cifar10-parquet` when there, else the earliest
    complete copy that `download_cifar10` wrote in it, else Ray's bucket.

    Raises DataNotFoundError within seconds when none is there, instead of a read that hangs offline, and
    DataDamagedError when a local file is not Parquet with the columns `image` and `label` (`check_cifar10_parquet`).
    """
    local = Path(data_dir) / LOCAL_FOLDER
    if all((local / split).is_dir() for split in ("train", "test")):
        check_cifar10_parquet(str(local))
        return str(local)
    if copies := storage.complete_copies(str(local)):
        check_cifar10_parquet(copies[0])
        return copies[0]
    if can_reach("https://s3.us-west-2.amazonaws.com"):
        return CIFAR10_BUCKET
    raise DataNotFoundError(
        f"CIFAR-10 is not in {local} (train/ and test/ folders of Parquet files), and Ray's public bucket "
        f"({CIFAR10_BUCKET}) is not reachable from here.\n"
        "Do one of these:\n"
        "  - go online: the lesson then reads the bucket directly;\n"
        "  - or, online once, run `python -m helpers.cifar download` to write the full dataset there;\n"
        f"  - or point COURSE_DATA_DIR (in your environment or .env) at a folder holding {LOCAL_FOLDER}/train "
        f"and {LOCAL_FOLDER}/test; on a cluster, on a mount every node shares."
    )


def check_cifar10_parquet(root: str) -> None:
    """Raise DataDamagedError, naming each file and the fix, unless `root`'s train/ and test/ hold Parquet files with
    the columns `image` and `label`. Reads each file's footer only."""
    problems = []
    for split in ("train", "test"):
        folder = storage.join(root, split)
        try:
            problems += storage.parquet_problems(folder, columns=("image", "label"))
            if not any(entry.base_name.endswith(".parquet") for entry in storage.list_dir(folder)):
                problems.append(f"{folder}: no .parquet file")
        except FileNotFoundError:
            problems.append(f"{folder}: no such folder")
    if not problems:
        return
    if storage.read_marker(root) is not None:  # a copy `download_cifar10` wrote
        fix = (f"delete the folder {root}: online, `python -m helpers.cifar download` writes a new copy, and the "
               "course reads Ray's public bucket until then.")
    else:
        fix = (f"replace the damaged file(s) with good ones (the layout of {CIFAR10_BUCKET}), or remove {root}: "
               "online, the course then reads Ray's public bucket, and `python -m helpers.cifar download` writes the "
               "full dataset under COURSE_DATA_DIR.")
    raise DataDamagedError("CIFAR-10's Parquet files cannot be read:\n" +
                           "\n".join(f"  - {problem}" for problem in problems) + f"\nTo fix it: {fix}")


def read_split(root: str, split: str, max_rows: int | None = None) -> dict[str, np.ndarray]:
    """A split's first `max_rows` rows (all by default) as NumPy: uint8 images (N, 32, 32, 3), int64 labels."""
    filesystem, path = storage.resolve(storage.join(root, split))
    try:
        table = pq.read_table(path, filesystem=filesystem, columns=["image", "label"])
    except (OSError, ValueError):  # pyarrow's errors: for a folder of ours, name the damaged file and the fix
        if not storage.is_uri(root):
            check_cifar10_parquet(root)
        raise
    table = table if max_rows is None else table.slice(0, max_rows)
    images = table.column("image").combine_chunks()
    if isinstance(images.type, pa.ExtensionType):  # Ray Data's tensor type: a list of pixels per row
        images = images.storage
    pixels = images.flatten().to_numpy(zero_copy_only=False)
    return {"image": pixels.reshape(len(table), 32, 32, 3), "label": table.column("label").to_numpy()}


def normalize_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """uint8 (N, 32, 32, 3) -> float32 (N, 3, 32, 32), each channel standardised with CIFAR-10's mean and std."""
    images = (batch["image"].astype(np.float32) / 255.0 - MEAN) / STD
    batch["image"] = np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    return batch


def augment_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A random crop (from the image padded by 4 pixels of zeros) and a random horizontal flip, per image.

    Vectorised over the batch, for Ray Data's `map_batches` and the DataLoader's `collate_fn` alike. Not seeded:
    every epoch draws new crops. Zero padding is the mean colour, since the images are standardised.
    """
    images = batch["image"]  # float32 (N, 3, 32, 32)
    n, size = len(images), images.shape[-1]
    rng = np.random.default_rng()
    pad = CROP_PADDING
    padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    rows = rng.integers(0, 2 * pad + 1, n)[:, None] + np.arange(size)  # (N, 32): each image's crop window
    cols = rng.integers(0, 2 * pad + 1, n)[:, None] + np.arange(size)
    cropped = padded[np.arange(n)[:, None, None, None], np.arange(images.shape[1])[None, :, None, None],
                     rows[:, None, :, None], cols[:, None, None, :]]
    flip = rng.random(n) < 0.5
    cropped[flip] = cropped[flip][..., ::-1]
    batch["image"] = cropped
    return batch


class CifarParquet:
    """CIFAR-10 from the Parquet files, for a PyTorch DataLoader: the same source Ray Data reads, normalised once."""

    def __init__(self, root: str, split: str, max_rows: int | None = None):
        self.split = normalize_batch(read_split(root, split, max_rows))

    def __len__(self) -> int:
        return len(self.split["label"])

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.split["image"][index], int(self.split["label"][index])


def augmented_collate(rows: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A DataLoader `collate_fn`: stack the rows, apply `augment_batch`, return (images, labels) tensors."""
    import torch

    batch = augment_batch({"image": np.stack([image for image, _ in rows])})
    return torch.from_numpy(batch["image"]), torch.tensor([label for _, label in rows], dtype=torch.int64)


def vit_cifar10(smoke_test: bool = False) -> VisionTransformer:
    """torchvision's ViT for 32x32 images in 4x4 patches (64 tokens and a class token), 10 classes.

    Full mode is the tutorial's model: 12 layers, 8 heads, width 384, MLP 768. Smoke mode: 2 layers, width 64.
    """
    from torchvision.models import VisionTransformer  # here: Ray Data's tasks import this module without torch

    return VisionTransformer(image_size=32, patch_size=4, num_classes=10,
                             **VIT_SIZES["smoke" if smoke_test else "full"])


def cifar10_to_parquet(images: np.ndarray, labels: np.ndarray, target: str, num_files: int = 1) -> None:
    """Write uint8 images (N, 32, 32, 3) and their labels as Parquet files in `target`, in the bucket's schema."""
    from ray.data.extensions import ArrowTensorArray

    storage.makedirs(target)
    filesystem, path = storage.resolve(target)
    for index, part in enumerate(np.array_split(np.arange(len(labels)), num_files)):
        table = pa.table({"image": ArrowTensorArray.from_numpy(images[part]),
                          "label": np.asarray(labels)[part].astype(np.int64)})
        pq.write_table(table, f"{path}/part-{index:05d}.parquet", filesystem=filesystem)


def write_cifar10_parquet(data_dir: str | Path, load: Callable[[bool], tuple[np.ndarray, np.ndarray]]) -> str:
    """Write the images and labels `load(train)` returns for each split as Parquet under `<data_dir>/cifar10-parquet`,
    once; return the folder that holds `train/` and `test/`.

    The folder is a copy made with `storage.write_once`: processes that write it at the same time each get a complete
    copy, and none writes over one another reads. A copy interrupted half-way is ignored (and left as it is).
    """
    def write(copy: str) -> dict:
        rows = {}
        for split, train in (("train", True), ("test", False)):
            images, labels = load(train)
            cifar10_to_parquet(images, labels, storage.join(copy, split), num_files=5 if train else 1)
            rows[split] = len(labels)
        return {"rows": rows}

    return storage.write_once(str(Path(data_dir) / LOCAL_FOLDER), write)


def download_cifar10(data_dir: str | Path) -> str:
    """Download the full CIFAR-10 with torchvision (about 170 MB) and write it as Parquet under `data_dir`.

    For online users who want all 50,000 training images on their own disk; returns the Parquet folder. Processes
    on one node download one archive (the first takes a file lock in `data_dir`), and share the Parquet copy.
    """
    from torchvision import datasets

    data_dir = Path(data_dir)
    if not can_reach(datasets.CIFAR10.url):
        raise DataNotFoundError(f"{datasets.CIFAR10.url} is not reachable from here: CIFAR-10 cannot be downloaded.")

    def load(train: bool) -> tuple[np.ndarray, np.ndarray]:
        data_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(data_dir / ".cifar10-download.lock"):  # torchvision writes its archive in place: one at a time
            cifar = datasets.CIFAR10(root=str(data_dir), train=train, download=True)
        return cifar.data, np.array(cifar.targets)

    return write_cifar10_parquet(data_dir, load)


if __name__ == "__main__":
    import sys

    from helpers.config import load_config

    if sys.argv[1:] != ["download"]:
        sys.exit("usage: python -m helpers.cifar download   (writes CIFAR-10 as Parquet under COURSE_DATA_DIR)")
    print(download_cifar10(load_config().data_dir))

"""Locating and loading the course datasets: offline copies first, real downloads otherwise."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from torchvision import datasets, transforms

#: The four IDX files torchvision's MNIST looks for under `<data_dir>/MNIST/raw/`.
MNIST_RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class DataNotFoundError(FileNotFoundError):
    """A dataset is neither on disk nor downloadable from here."""


def mnist_transform() -> transforms.Compose:
    """The seed's preprocessing: a [0, 1] tensor, then normalised to [-1, 1]."""
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])


def mnist_is_present(data_dir: str | Path) -> bool:
    """True when all four raw MNIST files are under `data_dir/MNIST/raw`."""
    raw = Path(data_dir) / "MNIST" / "raw"
    return all((raw / name).is_file() or (raw / f"{name}.gz").is_file() for name in MNIST_RAW_FILES)


def can_reach(url: str, timeout: float = 3.0) -> bool:
    """True when a TCP connection to `url`'s host opens within `timeout` seconds."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def load_mnist(data_dir: str | Path, train: bool = True, transform=None) -> datasets.MNIST:
    """MNIST through torchvision's own loader: from `data_dir` when present, else downloaded.

    Raises DataNotFoundError within seconds when the files are missing and no mirror answers,
    instead of letting a download hang on a machine without internet.
    """
    data_dir = Path(data_dir)
    transform = mnist_transform() if transform is None else transform
    if not mnist_is_present(data_dir):
        if not any(can_reach(mirror) for mirror in datasets.MNIST.mirrors):
            raise DataNotFoundError(
                f"MNIST is not in {data_dir / 'MNIST' / 'raw'} and no download mirror is reachable "
                f"({', '.join(datasets.MNIST.mirrors)}).\n"
                "Do one of these:\n"
                "  - go online and re-run this cell: torchvision downloads MNIST (about 12 MB) there;\n"
                "  - or point COURSE_DATA_DIR (in your environment or .env) at a folder holding "
                f"MNIST/raw/{{{','.join(MNIST_RAW_FILES)}}}."
            )
        data_dir.mkdir(parents=True, exist_ok=True)
    return datasets.MNIST(root=str(data_dir), train=train, download=True, transform=transform)

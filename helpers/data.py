"""Locating and loading the course datasets: offline copies first, real downloads otherwise.

The rule on a cluster: every process that loads MNIST (the driver, and in lesson 02 each Ray Train worker)
reads it from `COURSE_DATA_DIR` on its own node. Put that folder on a mount every node shares, or let each
node download its own copy there: the first process on a node downloads under a file lock, the others wait
and reuse it. From lesson 03 on, only the driver reads MNIST: the workers read the Parquet copy under the
storage path.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from filelock import FileLock

if TYPE_CHECKING:  # torchvision is imported where MNIST is loaded: helpers.cifar imports this module without torch
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
    """MNIST's preprocessing in every lesson: a [0, 1] tensor, then normalised to [-1, 1]."""
    from torchvision import transforms

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


def _this_node() -> str:
    """This machine's name, and its Ray node's id when Ray runs: for error messages."""
    import ray

    if ray.is_initialized():
        return f"node {ray.get_runtime_context().get_node_id()[:8]} ({socket.gethostname()})"
    return f"this machine ({socket.gethostname()})"


def _missing_data_error(data_dir: Path, why: str) -> DataNotFoundError:
    return DataNotFoundError(
        f"MNIST is not in {data_dir / 'MNIST' / 'raw'} on {_this_node()}, and {why}.\n"
        "Do one of these:\n"
        "  - go online and re-run: torchvision downloads MNIST (about 12 MB) there, once per node;\n"
        "  - or point COURSE_DATA_DIR (in your environment or .env) at a folder holding "
        f"MNIST/raw/{{{','.join(MNIST_RAW_FILES)}}}; on a cluster, on a mount every node shares."
    )


def load_mnist(data_dir: str | Path, train: bool = True, transform=None) -> datasets.MNIST:
    """MNIST through torchvision's own loader: from `data_dir` on this node when present, else downloaded there.

    Processes on one node download one copy: the first takes a file lock in `data_dir`, the others wait
    for it and then find the files. Raises DataNotFoundError within seconds when the files are missing
    and no mirror answers (or `data_dir` cannot be created on this node), instead of a hanging download.
    """
    from torchvision import datasets

    data_dir = Path(data_dir)
    transform = mnist_transform() if transform is None else transform
    if not mnist_is_present(data_dir):
        if not any(can_reach(mirror) for mirror in datasets.MNIST.mirrors):
            raise _missing_data_error(data_dir, f"no download mirror is reachable ({', '.join(datasets.MNIST.mirrors)})")
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise _missing_data_error(data_dir, f"the folder cannot be created there ({error.strerror})") from None
        with FileLock(data_dir / ".mnist-download.lock"):
            if not mnist_is_present(data_dir):  # another process on this node may have downloaded it meanwhile
                datasets.MNIST(root=str(data_dir), train=train, download=True)
    return datasets.MNIST(root=str(data_dir), train=train, download=False, transform=transform)

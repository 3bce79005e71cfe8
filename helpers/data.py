"""Locating and loading the course datasets: offline copies first, real downloads otherwise.

The rule on a cluster: every process that loads MNIST (the driver, and in lesson 02 each Ray Train worker)
reads it from `COURSE_DATA_DIR` on its own node. Put that folder on a mount every node shares, or let each
node download its own copy there: the first process on a node downloads under a file lock, the others wait
and reuse it. From lesson 03 on, only the driver reads MNIST: the workers read the Parquet copy under the
storage path.
"""

from __future__ import annotations

import gzip
import math
import os
import shutil
import socket
import zlib
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from filelock import FileLock

from helpers import storage
from helpers.config import load_config

if TYPE_CHECKING:  # torchvision is imported where MNIST is loaded: helpers.cifar imports this module without torch
    from torchvision import datasets, transforms

#: The four IDX files torchvision's MNIST looks for under `<data_dir>/MNIST/raw/`.
MNIST_RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


#: What each raw MNIST file holds after its IDX header: the dimensions after the record count.
MNIST_RECORD_SHAPES = {"images": (28, 28), "labels": ()}
#: The first bytes of an IDX file of unsigned bytes: two zero bytes, then 0x08 (uint8); the fourth is the rank.
IDX_UINT8 = b"\x00\x00\x08"


class DataNotFoundError(FileNotFoundError):
    """A dataset is neither on disk nor downloadable from here."""


class DataDamagedError(DataNotFoundError):
    """A dataset's file is on disk but damaged (cut short, or not in its format): the message names it and the fix."""


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


def _idx_problem(header: bytes, size: int, name: str) -> tuple[str | None, int]:
    """What is wrong with an MNIST IDX file of `size` bytes starting with `header` (None: nothing), and its count."""
    shape = MNIST_RECORD_SHAPES[name.split("-")[1]]
    rank = 1 + len(shape)
    header_bytes = 4 + 4 * rank
    if len(header) < header_bytes:
        return f"{size:,} bytes, too short for its {header_bytes}-byte header", 0
    if header[:4] != IDX_UINT8 + bytes([rank]):
        return (f"not an IDX file of {rank}-dimensional uint8 data (it starts with {header[:4].hex(' ')}, expected "
                f"{(IDX_UINT8 + bytes([rank])).hex(' ')})"), 0
    dims = tuple(int.from_bytes(header[4 + 4 * i:8 + 4 * i], "big") for i in range(rank))
    if dims[1:] != shape:
        return f"records of shape {dims[1:]}, expected {shape}", 0
    expected = header_bytes + dims[0] * math.prod(shape)
    if size != expected:
        what = f"{dims[0]:,} images of 28x28 bytes" if shape else f"{dims[0]:,} labels of one byte"
        return f"{size:,} bytes, expected {expected:,} (a {header_bytes}-byte header and {what})", dims[0]
    return None, dims[0]


def _mnist_file_problem(raw: Path, name: str) -> tuple[str, str | None, int]:
    """The file torchvision would use for `name` (itself, or its .gz to extract), what is wrong with it, its count."""
    path = raw / name
    if path.is_file():
        with open(path, "rb") as file:
            return name, *_idx_problem(file.read(16), path.stat().st_size, name)
    gz = raw / f"{name}.gz"
    try:
        with open(gz, "rb") as file:
            file.seek(-4, os.SEEK_END)  # gzip's trailer: the uncompressed size, modulo 2**32 (MNIST's are smaller)
            size = int.from_bytes(file.read(4), "little")
        with gzip.open(gz) as file:
            header = file.read(16)
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        return gz.name, f"not a readable gzip file ({error})", 0
    problem, count = _idx_problem(header, size, name)
    return gz.name, None if problem is None else f"uncompressed, {problem}", count


def check_mnist_files(data_dir: str | Path) -> None:
    """Raise DataDamagedError, naming each file and how to replace it, unless the four raw MNIST files are whole.

    Reads each file's IDX header (a .gz file's too, and its size from the gzip trailer): the file's size must be the
    header plus count x record size, and each split's image and label counts must match. Cheap: no pixel is read.
    """
    raw = Path(data_dir) / "MNIST" / "raw"
    problems, counts = [], {}
    for name in MNIST_RAW_FILES:
        file, problem, counts[name] = _mnist_file_problem(raw, name)
        if problem is not None:
            problems.append(f"  - {raw / file}: {problem}")
    for split in ("train", "t10k"):
        images, labels = counts[f"{split}-images-idx3-ubyte"], counts[f"{split}-labels-idx1-ubyte"]
        if not problems and images != labels:
            problems.append(f"  - {raw}/{split}-*: {images:,} images but {labels:,} labels")
    if problems:
        raise DataDamagedError(
            f"MNIST in {raw} on {_this_node()} is damaged: torchvision cannot read it.\n" + "\n".join(problems) +
            "\nTo fix it, do one of these:\n"
            "  - delete the damaged file(s) and re-run online: torchvision downloads MNIST (about 12 MB) there again;\n"
            f"  - or copy the four files {', '.join(MNIST_RAW_FILES)} from a good copy into {raw} "
            "(COURSE_DATA_DIR/MNIST/raw).")


def _extract_gz_files(data_dir: Path) -> None:
    """Decompress each raw MNIST file present only as .gz, as torchvision's download does: it reads only the others."""
    raw = data_dir / "MNIST" / "raw"
    missing = [name for name in MNIST_RAW_FILES if not (raw / name).is_file()]
    if not missing:  # as in a read-only data dir: no lock to take
        return
    partial = raw / f".mnist.{os.getpid()}.partial"
    try:
        with FileLock(data_dir / ".mnist-download.lock"):  # one process per node decompresses, the others wait
            for name in missing:
                if not (raw / name).is_file():
                    with gzip.open(raw / f"{name}.gz") as source, open(partial, "wb") as target:
                        shutil.copyfileobj(source, target)
                    partial.replace(raw / name)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise DataNotFoundError(
            f"{raw} holds {', '.join(f'{name}.gz' for name in missing)} but not the decompressed file(s), which "
            f"torchvision reads, and they cannot be decompressed there ({error.strerror or error}). To fix it: "
            f"decompress them yourself (`gunzip -k {raw}/*.gz`), or point COURSE_DATA_DIR at a folder you can "
            "write.") from None


def check_parquet_copy(copy: str, dataset: str) -> None:
    """Raise DataDamagedError, naming the copy folder and saying to delete it, when a Parquet file in `copy` (a copy
    that `storage.write_once` published) is damaged; `dataset` names its data ("MNIST as Parquet")."""
    if problems := storage.parquet_problems(copy):
        raise DataDamagedError(
            f"The copy of {dataset} in {copy} is damaged since it was written:\n" +
            "\n".join(f"  - {problem}" for problem in problems) +
            f"\nTo fix it: delete the folder {copy} once no run reads it (`python -c \"from helpers import storage; "
            f"storage.delete_dir('{copy}')\"`, for s3:// too); the next run writes a new copy.")


def load_mnist(data_dir: str | Path, train: bool = True, transform=None,
               download: bool | None = None) -> datasets.MNIST:
    """MNIST through torchvision's own loader: from `data_dir` on this node when present, else downloaded there.

    Processes on one node download one copy: the first takes a file lock in `data_dir`, the others wait
    for it and then find the files. Raises DataNotFoundError within seconds when the files are missing
    and no mirror answers (or `data_dir` cannot be created on this node), instead of a hanging download,
    and DataDamagedError when a file is there but cut short or not MNIST's (`check_mnist_files`).
    `download` (default: COURSE_DATA_DOWNLOAD) False: missing files raise DataNotFoundError at once, no download.
    """
    from torchvision import datasets

    data_dir = Path(data_dir)
    transform = mnist_transform() if transform is None else transform
    if not mnist_is_present(data_dir):
        if not (load_config().data_download if download is None else download):
            raise DataNotFoundError(
                f"MNIST is not in {data_dir / 'MNIST' / 'raw'} on {_this_node()}, and downloads are off here "
                "(COURSE_DATA_DOWNLOAD=0): nothing fills this folder at training time.\nDo one of these:\n"
                "  - fill it first, once: on Kubernetes, run the data Job (kubectl apply -f deploy/kuberay/data-job.yaml)"
                ", or copy the four files "
                f"{', '.join(MNIST_RAW_FILES)} into it;\n"
                "  - or let each node download its own copy: set COURSE_DATA_DOWNLOAD=1 (it needs the internet).")
        if not any(can_reach(mirror) for mirror in datasets.MNIST.mirrors):
            raise _missing_data_error(data_dir, f"no download mirror is reachable ({', '.join(datasets.MNIST.mirrors)})")
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise _missing_data_error(data_dir, f"the folder cannot be created there ({error.strerror})") from None
        with FileLock(data_dir / ".mnist-download.lock"):
            if not mnist_is_present(data_dir):  # another process on this node may have downloaded it meanwhile
                datasets.MNIST(root=str(data_dir), train=train, download=True)
    check_mnist_files(data_dir)
    _extract_gz_files(data_dir)  # a file present only as .gz (and whole)
    return datasets.MNIST(root=str(data_dir), train=train, download=False, transform=transform)


def fill_mnist(data_dir: str | Path | None = None) -> Path:
    """Download MNIST into `data_dir` (default: COURSE_DATA_DIR) unless it is there and whole; return its raw folder.

    Lesson 08's data Job runs it once, so that no training pod downloads: `python -c "from helpers.data import
    fill_mnist; fill_mnist()"`. It downloads what is missing, whatever COURSE_DATA_DOWNLOAD says, and
    prints one line.
    """
    data_dir = Path(load_config().data_dir if data_dir is None else data_dir)
    present = mnist_is_present(data_dir)
    for train in (True, False):
        load_mnist(data_dir, train=train, download=True)
    raw = data_dir / "MNIST" / "raw"
    print(f"MNIST {'was already' if present else 'is now'} in {raw}, whole: "
          f"{', '.join(sorted(p.name for p in raw.iterdir() if p.name in MNIST_RAW_FILES))}", flush=True)
    return raw

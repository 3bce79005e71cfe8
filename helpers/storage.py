"""Files under the storage path, local or remote: every read and write goes through `pyarrow.fs`.

`COURSE_STORAGE_PATH` may be a local folder, an NFS mount every node sees, or a URI such as
`s3://bucket/course` or `gs://bucket/course`. Ray Train reaches it through `pyarrow.fs`; the course's
own files there (run folders, summaries, the metrics history, the Parquet copy of MNIST) go through the
same layer, so an `s3://` path never turns into a local folder named `s3:`.

Datasets that several runs may prepare at the same time (MNIST as Parquet, lesson 10's synthetic images, the
CIFAR-10 download) go through `write_once`: each writer writes a copy in a folder of its own, which counts once its
marker is there; no writer writes over or deletes a folder that another run may be reading.

Paths are plain strings: absolute local paths, or URIs. Credentials for a bucket come from where
pyarrow (and Ray Train) look for them: the environment (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, ...),
the machine's instance role, or `~/.aws`. Every node that trains needs them.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import posixpath
import re
import secrets
from collections.abc import Callable, Collection
from typing import Any

import pyarrow.fs as pafs

#: "scheme://..." : a URI (s3://, gs://, file://, ...), as opposed to a local path.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: str) -> bool:
    """True for a URI such as `s3://bucket/prefix`, False for a local path."""
    return bool(_URI.match(str(path)))


def join(base: str, *parts: str) -> str:
    """`base/part/...` for a local path or a URI (URIs always join with `/`)."""
    base = str(base)
    if is_uri(base):
        scheme, rest = base.split("://", 1)
        return f"{scheme}://{posixpath.join(rest, *parts)}"
    return os.path.join(base, *parts)


def basename(path: str) -> str:
    """The last component of a local path or a URI."""
    return posixpath.basename(str(path).rstrip("/"))


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem that holds `path`, and `path` as that filesystem names it (as Ray Train resolves it)."""
    path = str(path)
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def uri(path: str, filesystem: pafs.FileSystem | None) -> str:
    """A `Result.path` or `Checkpoint.path` with its filesystem, as one string that `resolve` takes back.

    Ray Train gives remote paths without their scheme (`bucket/course/run`) next to a `filesystem` object.
    """
    if filesystem is None or isinstance(filesystem, pafs.LocalFileSystem):
        return path
    scheme = {"gcs": "gs"}.get(filesystem.type_name, filesystem.type_name)
    return f"{scheme}://{path}"


def _info(path: str) -> pafs.FileInfo:
    filesystem, fs_path = resolve(path)
    return filesystem.get_file_info(fs_path)


def exists(path: str) -> bool:
    """True when a file or a folder is at `path`."""
    return _info(path).type != pafs.FileType.NotFound


def is_dir(path: str) -> bool:
    """True when `path` is a folder (on object stores: a prefix with objects under it)."""
    return _info(path).type == pafs.FileType.Directory


def is_file(path: str) -> bool:
    """True when `path` is a file (an object)."""
    return _info(path).type == pafs.FileType.File


def makedirs(path: str) -> None:
    """Create the folder `path` and its parents, if missing."""
    filesystem, fs_path = resolve(path)
    filesystem.create_dir(fs_path, recursive=True)


def list_dir(path: str, recursive: bool = False) -> list[pafs.FileInfo]:
    """The entries under the folder `path`, sorted by path (`.base_name`, `.type`, `.size` on each).

    Raises FileNotFoundError when there is no such folder.
    """
    filesystem, fs_path = resolve(path)
    entries = filesystem.get_file_info(pafs.FileSelector(fs_path, recursive=recursive))
    return sorted(entries, key=lambda entry: entry.path)


def size(path: str) -> int:
    """Bytes in the file `path`, or in every file under the folder `path`. FileNotFoundError when neither."""
    info = _info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"No file or folder at {path}")
    if info.type == pafs.FileType.Directory:
        return sum(entry.size for entry in list_dir(path, recursive=True) if entry.type == pafs.FileType.File)
    return info.size or 0


def open_input(path: str):
    """The file `path`, open for reading bytes (a context manager, like `open(path, "rb")`)."""
    filesystem, fs_path = resolve(path)
    return filesystem.open_input_file(fs_path)


def open_output(path: str):
    """The file `path`, open for writing bytes, replacing it (like `open(path, "wb")`); creates its folder."""
    filesystem, fs_path = resolve(path)
    filesystem.create_dir(posixpath.dirname(fs_path), recursive=True)
    return filesystem.open_output_stream(fs_path)


def read_text(path: str) -> str:
    """The text of the file `path`."""
    with open_input(path) as file:
        return file.read().decode()


def write_text(path: str, text: str) -> None:
    """Write `text` to the file `path`, replacing it. Object stores have no append: rewrite the whole file."""
    with open_output(path) as file:
        file.write(text.encode())


def append_line(path: str, line: str) -> None:
    """Add `line` and a newline at the end of the file `path` (a JSONL record), creating it and its folder if need be.

    A local file is appended to. An object store (s3://) has no append: there the whole file is read and written
    again with the line added, so each call costs the file's size, and two writers at once may lose a line."""
    filesystem, fs_path = resolve(path)
    if isinstance(filesystem, pafs.LocalFileSystem):
        filesystem.create_dir(posixpath.dirname(fs_path), recursive=True)
        with filesystem.open_append_stream(fs_path) as file:
            file.write((line + "\n").encode())
        return
    before = read_text(path) if is_file(path) else ""
    write_text(path, before + line + "\n")


def delete_file(path: str) -> None:
    """Delete the file `path`."""
    filesystem, fs_path = resolve(path)
    filesystem.delete_file(fs_path)


def delete_dir(path: str) -> None:
    """Delete the folder `path` and everything under it, if it exists."""
    if exists(path):
        filesystem, fs_path = resolve(path)
        filesystem.delete_dir(fs_path)


#: The 4 bytes that open and close every Parquet file; the footer's length (4 bytes, little-endian) precedes the last.
PARQUET_MAGIC = b"PAR1"


def parquet_problems(folder: str, columns: Collection[str] = ()) -> list[str]:
    """`<file>: <what is wrong>` for each damaged Parquet file under `folder` (recursive), from its end alone.

    Without `columns`: the last 8 bytes, the footer's length and the magic, one small read per file (cut short,
    overwritten or not Parquet at all shows there). With `columns`: the whole footer, whose schema must have them.
    No row is read; a remote folder's files are read 16 at a time. FileNotFoundError when there is no such folder.
    """
    import pyarrow.parquet as pq

    filesystem, _ = resolve(folder)
    files = [entry for entry in list_dir(folder, recursive=True)
             if entry.type == pafs.FileType.File and entry.base_name.endswith(".parquet")]

    def problem(entry: pafs.FileInfo) -> str | None:
        size = entry.size or 0
        try:
            if columns:
                names = pq.read_schema(entry.path, filesystem=filesystem).names
                missing = [column for column in columns if column not in names]
                return f"no column {', '.join(missing)} (its columns: {', '.join(names)})" if missing else None
            if size < 12:
                return f"{size} bytes, too short for a Parquet file (at least 12)"
            with filesystem.open_input_file(entry.path) as file:
                file.seek(size - 8)
                tail = file.read(8)
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            return f"not readable as Parquet ({str(error).splitlines()[0]})"
        if tail[4:] != PARQUET_MAGIC:
            return f"{size:,} bytes that do not end as a Parquet file does (cut short, or not Parquet)"
        if int.from_bytes(tail[:4], "little") > size - 12:
            return f"{size:,} bytes, less than its footer says it holds (cut short)"
        return None

    if isinstance(filesystem, pafs.LocalFileSystem):
        found = [problem(entry) for entry in files]
    else:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            found = list(pool.map(problem, files))
    return [f"{uri(entry.path, filesystem)}: {what}" for entry, what in zip(files, found) if what is not None]


# --- Datasets that concurrent runs share ---------------------------------------------------------------------------

#: Written last into each copy of a dataset that `write_once` makes: the copy is complete. JSON: what its writer said.
COPY_MARKER = "_COMPLETE.json"
#: A copy's folder name: when its writer started (UTC, to the microsecond), then a random id. Sorted by name, the copies
#: are in the order their writers started (by each writer's clock).
_COPY_NAME = re.compile(r"\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{8}")


def _copies(root: str) -> list[str]:
    """Every copy folder under `root`, complete or not, earliest-started first."""
    try:
        entries = list_dir(root)
    except FileNotFoundError:
        return []
    return sorted(join(root, entry.base_name) for entry in entries
                  if entry.type == pafs.FileType.Directory and _COPY_NAME.fullmatch(entry.base_name))


def read_marker(copy: str) -> dict[str, Any] | None:
    """The marker of a complete copy (what its writer stored), or None when the copy has none (yet)."""
    path = join(copy, COPY_MARKER)
    if not is_file(path):
        return None
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError:  # on a local or NFS folder, the file is there before its bytes: still being written
        return None


def complete_copies(root: str, accept: Callable[[dict[str, Any]], bool] | None = None) -> list[str]:
    """The complete copies of a dataset under `root` whose marker `accept` takes (all by default), earliest first."""
    return [copy for copy in _copies(root)
            if (marker := read_marker(copy)) is not None and (accept is None or accept(marker))]


def incomplete_copies(root: str) -> list[str]:
    """The copies under `root` without their marker: writes still going, or leftovers of writers that stopped."""
    return [copy for copy in _copies(root) if read_marker(copy) is None]


def write_once(root: str, write: Callable[[str], dict[str, Any]],
               accept: Callable[[dict[str, Any]], bool] | None = None) -> str:
    """The earliest-started complete copy of a dataset under `root`; when there is none, write one first.

    For a dataset that concurrent runs prepare on one storage path (a notebook beside a job, two people sharing a
    workspace's storage), on a local folder, NFS or a bucket (s3://, which has no atomic rename). A run that finds a
    complete copy writes nothing. Otherwise it calls `write(copy)` on a new folder of its own,
    `<root>/<UTC start>-<random id>`, then stores the JSON that `write` returned as the copy's marker (COPY_MARKER),
    last, and returns the earliest-started copy complete by then. So runs that start together each write a copy,
    and no writer replaces or deletes a folder that another run may be reading. Only copies whose marker `accept`
    takes count (a copy in another layout is left alone too).

    A copy without a marker is never read nor deleted: it may be the live write of a run still going. The leftovers
    of runs stopped half-way stay until you remove them, once no run is preparing the dataset:
    `for copy in incomplete_copies(root): delete_dir(copy)` (or `delete_dir(root)`, to start over).
    """
    if complete := complete_copies(root, accept):
        return complete[0]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    copy = join(root, f"{started}-{secrets.token_hex(4)}")
    marker = write(copy)
    write_text(join(copy, COPY_MARKER), json.dumps(marker, indent=1) + "\n")  # last: from now on, the copy counts
    return (complete_copies(root, accept) or [copy])[0]  # another run's earlier copy may have completed meanwhile

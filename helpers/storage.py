"""Files under the storage path, local or remote: every read and write goes through `pyarrow.fs`.

`COURSE_STORAGE_PATH` may be a local folder, an NFS mount every node sees, or a URI such as
`s3://bucket/course` or `gs://bucket/course`. Ray Train reaches it through `pyarrow.fs`; the course's
own files there (run folders, summaries, the metrics history, the Parquet copy of MNIST) go through the
same layer, so an `s3://` path never turns into a local folder named `s3:`.

Paths are plain strings: absolute local paths, or URIs. Credentials for a bucket come from where
pyarrow (and Ray Train) look for them: the environment (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, ...),
the machine's instance role, or `~/.aws`. Every node that trains needs them.
"""

from __future__ import annotations

import os
import posixpath
import re

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


def delete_file(path: str) -> None:
    """Delete the file `path`."""
    filesystem, fs_path = resolve(path)
    filesystem.delete_file(fs_path)


def delete_dir(path: str) -> None:
    """Delete the folder `path` and everything under it, if it exists."""
    if exists(path):
        filesystem, fs_path = resolve(path)
        filesystem.delete_dir(fs_path)

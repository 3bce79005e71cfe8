"""helpers.storage: every function on a local folder and on an `s3://` path (a real S3 API: moto's server)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import boto3
import pyarrow.fs as pafs
import pytest

from helpers import storage
from helpers.storage import (
    basename,
    delete_dir,
    delete_file,
    exists,
    is_dir,
    is_file,
    is_uri,
    join,
    list_dir,
    makedirs,
    open_input,
    open_output,
    parquet_problems,
    read_text,
    resolve,
    size,
    uri,
    write_text,
)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    """A storage path that does not exist yet: `<tmp_path>/course`, or `s3://<fresh bucket>/course`."""
    if request.param == "local":
        return str(tmp_path / "course")
    return request.getfixturevalue("s3_path")


def _keys(bucket_uri: str) -> list[str]:
    """The object keys in the bucket `s3://<name>...`, through boto3 (not through the code under test)."""
    bucket = bucket_uri.removeprefix("s3://").split("/", 1)[0]
    return [item["Key"] for item in boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", [])]


# Paths as strings: no filesystem involved.

@pytest.mark.parametrize(("path", "expected"), [
    ("s3://bucket/course", True), ("gs://bucket/course", True), ("s3://bucket", True), ("file:///tmp/runs", True),
    ("/tmp/runs", False), ("runs/course", False), ("s3:/bucket/course", False), ("C:/runs", False),
    (Path("/tmp/runs"), False),
])
def test_is_uri(path, expected):
    assert is_uri(path) is expected


@pytest.mark.parametrize(("base", "parts", "expected"), [
    ("s3://bucket/course", ("run-a", "checkpoint_0"), "s3://bucket/course/run-a/checkpoint_0"),
    ("s3://bucket", ("course",), "s3://bucket/course"),
    ("s3://bucket/course/", ("run-a",), "s3://bucket/course/run-a"),
    ("gs://bucket/course", ("run-a", "history.json"), "gs://bucket/course/run-a/history.json"),
    ("/tmp/runs", ("run-a", "checkpoint_0"), os.path.join("/tmp/runs", "run-a", "checkpoint_0")),
    (Path("/tmp/runs"), ("run-a",), os.path.join("/tmp/runs", "run-a")),
])
def test_join(base, parts, expected):
    assert join(base, *parts) == expected


@pytest.mark.parametrize(("path", "expected"), [
    ("s3://bucket/course/run-a", "run-a"), ("s3://bucket/course/run-a/", "run-a"), ("s3://bucket", "bucket"),
    ("gs://bucket/course/history.json", "history.json"), ("/tmp/runs/run-a", "run-a"), ("/tmp/runs/run-a/", "run-a"),
    (Path("/tmp/runs/run-a"), "run-a"),
])
def test_basename(path, expected):
    assert basename(path) == expected


# resolve and uri.

def test_resolve_makes_a_relative_local_path_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    filesystem, fs_path = resolve("runs/course")
    assert isinstance(filesystem, pafs.LocalFileSystem)
    assert fs_path == str(tmp_path / "runs" / "course") and os.path.isabs(fs_path)


def test_resolve(root):
    filesystem, fs_path = resolve(root)
    if is_uri(root):
        assert isinstance(filesystem, pafs.S3FileSystem)
        assert fs_path == root.removeprefix("s3://")  # bucket/course, as Ray Train names it
        assert fs_path.endswith("/course") and not fs_path.startswith("/")
    else:
        assert isinstance(filesystem, pafs.LocalFileSystem)
        assert fs_path == root


def test_uri_round_trip(root):
    filesystem, fs_path = resolve(root)
    back = uri(fs_path, filesystem)
    assert back == root
    filesystem_back, fs_path_back = resolve(back)
    assert type(filesystem_back) is type(filesystem) and fs_path_back == fs_path


def test_uri_without_a_filesystem_and_on_gcs():
    assert uri("/tmp/runs/run-a", None) == "/tmp/runs/run-a"
    assert uri("bucket/course/run-a", pafs.GcsFileSystem(anonymous=True)) == "gs://bucket/course/run-a"


# Files and folders.

def test_makedirs_exists_is_dir_is_file(root):
    folder, file = join(root, "a", "b"), join(root, "a", "notes.txt")
    assert not exists(root) and not is_dir(root) and not is_file(root)
    makedirs(folder)
    makedirs(folder)  # already there: nothing to do
    for path in (root, join(root, "a"), folder):
        assert exists(path) and is_dir(path) and not is_file(path)
    write_text(file, "hello")
    assert exists(file) and is_file(file) and not is_dir(file)
    missing = join(root, "missing")
    assert not exists(missing) and not is_dir(missing) and not is_file(missing)


def test_write_text_creates_the_folders_and_read_text_reads_it_back(root):
    path = join(root, "run-a", "deep", "er", "notes.txt")
    write_text(path, "accuracy: 98.5 %\nGrüße, naïve 🙂\n")
    assert read_text(path) == "accuracy: 98.5 %\nGrüße, naïve 🙂\n"
    assert is_dir(join(root, "run-a", "deep", "er"))
    write_text(path, "short")  # replaces the file, never appends
    assert read_text(path) == "short"


def test_open_output_and_open_input_carry_a_torch_checkpoint(root):
    import torch

    path = join(root, "run-a", "checkpoint_0", "model.pt")
    state = {"weight": torch.arange(12.0).reshape(3, 4), "epoch": 3}
    with open_output(path) as file:
        torch.save(state, file)
    with open_input(path) as file:
        loaded = torch.load(io.BytesIO(file.read()))
    assert loaded["epoch"] == 3 and torch.equal(loaded["weight"], state["weight"])


def test_open_output_and_open_input_carry_a_pandas_csv(root):
    import pandas as pd

    path = join(root, "run-a", "history.csv")
    frame = pd.DataFrame({"epoch": [0, 1, 2], "test_acc": [0.91, 0.95, 0.975], "note": ["a", "é", "c,d"]})
    with open_output(path) as file:
        frame.to_csv(file, index=False)
    with open_input(path) as file:
        back = pd.read_csv(file)
    pd.testing.assert_frame_equal(back, frame)


def test_open_output_replaces_the_file(root):
    path = join(root, "blob.bin")
    with open_output(path) as file:
        file.write(b"\x00" * 100)
    with open_output(path) as file:
        file.write(b"\x01\x02")
    with open_input(path) as file:
        assert file.read() == b"\x01\x02"


def _tree(root: str) -> None:
    """root/{b.txt (3 bytes), a.txt (1), sub/c.txt (10), sub/deeper/d.txt (100), empty/}."""
    write_text(join(root, "b.txt"), "bbb")
    write_text(join(root, "a.txt"), "a")
    write_text(join(root, "sub", "c.txt"), "c" * 10)
    write_text(join(root, "sub", "deeper", "d.txt"), "d" * 100)
    makedirs(join(root, "empty"))


def test_list_dir_lists_the_direct_children_sorted(root):
    _tree(root)
    entries = list_dir(root)
    assert [entry.base_name for entry in entries] == ["a.txt", "b.txt", "empty", "sub"]
    assert [entry.type for entry in entries] == [pafs.FileType.File, pafs.FileType.File,
                                                  pafs.FileType.Directory, pafs.FileType.Directory]
    assert [entry.size for entry in entries[:2]] == [1, 3]
    assert list_dir(join(root, "empty")) == []


def test_list_dir_recursive(root):
    _tree(root)
    _, fs_path = resolve(root)
    paths = [entry.path for entry in list_dir(root, recursive=True)]
    assert paths == sorted(paths)
    relative = [os.path.relpath(path, fs_path) for path in paths]
    assert relative == ["a.txt", "b.txt", "empty", "sub", "sub/c.txt", "sub/deeper", "sub/deeper/d.txt"]


def test_list_dir_of_a_missing_folder_raises_file_not_found(root):
    with pytest.raises(FileNotFoundError):
        list_dir(join(root, "missing"))


def test_size_of_a_file_and_of_a_folder(root):
    _tree(root)
    assert size(join(root, "a.txt")) == 1
    assert size(join(root, "sub", "deeper", "d.txt")) == 100
    assert size(join(root, "sub")) == 110
    assert size(root) == 114
    assert size(join(root, "empty")) == 0


def test_size_of_a_missing_path_raises_file_not_found(root):
    with pytest.raises(FileNotFoundError):
        size(join(root, "missing"))


def test_delete_dir_deletes_the_folder_and_what_is_under_it(root):
    _tree(root)
    delete_dir(join(root, "sub"))
    assert not exists(join(root, "sub")) and not exists(join(root, "sub", "deeper", "d.txt"))
    assert [entry.base_name for entry in list_dir(root)] == ["a.txt", "b.txt", "empty"]
    assert is_dir(root) and read_text(join(root, "a.txt")) == "a"


def test_delete_file_deletes_only_that_file(root):
    _tree(root)
    delete_file(join(root, "a.txt"))
    assert not exists(join(root, "a.txt")) and read_text(join(root, "b.txt")) == "bbb"


def test_delete_dir_of_a_missing_folder_does_nothing(root):
    delete_dir(join(root, "missing"))
    makedirs(root)
    delete_dir(join(root, "missing"))
    delete_dir(root)
    delete_dir(root)  # already gone
    assert not exists(root)


def test_parquet_problems_names_each_damaged_file_from_its_end(root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"image": [b"x" * 100] * 50, "label": list(range(50))}), buffer)
    whole = buffer.getvalue()
    files = {"good.parquet": whole, "split/cut.parquet": whole[:len(whole) // 2], "split/html.parquet": b"<html>" * 9,
             "split/tiny.parquet": b"PAR1", "notes.txt": b"not a dataset file"}
    for name, data in files.items():
        with open_output(join(root, name)) as file:
            file.write(data)
    problems = parquet_problems(root)
    assert [problem.split(": ")[0] for problem in problems] == [
        join(root, name) for name in ("split/cut.parquet", "split/html.parquet", "split/tiny.parquet")]
    assert "do not end as a Parquet file does (cut short, or not Parquet)" in problems[0]
    assert "4 bytes, too short for a Parquet file" in problems[2]
    assert parquet_problems(join(root, "split"), columns=["image"])[0].startswith(join(root, "split/cut.parquet"))
    with open_output(join(root, "other", "no-image.parquet")) as file:
        pq.write_table(pa.table({"label": [1, 2]}), file)
    assert parquet_problems(join(root, "other"), columns=["image", "label"]) == [
        f"{join(root, 'other', 'no-image.parquet')}: no column image (its columns: label)"]
    assert parquet_problems(join(root, "other")) == []  # without columns: only the file's end
    with pytest.raises(FileNotFoundError):
        parquet_problems(join(root, "missing"))


# The point of the module.

def test_an_s3_path_never_becomes_a_local_folder(s3_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = join(s3_path, "run-a", "summary.json")
    write_text(path, '{"test_acc": 0.98}')
    makedirs(join(s3_path, "run-b"))
    with open_output(join(s3_path, "run-a", "model.pt")) as file:
        file.write(b"weights")
    assert not (tmp_path / "s3:").exists() and list(tmp_path.iterdir()) == []
    assert "course/run-a/summary.json" in _keys(s3_path) and "course/run-a/model.pt" in _keys(s3_path)
    assert read_text(path) == '{"test_acc": 0.98}'


def test_every_public_function_is_tested():
    public = {name for name in dir(storage) if not name.startswith("_") and callable(getattr(storage, name))
              and getattr(getattr(storage, name), "__module__", None) == storage.__name__}
    tested = {"is_uri", "join", "basename", "resolve", "uri", "exists", "is_dir", "is_file", "makedirs",
              "list_dir", "size", "open_input", "open_output", "read_text", "write_text", "delete_file", "delete_dir",
              "parquet_problems", "append_line",
              # in tests/test_shared_datasets.py, with writers in processes of their own:
              "write_once", "complete_copies", "incomplete_copies", "read_marker"}
    assert public == tested


def test_append_line_appends_locally_and_rewrites_on_an_object_store(tmp_path, monkeypatch):
    path = str(tmp_path / "run" / "history.jsonl")
    storage.append_line(path, '{"a": 1}')
    storage.append_line(path, '{"a": 2}')
    assert storage.read_text(path) == '{"a": 1}\n{"a": 2}\n'
    memory = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())  # not a LocalFileSystem
    (tmp_path / "bucket").mkdir()
    monkeypatch.setattr(storage, "resolve", lambda path: (memory, path.removeprefix("s3://")))
    storage.append_line("s3://b/h.jsonl", "1")
    storage.append_line("s3://b/h.jsonl", "2")
    assert (tmp_path / "bucket" / "b" / "h.jsonl").read_text() == "1\n2\n"

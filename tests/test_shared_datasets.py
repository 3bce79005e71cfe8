"""Datasets that concurrent runs prepare on one storage path (`helpers.storage.write_once`): every run gets it whole.

Lessons 03, 05 and 11 started in the same second each rewrote MNIST's Parquet folder while the others read it: two of
them then waited forever, and of three processes preparing it at once two failed on half-written files. Here each
preparer is a process of its own, released at the same moment as the others, after a first one was killed (SIGKILL)
half-way through its write: every preparer must succeed and count every row, and the killed one's leftover must be
ignored and left as it was.

First the mechanism alone, without Ray (a local folder and S3, quick); then each dataset the course writes, with its
real writer: MNIST and lesson 10's synthetic images through Ray Data (each preparer a driver of this module's Ray),
CIFAR-10's Parquet copy through pyarrow. The preparers and their race: tests/preparers.py; the datasets written
through Ray Data: tests/test_shared_datasets_ray.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import storage
from tests.preparers import CIFAR_ROWS, FILES
from tests.preparers import cifar_split as _cifar_split
from tests.preparers import killed_then_concurrent as _killed_then_concurrent


def test_concurrent_writers_each_get_a_whole_copy_and_skip_a_killed_writers_leftover(root, tmp_path):
    folders = _killed_then_concurrent({"dataset": "mechanism", "root": root}, root, tmp_path / "logs", ".txt",
                                      {"parts": FILES, "writers": 1})  # no file of another writer in a copy
    copies = storage.complete_copies(root)
    assert storage.write_once(root, lambda copy: pytest.fail("wrote again")) == copies[0]
    assert set(folders) <= set(copies) and storage.complete_copies(root) == copies


def test_the_earliest_complete_copy_of_the_accepted_layout_is_read(tmp_path):
    root = str(tmp_path / "set")
    names = ["20250101T000000.000000Z-00000000", "20250101T000001.000000Z-11111111",
             "20250101T000002.000000Z-22222222", "20250101T000003.000000Z-33333333"]
    for name, marker in zip(names, [None, '{"layout": 1}', '{"layout": 2', '{"layout": 2}']):
        (tmp_path / "set" / name).mkdir(parents=True)
        if marker is not None:
            (tmp_path / "set" / name / storage.COPY_MARKER).write_text(marker)
    (tmp_path / "set" / "train").mkdir()  # not a copy: an earlier layout of the folder, say
    (tmp_path / "set" / "notes.txt").write_text("not a copy either")
    copies = [str(tmp_path / "set" / name) for name in names]
    assert storage.complete_copies(root) == [copies[1], copies[3]]  # a marker still being written does not count
    assert storage.incomplete_copies(root) == [copies[0], copies[2]]
    assert storage.complete_copies(root, lambda marker: marker["layout"] == 2) == [copies[3]]
    assert storage.write_once(root, lambda copy: pytest.fail("wrote again"), lambda marker: marker["layout"] == 2) \
        == copies[3]
    new = storage.write_once(root, lambda copy: storage.makedirs(copy) or {"layout": 3},
                             lambda marker: marker["layout"] == 3)
    assert new not in copies and storage.read_marker(new) == {"layout": 3} and storage.basename(new) > names[-1]
    assert storage.complete_copies(str(tmp_path / "nothing-here")) == []


def test_cifar10_parquet_written_at_once_by_several_processes(tmp_path):
    from helpers.cifar import cifar10_parquet_root, read_split

    data_dir = tmp_path / "data"
    root = str(data_dir / "cifar10-parquet")
    _killed_then_concurrent({"dataset": "cifar", "root": str(data_dir)}, root, tmp_path / "logs", ".parquet",
                            CIFAR_ROWS)
    assert cifar10_parquet_root(data_dir) == storage.complete_copies(root)[0]
    train = read_split(cifar10_parquet_root(data_dir), "train")
    np.testing.assert_array_equal(train["image"], _cifar_split(True)[0])

"""helpers.ingest and the Ray Data preflight: Parquet written once, the two transforms agree, no silent hang.

What needs Ray Data (the copy written once, the datasets, the preflight): tests/test_ingest_ray.py.
"""

from __future__ import annotations

import pytest

from helpers import storage
from helpers.data import DataDamagedError
from helpers.ingest import (
    operator_times,
    write_mnist_parquet,
)

#: The shape of Ray 2.60's `ds.stats()` text, cut down: an operator with no tasks, a map, an all-to-all one.
STATS = """Operator 0 ReadFiles:

Operator 1 ListFiles: 1 tasks executed, 1 blocks produced in 5.1s
* Remote wall time: 5.1s min, 5.1s max, 5.1s mean, 5.1s total
* Remote cpu time: 242.87ms min, 242.87ms max, 242.87ms mean, 242.87ms total
* Output num rows per block: 1 min, 1 max, 1 mean, 1 total

Operator 4 MapBatches(normalize_batch): 2 tasks executed, 2 blocks produced in 0.03s
* Remote wall time: 12.5ms min, 12.59ms max, 12.55ms mean, 25.09ms total
* Remote cpu time: 11ms min, 12.52ms max, 11.76ms mean, 23.52ms total

Operator 5 Repartition: executed in 5.49s

\tSuboperator 0 RepartitionSplit: 1 tasks executed, 8 blocks produced
\t* Remote wall time: 39.09us min, 475.55us max, 103.39us mean, 827.15us total
\t* Remote cpu time: 39.16us min, 158.92us max, 63.82us mean, 510.57us total

Dataset throughput:
\t* Ray Data throughput: 353.69668422627467 rows/s
"""


def test_operator_times_reads_each_operators_tasks_and_total_seconds():
    table = operator_times(STATS)
    assert list(table.index) == ["ListFiles", "MapBatches(normalize_batch)", "RepartitionSplit"]
    assert table.loc["ListFiles"].to_dict() == {"tasks": 1, "wall_s": 5.1, "cpu_s": 0.243}
    assert table.loc["MapBatches(normalize_batch)"].to_dict() == {"tasks": 2, "wall_s": 0.025, "cpu_s": 0.024}
    assert table.loc["RepartitionSplit"].to_dict() == {"tasks": 1, "wall_s": 0.001, "cpu_s": 0.001}


def test_a_copy_damaged_after_it_was_published_is_named_with_the_folder_to_delete(tmp_path):
    # A complete copy (its marker written) whose file was cut later: found, checked, refused; no Ray needed.
    copy = tmp_path / "datasets" / "mnist-parquet" / "20250101T000000.000000Z-0123abcd"
    (copy / "train").mkdir(parents=True)
    (copy / "train" / "part-00000.parquet").write_bytes(b"PAR1" + bytes(100))  # the end of a file cut short
    (copy / storage.COPY_MARKER).write_text('{"rows": {"train": 60000, "test": 10000}, "num_files": 8}')
    with pytest.raises(DataDamagedError) as error:
        write_mnist_parquet("/nonexistent-data-dir", str(tmp_path))
    message = str(error.value)
    assert f"The copy of MNIST as Parquet in {copy} is damaged" in message
    assert f"{copy / 'train' / 'part-00000.parquet'}: 104 bytes that do not end as a Parquet file does" in message
    assert f"To fix it: delete the folder {copy} once no run reads it" in message

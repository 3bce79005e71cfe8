"""Training on more data than fits in memory: a synthetic image dataset on the storage path, streamed into Ray Train.

Kept here once for `notebooks/train_streaming.py` and lesson 10:

- `synthetic_folder` writes N GB of random images as Parquet under the storage path, once, with Ray Data itself
  (so writing streams too, and works on a cluster and on s3://), in a copy that concurrent runs share safely
  (`storage.write_once`); `remove_synthetic_images` is the clean-up step;
- `streaming_dataset` reads and normalises it lazily: nothing is materialized, Ray Data streams blocks to the
  workers while they train, within a fixed object-store budget (`streaming_data_config`);
- `train_loop_per_worker` is the loop the lesson teaches (the `# [n]` marks say what changed from lesson 03's);
- `WorkerReports` and `check_every_row_once` check that every epoch saw every row exactly once.

The script's flags are `helpers.tooling.scripts.parse_streaming_args`; `helpers.tooling.memory.MemoryPeaks` samples
every node's processes and object store while the run goes, to show that memory stays flat as data grows and that
nothing is spilled to disk.

Sizes in GB are GiB here (2**30 bytes), so that "1 GB of data" and "1024 MiB of memory" compare directly.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import ray
import ray.data
import ray.train
from ray.train import UserCallback

from helpers import rounds, storage
from helpers.cluster import StoragePathError
from helpers.data import check_parquet_copy
from helpers.results import run_path
from helpers.rounds import spread_text
from helpers.tooling import ray_internals

if TYPE_CHECKING:
    from torch import nn

# No `import torch` at the top: Ray Data's tasks import this module for `make_images` and `normalize_images`, and
# torch would add about 280 MiB and 2.5 s to each of those processes (measured here). The training code imports it.

#: Bytes in one GB of data (a GiB).
GB = 2**30
MIB = 2**20
#: One image: 3 x 64 x 64 uint8 pixels, 12 KiB. 1 GB is 87,384 images.
IMAGE_SHAPE = (3, 64, 64)
ROW_BYTES = math.prod(IMAGE_SHAPE)
#: How the files store an image: its ROW_BYTES pixel bytes as one value (see `make_images`).
IMAGE_TYPE = pa.binary(ROW_BYTES)
#: The dataset has a multiple of this many rows, so 1, 2, 3, 4, 6 or 8 workers split it exactly (Ray Train splits
#: a dataset with `streaming_split(equal=True)`, which drops the remainder to give every worker as many rows).
ROW_MULTIPLE = 24
#: Rows per Parquet file (10 MiB, one row group): the same at every size.
ROWS_PER_FILE = 840
#: Datasets live under `<storage_path>/datasets/`, each in a folder named for its size that holds its copies.
DATASETS = "datasets"
FOLDER_PREFIX = "synthetic-images-"
#: Written last into a copy's folder: the copy is complete (rows, bytes, shape). Ray Data reads only `.parquet`.
COMPLETE_MARKER = storage.COPY_MARKER


# --- The synthetic dataset -------------------------------------------------------------------------------------

def num_rows_for(size_gb: float) -> int:
    """Rows of IMAGE_SHAPE images that make `size_gb` GB, as a multiple of ROW_MULTIPLE (at least one multiple)."""
    return max(1, round(size_gb * GB / ROW_BYTES / ROW_MULTIPLE)) * ROW_MULTIPLE


def synthetic_path(storage_path: str, size_gb: float) -> str:
    """The folder where `synthetic_folder` keeps the copies of the dataset of `size_gb` GB (written yet or not)."""
    return storage.join(storage_path, DATASETS, f"{FOLDER_PREFIX}{size_gb:g}gb")


def _this_layout(marker: dict[str, Any]) -> bool:
    """True for a copy of images in this module's layout (earlier versions of it wrote them as lists of uint8)."""
    return marker.get("image_type") == str(IMAGE_TYPE)


def dataset_marker(folder: str) -> dict[str, Any] | None:
    """The marker of a complete copy (rows, bytes, shape, ...), or None when the copy is incomplete or holds images
    in another layout."""
    marker = storage.read_marker(folder)
    return marker if marker is not None and _this_layout(marker) else None


def find_synthetic_folder(storage_path: str, size_gb: float) -> str | None:
    """The complete copy that `synthetic_folder` would return without writing anything, or None."""
    return next(iter(storage.complete_copies(synthetic_path(storage_path, size_gb), _this_layout)), None)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fast, well-mixed hash of each uint64 (SplitMix64's finaliser): random-looking, and the same every time."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def make_images(batch: dict[str, np.ndarray]) -> pa.Table:
    """`{"id"}` -> a table of `id`, `label` and `image`: each id's image and label, always the same for the same id.

    The pixels are hashes of (id, position): incompressible, so the Parquet files take the bytes they hold. Each image
    is one value of ROW_BYTES raw bytes (IMAGE_TYPE), as image datasets keep each encoded image: Parquet reads a file's
    images as one buffer. Written as a numpy array, they would be a tensor column, a list of uint8 per image, which
    Parquet decodes with two levels per pixel: measured here, pyarrow's memory pool peaked at 151 MiB to read one
    10 MiB file (39 MiB for this layout), and the largest Ray Data process of a 0.25 GB run held 2.0 GiB (0.55 GiB).
    """
    ids = batch["id"].astype(np.int64)
    words = ROW_BYTES // 8
    counters = ids.astype(np.uint64)[:, np.newaxis] * np.uint64(words) + np.arange(words, dtype=np.uint64)
    pixels = _splitmix64(counters).view(np.uint8)  # one row of ROW_BYTES bytes per image
    images = pa.FixedSizeBinaryArray.from_buffers(IMAGE_TYPE, len(ids), [None, pa.py_buffer(pixels)])
    return pa.table({"id": ids, "label": ids % 10, "image": images})


def synthetic_folder(storage_path: str, size_gb: float) -> str:
    """Write `size_gb` GB of synthetic images as Parquet under `<storage_path>/datasets/`, once; return the folder.

    Ray Data writes it: a stream of tasks, each making and writing one file, so no process ever holds the whole
    dataset, and every node of a cluster can take a share (the storage path must then be shared, or s3://).
    The folder is a copy under `synthetic_path(...)`, made with `storage.write_once`: runs that ask for the same size
    at the same time each get a complete copy, and none writes over or deletes one that another run reads. A copy
    without its marker (an interrupted write), or with images in another layout, is ignored and left as it is.
    """
    def write(copy: str) -> dict[str, Any]:
        num_rows = num_rows_for(size_gb)
        started = time.perf_counter()
        (ray.data.range(num_rows, override_num_blocks=math.ceil(num_rows / ROWS_PER_FILE))  # ids 0..num_rows-1
         .map_batches(make_images, batch_size=None)  # one block in, one file's rows out
         .write_parquet(copy))
        return {"rows": num_rows, "bytes": storage.size(copy), "image_shape": list(IMAGE_SHAPE),
                "image_type": str(IMAGE_TYPE), "size_gb": size_gb, "write_s": round(time.perf_counter() - started, 2)}

    copy = storage.write_once(synthetic_path(storage_path, size_gb), write, accept=_this_layout)
    check_parquet_copy(copy, "the synthetic images")  # the files' ends only: a damaged copy is named before training
    return copy


def remove_synthetic_images(storage_path: str) -> int:
    """Delete every synthetic dataset under `<storage_path>/datasets/` (nothing else); return the bytes freed.

    Every copy goes, complete or not (the leftovers of interrupted writes too): run it only when no run on this
    storage path reads or writes them.
    """
    root = storage.join(storage_path, DATASETS)
    if not storage.is_dir(root):
        return 0
    freed = 0
    for entry in storage.list_dir(root):
        name = storage.basename(entry.path)
        if storage.is_dir(folder := storage.join(root, name)) and re.fullmatch(rf"{FOLDER_PREFIX}[\d.e+-]+gb", name):
            freed += storage.size(folder)
            storage.delete_dir(folder)
    return freed


def check_free_disk(storage_path: str, size_gb: float) -> None:
    """Raise StoragePathError when a local storage path has less free disk than the dataset still to write needs."""
    if storage.is_uri(storage_path) or find_synthetic_folder(storage_path, size_gb) is not None:
        return  # a bucket has no "free disk"; a complete dataset is reused
    existing = Path(storage_path).absolute()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    needed = num_rows_for(size_gb) * ROW_BYTES
    if needed > free:
        raise StoragePathError(
            f"{size_gb:g} GB of images would not fit on the disk of the storage path {storage_path}: it needs "
            f"{needed / GB:.2f} GB and {free / GB:.2f} GB are free.\nTo fix it: ask for less (--data-size-gb), "
            "free space (remove_synthetic_images() deletes the datasets earlier runs wrote), or point "
            "--storage-path (COURSE_STORAGE_PATH) to a bigger disk or a bucket (s3://...).")


# --- Streaming it into training --------------------------------------------------------------------------------

def normalize_images(batch: pa.Table) -> dict[str, np.ndarray]:
    """Per batch: each image's bytes -> 3 x 64 x 64 float32 pixels in [-1, 1] (4x the bytes: this is why the stream
    should not pile up)."""
    column = batch.column("image").combine_chunks()  # one fixed-size binary array: one buffer of pixel bytes
    pixels = np.frombuffer(column.buffers()[1], np.uint8, len(column) * ROW_BYTES, column.offset * ROW_BYTES)
    images = pixels.reshape(len(column), *IMAGE_SHAPE).astype(np.float32)  # the one copy; the rest works in place
    images *= 2 / 255
    images -= 1.0
    return {"id": batch.column("id").to_numpy(), "label": batch.column("label").to_numpy(), "image": images}


#: Parquet bytes (uncompressed) Ray Data may pack into one read task. A read task decodes all of its files at once,
#: one thread per file; Ray Data 2.60 packs up to 128 MiB, so about 12 of these 10 MiB files. Measured with 2 workers
#: at 0.25 GB, the largest Ray Data process held 550 MiB (128 MiB read tasks) and 305 MiB (32 MiB): 3 files.
READ_TASK_BYTES = 32 * MIB
#: Actors that read the Parquet files' footers each time Ray Data lists the dataset, that is every epoch. Ray Data
#: 2.60 starts up to 32, each a new process of about 110 MiB. Measured at 0.5 GB (52 files, 3 rounds), one actor
#: instead made Ray Data's processes together hold 589 MiB instead of 1,121, and every run shorter (0.75x).
FOOTER_ACTORS = 1
#: The largest block Ray Data makes (its default is 128 MiB): 8 MiB of images, 680 rows. `normalize_images` turns a
#: block into 4x its bytes of float32 (32 MiB) at once, and the training workers hold a block or two each.
STREAM_BLOCK_BYTES = 8 * MIB
#: Object-store bytes Ray Data may fill ahead of the training workers: the blocks it has made that are not yet freed,
#: those the workers are training on included. Training is slower than reading here, so without a cap the stream
#: runs ahead until Ray Data's default budget (half of the object store, itself 30% of RAM) is full: the bigger the
#: dataset, the more it fills. A fixed cap keeps memory flat at any size.
#: The object store holds more than this: Ray deletes the blocks every process has let go of in batches, once a
#: second, so a store with room to spare also keeps up to a second of released blocks. Measured with the default
#: store at 1 GB, it peaked at 274-327 MiB (3 runs; at a sample of 298 MiB, 118 MiB were still referenced), and at
#: 142 MiB with Ray deleting every 0.1 s (RAY_free_objects_period_milliseconds=100). A store of twice the budget
#: streamed 0.5-2 GB without spilling anything to disk (`train_streaming.py --object-store-mib 256`).
STREAM_OBJECT_STORE_BYTES = 128 * MIB


def streaming_dataset(folder: str) -> ray.data.Dataset:
    """The training dataset: read the Parquet files, normalise on the CPU pool; lazy, never materialized."""
    context = ray.data.DataContext.get_current()  # copied into each new dataset
    before, context.target_max_block_size = context.target_max_block_size, STREAM_BLOCK_BYTES
    try:
        with ray_internals.parquet_read_plan(READ_TASK_BYTES, FOOTER_ACTORS):  # Ray Data plans the read here
            dataset = ray.data.read_parquet(folder)
    finally:
        context.target_max_block_size = before
    # batch_size=None: a whole block per call. Ray Data then runs the read and the normalisation in the same task
    # ("ReadFiles->MapBatches"): the uint8 images never go through the object store, only the float32 ones.
    return dataset.map_batches(normalize_images, batch_size=None, batch_format="pyarrow")


def streaming_data_config() -> ray.train.DataConfig:
    """Ray Train's DataConfig for the stream: Ray Data may fill at most STREAM_OBJECT_STORE_BYTES ahead of training."""
    from ray.data import ExecutionOptions, ExecutionResources

    limits = ExecutionResources(object_store_memory=STREAM_OBJECT_STORE_BYTES)
    return ray.train.DataConfig(execution_options=ExecutionOptions(resource_limits=limits))


def small_cnn() -> nn.Module:
    """A deliberately small model (about 6k parameters): it pools 64x64 to 16x16 first, so data is the bottleneck."""
    from torch import nn

    return nn.Sequential(
        nn.AvgPool2d(4),  # 3 x 64 x 64 -> 3 x 16 x 16
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # -> 16 x 8 x 8
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),  # -> 32 x 1 x 1
        nn.Flatten(), nn.Linear(32, 10),
    )


def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray Train worker: lesson 03's loop over a streamed dataset too large to keep in memory."""
    import ray.train.torch  # [1] imported here, in the workers (see the top of helpers/streaming.py)
    import torch
    from torch import nn

    from helpers.training import seed_everything

    seed_everything(config["seed"])
    world_size = ray.train.get_context().get_world_size()
    batch_size_per_worker = config["global_batch_size"] // world_size

    train_shard = ray.train.get_dataset_shard("train")  # [2] only a train split: the lesson measures the stream
    model = ray.train.torch.prepare_model(small_cnn())  # [3] a small model, so reading the data is the slow part
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(config["num_epochs"]):
        model.train()
        started_at, total_loss, num_rows, id_sum = time.time(), 0.0, 0, 0
        batches = train_shard.iter_torch_batches(  # a new pass over the shard every epoch: read from disk again
            batch_size=batch_size_per_worker,
            dtypes={"id": torch.int64, "label": torch.int64, "image": torch.float32},
            device=ray.train.torch.get_device(),
            prefetch_batches=config["prefetch_batches"],  # [4] no local shuffle buffer: it would hold rows back
        )
        for batch in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch["label"])
            num_rows += len(batch["id"])  # [5] count the rows and add up their ids: the driver checks that
            id_sum += int(batch["id"].sum())  # [5] each epoch saw every row exactly once across the workers
        metrics = {"epoch": epoch, "rows": num_rows, "id_sum": id_sum, "epoch_s": time.time() - started_at,
                   "loss": total_loss / max(1, num_rows)}
        ray.train.report(metrics)  # [6] every worker reports its own numbers; no checkpoint (a barrier all the same)


class WorkerReports(UserCallback):
    """Keeps every worker's metrics of every report in `worker_reports.jsonl` in the run folder, one line per report.

    Ray Train hands a callback the reports of all ranks, in its controller process; `Result.metrics` has rank 0's
    only (and is None when no report carried a checkpoint). `read_worker_reports` reads the file back.
    """

    FILE = "worker_reports.jsonl"

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        run_config = run_context.get_run_config()
        path = storage.join(run_path(run_config.storage_path, run_config.name), self.FILE)
        storage.append_line(path, json.dumps(metrics))


def read_worker_reports(result: ray.train.Result) -> list[list[dict[str, Any]]]:
    """What `WorkerReports` kept for a run: per report, the metrics of each rank."""
    path = storage.join(storage.uri(result.path, result.filesystem), WorkerReports.FILE)
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


def check_every_row_once(reports: list[list[dict[str, Any]]], num_rows: int, num_epochs: int) -> None:
    """Raise RuntimeError unless each of the `num_epochs` epochs saw each of the ids 0..num_rows-1 once in all."""
    if len(reports) != num_epochs:
        raise RuntimeError(f"Expected {num_epochs} reports (one per epoch), got {len(reports)}.")
    expected_sum = num_rows * (num_rows - 1) // 2
    for epoch, ranks in enumerate(reports):
        rows, id_sum = sum(rank["rows"] for rank in ranks), sum(rank["id_sum"] for rank in ranks)
        if rows != num_rows or id_sum != expected_sum:
            raise RuntimeError(
                f"Epoch {epoch} did not see every row exactly once: the workers saw {rows} rows (ids adding up to "
                f"{id_sum}), the dataset has {num_rows} (ids adding up to {expected_sum}). Rows were lost or "
                "repeated between the dataset and the workers.")


# --- Reading the runs ---------------------------------------------------------------------------------------------

def runs_table(runs: dict[str, list[dict[str, Any]]]):
    """One row per size from `train_streaming.py`'s JSON reports (several runs each): median [min-max] of the time
    and of each kind's peak memory (MiB), the object store's capacity, and the most any run spilled to disk or wrote
    to fallback files (objects created on disk when the store was full)."""
    import pandas as pd

    def spread(values: list[float]) -> str:
        return spread_text(rounds.spread(values), digits=0)

    rows = {}
    for size, reports in runs.items():
        first = reports[0]
        rows[size] = {
            "images": first["num_rows"], "GB on disk": round(first["bytes_on_disk"] / GB, 2), "runs": len(reports),
            "fit (s)": spread([r["fit_s"] for r in reports]),
            "an epoch (s)": spread([s for r in reports for s in r["epoch_s"]]),
            **{f"{kind} (MiB)": spread([r["peak_mib"][kind] for r in reports]) for kind in first["peak_mib"]},
            "store capacity (MiB)": first["object_store"]["capacity_mib"],
            "spilled (MiB)": max(r["object_store"]["spilled_bytes"] for r in reports) / MIB,
            "fallback (MiB)": max(r["object_store"].get("fallback_mib", 0.0) for r in reports),
        }
    return pd.DataFrame(rows).T

"""Training on more data than fits in memory: a synthetic image dataset on the storage path, streamed into Ray Train.

Kept here once for `notebooks/train_streaming.py` (seed 004's `pytorch_training_e2e.py`) and its lesson:

- `synthetic_folder` writes N GB of random images as Parquet under the storage path, once, with Ray Data itself
  (so writing streams too, and works on a cluster and on s3://); `remove_synthetic_images` is the clean-up step;
- `streaming_dataset` reads and normalises it lazily: nothing is materialized, Ray Data streams blocks to the
  workers while they train;
- `train_loop_per_worker` is the loop the lesson teaches (the `# [n]` marks say what changed from lesson 03's);
- `MemoryPeaks` samples every node's processes while the run goes, to show that memory stays flat as data grows.

Sizes in GB are GiB here (2**30 bytes), so that "1 GB of data" and "1024 MiB of memory" compare directly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import ray
import ray.data
import ray.train
from ray.train import UserCallback

from helpers import storage
from helpers.cluster import StoragePathError
from helpers.config import load_config, load_dotenv_file
from helpers.results import run_path

if TYPE_CHECKING:
    from torch import nn

# No `import torch` at the top: Ray Data's tasks import this module for `make_images` and `normalize_images`, and
# torch would add about 280 MiB and 2.5 s to each of those processes (measured here). The training code imports it.

#: Bytes in one GB of data (a GiB).
GB = 2**30
MIB = 2**20
#: The flag's default size, and the smoke test's (COURSE_SMOKE_TEST=1) when --data-size-gb is not given.
DEFAULT_SIZE_GB = 1.0
SMOKE_SIZE_GB = 0.01
#: One image: 3 x 64 x 64 uint8 pixels, 12 KiB. 1 GB is 87,384 images.
IMAGE_SHAPE = (3, 64, 64)
ROW_BYTES = math.prod(IMAGE_SHAPE)
#: The dataset has a multiple of this many rows, so 1, 2, 3, 4, 6 or 8 workers split it exactly (Ray Train splits
#: a dataset with `streaming_split(equal=True)`, which drops the remainder to give every worker as many rows).
ROW_MULTIPLE = 24
#: Rows per Parquet file (10 MiB): the same at every size, so each read task holds the same amount of memory.
ROWS_PER_FILE = 840
#: Datasets live under `<storage_path>/datasets/`, each in a folder named for its size.
DATASETS = "datasets"
FOLDER_PREFIX = "synthetic-images-"
#: Written last into a dataset's folder: the dataset is complete (rows, bytes, shape). Ray Data reads only `.parquet`.
COMPLETE_MARKER = "_COMPLETE.json"


# --- The flags -------------------------------------------------------------------------------------------------

def parse_streaming_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """`--data-size-gb --num-epochs --num-workers --smoke-test --storage-path --json`, defaulting to the configuration.

    `--data-size-gb` is None when not given: `requested_size_gb` picks 1 GB, or 0.01 GB in smoke mode.
    """
    load_dotenv_file()
    cfg = load_config()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-size-gb", type=float, default=None,
                        help=f"GB (GiB) of images to write and stream (default {DEFAULT_SIZE_GB:g}, "
                             f"{SMOKE_SIZE_GB:g} with --smoke-test)")
    parser.add_argument("--num-epochs", type=int, default=2, help="passes over the whole dataset")
    parser.add_argument("--num-workers", type=int, default=cfg.num_workers,
                        help="Ray Train workers (default: COURSE_NUM_WORKERS, else one per GPU, else 2)")
    parser.add_argument("--smoke-test", action="store_true", default=cfg.smoke_test,
                        help=f"a tiny dataset ({SMOKE_SIZE_GB:g} GB) unless --data-size-gb is given (CI)")
    parser.add_argument("--storage-path", default=cfg.storage_path,
                        help="where the dataset and the run go: a shared folder or a URI such as s3://bucket/prefix")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    if args.data_size_gb is not None and not args.data_size_gb > 0:  # `not >` also refuses nan
        parser.error(f"--data-size-gb must be more than 0, got {args.data_size_gb:g}")
    if args.num_epochs < 1:
        parser.error(f"--num-epochs must be at least 1, got {args.num_epochs}")
    if args.num_workers is not None and args.num_workers < 1:
        parser.error(f"--num-workers must be at least 1, got {args.num_workers}")
    return args


def requested_size_gb(args: argparse.Namespace) -> float:
    """The dataset's size in GB: `--data-size-gb` when given, else 0.01 in smoke mode and 1 otherwise."""
    if args.data_size_gb is not None:
        return float(args.data_size_gb)
    return SMOKE_SIZE_GB if args.smoke_test else DEFAULT_SIZE_GB


# --- The synthetic dataset -------------------------------------------------------------------------------------

def num_rows_for(size_gb: float) -> int:
    """Rows of IMAGE_SHAPE images that make `size_gb` GB, as a multiple of ROW_MULTIPLE (at least one multiple)."""
    return max(1, round(size_gb * GB / ROW_BYTES / ROW_MULTIPLE)) * ROW_MULTIPLE


def synthetic_path(storage_path: str, size_gb: float) -> str:
    """Where `synthetic_folder` keeps the dataset of `size_gb` GB (whether or not it is written yet)."""
    return storage.join(storage_path, DATASETS, f"{FOLDER_PREFIX}{size_gb:g}gb")


def dataset_marker(folder: str) -> dict[str, Any] | None:
    """The marker of a complete dataset folder (rows, bytes, shape, ...), or None when the folder is incomplete."""
    marker = storage.join(folder, COMPLETE_MARKER)
    return json.loads(storage.read_text(marker)) if storage.is_file(marker) else None


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fast, well-mixed hash of each uint64 (SplitMix64's finaliser): random-looking, and the same every time."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def make_images(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`{"id"}` -> `{"id", "label", "image"}`: each id's image and label, always the same for the same id.

    The pixels are hashes of (id, position): incompressible, so the Parquet files take the bytes they hold.
    """
    ids = batch["id"].astype(np.int64)
    words = ROW_BYTES // 8
    counters = ids.astype(np.uint64)[:, np.newaxis] * np.uint64(words) + np.arange(words, dtype=np.uint64)
    images = _splitmix64(counters).view(np.uint8).reshape(len(ids), *IMAGE_SHAPE)
    return {"id": ids, "label": ids % 10, "image": images}


def synthetic_folder(storage_path: str, size_gb: float) -> str:
    """Write `size_gb` GB of synthetic images as Parquet under `<storage_path>/datasets/`, once; return the folder.

    Ray Data writes it: a stream of tasks, each making and writing one file, so no process ever holds the whole
    dataset, and every node of a cluster can take a share (the storage path must then be shared, or s3://).
    The marker is written last: a folder without it (an interrupted write) is deleted and written again.
    """
    folder = synthetic_path(storage_path, size_gb)
    if dataset_marker(folder) is not None:
        return folder
    storage.delete_dir(folder)  # an interrupted write: start again from nothing
    num_rows = num_rows_for(size_gb)
    started = time.perf_counter()
    (ray.data.range(num_rows, override_num_blocks=math.ceil(num_rows / ROWS_PER_FILE))  # ids 0..num_rows-1
     .map_batches(make_images, batch_size=None)  # one block in, one file's rows out
     .write_parquet(folder))
    marker = {"rows": num_rows, "bytes": storage.size(folder), "image_shape": list(IMAGE_SHAPE),
              "size_gb": size_gb, "write_s": round(time.perf_counter() - started, 2)}
    storage.write_text(storage.join(folder, COMPLETE_MARKER), json.dumps(marker, indent=1) + "\n")
    return folder


def remove_synthetic_images(storage_path: str) -> int:
    """Delete every synthetic dataset under `<storage_path>/datasets/` (nothing else); return the bytes freed."""
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
    if storage.is_uri(storage_path) or dataset_marker(synthetic_path(storage_path, size_gb)) is not None:
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

def normalize_images(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per batch: uint8 pixels -> float32 in [-1, 1] (4x the bytes: this is why the stream should not pile up)."""
    images = batch["image"].astype(np.float32)  # the one copy; the arithmetic below works in place
    images *= 2 / 255
    images -= 1.0
    batch["image"] = images
    return batch


#: Rows per call of `normalize_images`: 12 MiB of float32 at a time, whatever the size of a read task's block.
NORMALIZE_BATCH_ROWS = 256
#: Object-store bytes Ray Data may fill ahead of the training workers. Training is slower than reading here, so
#: without a cap the stream runs ahead until Ray Data's default budget (a share of the object store, which is
#: 30% of RAM) is full: the bigger the dataset, the more it fills. A fixed cap keeps memory flat at any size.
STREAM_OBJECT_STORE_BYTES = 512 * MIB


#: The largest block Ray Data makes (its default is 128 MiB); Ray Data 2.60 also packs files into read tasks up to
#: about this size. Measured here with 2 workers, the largest read process peaked at 1.9 GB (0.25 GB of data) and
#: 3.4 GB (1 GB) with the defaults, and at 2.2 and 2.6 GB with this setting: better, not yet flat (not explained).
STREAM_BLOCK_BYTES = 32 * MIB


def streaming_dataset(folder: str) -> ray.data.Dataset:
    """The training dataset: read the Parquet files, normalise on the CPU pool; lazy, never materialized."""
    context = ray.data.DataContext.get_current()  # copied into each new dataset
    before, context.target_max_block_size = context.target_max_block_size, STREAM_BLOCK_BYTES
    try:
        dataset = ray.data.read_parquet(folder)
    finally:
        context.target_max_block_size = before
    return dataset.map_batches(normalize_images, batch_size=NORMALIZE_BATCH_ROWS)


def streaming_data_config() -> ray.train.DataConfig:
    """Ray Train's DataConfig for the stream: Ray Data may fill at most STREAM_OBJECT_STORE_BYTES ahead of training."""
    from ray.data import ExecutionOptions, ExecutionResources

    limits = ExecutionResources(object_store_memory=STREAM_OBJECT_STORE_BYTES)
    return ray.train.DataConfig(execution_options=ExecutionOptions(resource_limits=limits))


def small_cnn() -> nn.Module:
    """A deliberately small model (about 6k parameters): pool 64x64 down to 16x16 first, so the data is the bottleneck."""
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
        before = storage.read_text(path) if storage.is_file(path) else ""  # object stores cannot append: rewrite
        storage.write_text(path, before + json.dumps(metrics) + "\n")


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


# --- Memory, by kind of process, on every node -----------------------------------------------------------------

#: Kinds of process the samplers tell apart, by process title (Ray sets each worker's title to what it runs).
DRIVER, TRAIN_WORKER, DATA = "driver", "train_worker", "data"
#: A Ray Train worker: "ray::RayTrainWorker.run_train_fn" (ray::<actor class>.<method>, or just the class when idle).
_TRAIN_TITLE = re.compile(r"^ray::RayTrainWorker\b")
#: Ray Data's tasks and actors: fused operators ("ray::ReadParquet->MapBatches(normalize_images)"), single ones
#: ("ray::MapBatches(make_images)", "ray::Write"), the actor that splits a dataset between Ray Train's workers
#: ("ray::SplitCoordinator") and its statistics actor ("ray::_StatsActor").
_DATA_TITLE = re.compile(
    r"^ray::(SplitCoordinator|_StatsActor|MapWorker|Read\w*|Write\w*|ListFiles\w*|"
    r"(MapBatches|MapRows|Map|FlatMap|Filter|Project|Limit|Repartition|Split\w*)\b)|^ray::\w+(\(.*\))?->")


def process_kind(title: str) -> str | None:
    """TRAIN_WORKER or DATA for a Ray process title (its command line), else None."""
    if _TRAIN_TITLE.match(title):
        return TRAIN_WORKER
    if _DATA_TITLE.match(title):
        return DATA
    return None


def _uss(process: psutil.Process) -> int:
    """Bytes only this process holds (its unique set size).

    Not RSS: RSS also counts the object store's shared-memory pages a process has mapped, so every process
    that reads a block would count that block again, and the sum over processes would count it many times.
    The object store is measured on its own.
    """
    return process.memory_full_info().uss


class MemorySampler:
    """Samples one node's processes every `interval_s` in a thread, and keeps each kind's peak (bytes).

    Runs as a Ray actor pinned to its node (`MemoryPeaks` starts one per alive node).
    """

    def __init__(self, raylet_address: str, raylet_port: int, interval_s: float = 0.25):
        self._raylet = (raylet_address, raylet_port)
        self._interval_s = interval_s
        self._peaks = {f"{TRAIN_WORKER}_max": 0, f"{DATA}_max": 0, f"{DATA}_sum": 0, "object_store": 0}
        self._titles: dict[str, int] = {}  # the largest USS seen under each title counted (bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _object_store_bytes(self) -> int:
        # The bytes in this node's object store, as its raylet reports them. Ray 2.60 has no public API for it:
        # `ray._private.internal_api.node_stats` is what `ray memory --stats-only` reads (through
        # `memory_summary(stats_only=True)`, which asks one raylet for the whole cluster and returns text).
        from ray._private.internal_api import node_stats

        return node_stats(*self._raylet, include_memory_info=False).store_stats.object_store_bytes_used

    def sample(self) -> None:
        """Read every process of this node once, and raise the peaks they pass."""
        train_max = data_max = data_sum = 0
        for process in psutil.process_iter(["cmdline"]):
            kind = process_kind(" ".join(process.info["cmdline"] or []))
            if kind is None:
                continue
            try:
                uss = _uss(process)
            except psutil.Error:  # gone meanwhile, e.g. a task's worker that just exited
                continue
            title = " ".join(process.info["cmdline"]).strip()[:80]  # Ray pads titles with spaces
            self._titles[title] = max(self._titles.get(title, 0), uss)
            if kind == TRAIN_WORKER:
                train_max = max(train_max, uss)
            else:
                data_max, data_sum = max(data_max, uss), data_sum + uss
        for key, value in ((f"{TRAIN_WORKER}_max", train_max), (f"{DATA}_max", data_max), (f"{DATA}_sum", data_sum),
                           ("object_store", self._object_store_bytes())):
            self._peaks[key] = max(self._peaks[key], value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample must not end the sampling
                pass

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the peaks (bytes), and the largest process under each title counted (bytes)."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return {**self._peaks, "titles": self._titles}


class _DriverSampler(threading.Thread):
    """The driver's own peak USS, sampled in a thread of the driver (it may run on no node of the cluster)."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s, self.peak, self.stopped = interval_s, 0, threading.Event()
        self.process = psutil.Process(os.getpid())

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, _uss(self.process))
            if self.stopped.wait(self.interval_s):
                return


@dataclass
class MemoryPeaks:
    """Peak memory by kind of process while a run goes, on every node: `with MemoryPeaks() as peaks: ...`.

    Afterwards, `peaks.mib` holds, in MiB: `driver` (this process), `train_worker_max` (the largest Ray Train
    worker), `data_max` (the largest Ray Data process) and `data_sum` (Ray Data's processes together), and
    `object_store` (bytes in the object stores). Each node reports its own peaks; across nodes the maxima are
    maxima and the sums add up each node's peak (the nodes peak at different moments: an upper bound).
    """

    interval_s: float = 0.25

    def __enter__(self) -> MemoryPeaks:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(num_cpus=0)(MemorySampler)  # no CPU: it must not take one from training or Ray Data
        self._samplers = [
            actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            .remote(node["NodeManagerAddress"], node["NodeManagerPort"], self.interval_s)
            for node in ray.nodes() if node["Alive"]
        ]
        self._driver = _DriverSampler(self.interval_s)
        self._driver.start()
        self.mib: dict[str, float] = {}
        self.titles: dict[str, float] = {}  # the largest process under each title counted, MiB
        return self

    def __exit__(self, *exc_info) -> None:
        self._driver.stopped.set()
        self._driver.join()
        per_node = ray.get([sampler.stop.remote() for sampler in self._samplers], timeout=60)
        for sampler in self._samplers:
            ray.kill(sampler)
        for node in per_node:
            for title, uss in node.pop("titles").items():
                self.titles[title] = max(self.titles.get(title, 0.0), round(uss / MIB, 1))
        self.mib = merge_peaks(self._driver.peak, per_node)


def merge_peaks(driver_bytes: int, per_node: list[dict[str, int]]) -> dict[str, float]:
    """The peaks of all nodes together, in MiB: maxima of the `_max` keys, sums of the others."""
    merged = {"driver": driver_bytes}
    for key in (f"{TRAIN_WORKER}_max", f"{DATA}_max", f"{DATA}_sum", "object_store"):
        values = [node[key] for node in per_node]
        merged[key] = max(values, default=0) if key.endswith("_max") else sum(values)
    return {key: round(value / MIB, 1) for key, value in merged.items()}

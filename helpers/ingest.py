"""Lesson 03's Ray Data ingest: MNIST as Parquet, preprocessing on the CPU pool, shards into training.

Kept here once, so the notebook (which shows it), the lessons after it and `train_ray_ddp_with_ray_data.py`
(which trains with lesson 05's resumable version of the loop) use the same data pipeline. The numbered comments in
`train_loop_per_worker` mark what changed from lesson 02's loop.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import ray.data
import ray.train
import ray.train.torch
import torch
from ray.data.datasource import FilenameProvider
from ray.data.extensions import ArrowTensorArray
from torch import nn

from helpers import storage
from helpers.cluster import check_data_resources, check_resources, course_scaling_config
from helpers.config import CourseConfig
from helpers.data import check_parquet_copy, load_mnist, mnist_transform
from helpers.data_stats import operator_times as operator_times  # lesson 03 imports it from here
from helpers.models import resnet18_mnist
from helpers.session import logger_level
from helpers.sizes import SIZES
from helpers.training import seed_everything

#: Rows per split in smoke mode (COURSE_SMOKE_TEST=1): 15 steps of 128 images, 1000 to validate.
SMOKE_ROWS = SIZES["smoke"]["mnist_rows"]
#: Equal blocks a materialized dataset is cut into: Ray Train gives each of 1, 2, 4 or 8 workers whole
#: blocks. Otherwise, every epoch, `streaming_split(equal=True)` cuts a block in a Ray task, which on
#: a small machine starts a new worker process first (about 2 s per epoch and dataset on 2 cores).
NUM_BLOCKS = 8
#: Rows each worker shuffles at a time (`local_shuffle_buffer_size`): all of its shard of MNIST's 60,000 training
#: rows with 2 workers. Larger buffers mix more, and cost memory and a longer wait for the first batch.
SHUFFLE_BUFFER_ROWS = 30_000
#: What `iter_torch_batches` turns each column into.
DTYPES = {"image": torch.float32, "label": torch.int64}
#: Lesson 01's torchvision transform, built once per process (not once per row).
_TRANSFORM = mnist_transform()


@contextlib.contextmanager
def quiet_cpu_race_warning():
    """Ray Data warns "no available CPUs" when a job starts while the previous job's tasks still hold
    theirs. Between two jobs of the same process that is a race, not a hang: keep that warning out."""
    with logger_level("ray.data.dataset", logging.ERROR):
        yield


#: Written last into each split's folder, as Hadoop and Spark do: the split's files are all there. (Ray Data reads only
#: the `.parquet` files.) The copy as a whole counts once `storage.COPY_MARKER`, written after both splits, is there.
COMPLETE_MARKER = "_SUCCESS"
#: Where the copies of MNIST as Parquet live: `<storage_path>/datasets/mnist-parquet/<copy>/{train,test}/`.
PARQUET_FOLDER = ("datasets", "mnist-parquet")


def _numbered_files() -> FilenameProvider:
    """`part-00000-0.parquet`, ... (Ray Data adds the `-0`): short names, the same in every copy, instead of Ray
    Data's random ones.

    The class is defined in here so that Ray pickles it by value: the write tasks then need not import this module
    (it imports torch and Ray Train: 3.9 s and 0.9 GiB resident in a new process, measured on the 2-core machine).
    """
    class NumberedFiles(FilenameProvider):
        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"part-{task_index:05d}.parquet"

    return NumberedFiles(file_format="parquet")


def write_mnist_parquet(data_dir: str | Path, storage_path: str, num_files: int = 8) -> str:
    """Write MNIST (uint8 images, int64 labels) as Parquet under `storage_path`, once; return the folder.

    The folder holds `train/` and `test/`, each with `num_files` Parquet files and a `_SUCCESS` marker. It is a copy
    under `<storage_path>/datasets/mnist-parquet/`, made with `storage.write_once`: on a local or shared folder and
    on a bucket (s3://, gs://), runs that prepare MNIST at the same time each get a complete copy, and none writes
    over a copy another run reads. A copy interrupted half-way, or written with another `num_files`, is ignored
    (`storage.write_once` says how to remove leftovers).
    """
    def write(copy: str) -> dict:
        rows = {}
        for split, train in (("train", True), ("test", False)):
            target = storage.join(copy, split)
            mnist = load_mnist(data_dir, train=train)
            table = pa.table({"image": ArrowTensorArray.from_numpy(mnist.data.numpy()),
                              "label": mnist.targets.numpy().astype(np.int64)})
            dataset = ray.data.from_arrow(table, override_num_blocks=num_files)
            with quiet_cpu_race_warning():  # OVERWRITE, as Ray Data requires for fixed names: the folder is new, ours
                dataset.write_parquet(target, filename_provider=_numbered_files(), mode=ray.data.SaveMode.OVERWRITE)
            storage.write_text(storage.join(target, COMPLETE_MARKER), "")
            rows[split] = len(table)
        return {"rows": rows, "num_files": num_files}

    copy = storage.write_once(storage.join(storage_path, *PARQUET_FOLDER), write,
                              accept=lambda marker: marker.get("num_files") == num_files)
    check_parquet_copy(copy, "MNIST as Parquet")  # the files' ends only: a damaged copy is named before it is read
    return copy


def transform_row(row: dict) -> dict:
    """Per row: lesson 01's torchvision transform, one Python call per image."""
    image = np.array(row["image"])  # a writable copy: Ray Data hands out read-only views of its buffers
    row["image"] = _TRANSFORM(image).numpy()  # uint8 (28, 28) -> float32 (1, 28, 28) in [-1, 1]
    return row


def normalize_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per batch: the same arithmetic as `transform_row`, one NumPy expression for many images."""
    images = batch["image"].astype(np.float32) / 255.0
    batch["image"] = ((images - 0.5) / 0.5)[:, np.newaxis]  # (N, 28, 28) -> (N, 1, 28, 28)
    return batch


@contextlib.contextmanager
def in_file_order():
    """Datasets created inside keep the files' row order. By default Ray Data passes blocks on in the order
    their tasks finish, so `limit(n)` keeps whichever n rows come first: other rows in every session."""
    options = ray.data.DataContext.get_current().execution_options  # copied by each new dataset
    before, options.preserve_order = options.preserve_order, True
    try:
        yield
    finally:
        options.preserve_order = before  # training's ingest (read at fit()) streams in any order


def mnist_datasets(parquet_root: str, max_rows: dict[str, int] | None = None, materialize: bool = True) -> dict:
    """The datasets lesson 03 hands to Ray Train: read the Parquet files, normalise, keep the result.

    `max_rows` caps the rows of "train" and/or "valid" (smoke mode passes SMOKE_ROWS): the first rows.
    """
    datasets = {}
    for name, split in (("train", "train"), ("valid", "test")):
        with in_file_order():  # [1] the same rows in the same blocks in every session
            dataset = ray.data.read_parquet(storage.join(parquet_root, split))  # [2] read tasks: how many, see stats()
        if max_rows and name in max_rows:
            dataset = dataset.limit(max_rows[name])
        dataset = dataset.map_batches(normalize_batch)  # [3] vectorised preprocessing, on the CPU pool
        if materialize:  # [4] run once, keep in memory, in blocks Ray Train can hand out whole
            with quiet_cpu_race_warning():  # the previous split's tasks may still hold the CPUs: no hang
                dataset = dataset.repartition(NUM_BLOCKS).materialize()
        datasets[name] = dataset
    return datasets


def prepare_ray_data_training(cfg: CourseConfig, max_rows: dict[str, int] | None = None):
    """What lesson 03 did before `fit()`, in one call for the lessons after it and the script.

    Takes lesson 02's `ScalingConfig` from the configuration and checks it first (an impossible request
    fails in seconds, before any data work), writes (or finds) MNIST as Parquet under the storage path,
    builds the materialized datasets, and checks that Ray Data has the CPUs they still need.
    Returns `(parquet_root, datasets, scaling)`.
    """
    scaling = course_scaling_config(cfg)
    check_resources(scaling)
    parquet_root = write_mnist_parquet(cfg.data_dir, cfg.storage_path)
    datasets = mnist_datasets(parquet_root, max_rows)
    check_data_resources(scaling, datasets)
    return parquet_root, datasets, scaling


@torch.no_grad()
def evaluate_shard(model: nn.Module, shard, batch_size: int) -> dict[str, float]:
    """Loss and accuracy over every worker's shard: each worker counts its own, then they add up."""
    model.eval()
    if torch.distributed.is_initialized():  # BatchNorm statistics drift apart between workers during training:
        for buffer in model.buffers():  # evaluate rank 0's, the ones its checkpoint holds, on every worker
            torch.distributed.broadcast(buffer, src=0)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    device = ray.train.torch.get_device()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for batch in shard.iter_torch_batches(batch_size=batch_size, dtypes=DTYPES, device=device):
        logits = model(batch["image"])
        totals += torch.tensor([loss_fn(logits, batch["label"]).item(),
                                (logits.argmax(dim=1) == batch["label"]).sum().item(),
                                len(batch["label"])], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)  # the sums over all shards, on every worker
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count}


def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray Train worker: lesson 02's loop, fed by Ray Data shards instead of a DataLoader."""
    seed_everything(config["seed"])
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    batch_size_per_worker = config["global_batch_size"] // world_size

    train_shard = ray.train.get_dataset_shard("train")  # [1] this worker's part of each dataset
    valid_shard = ray.train.get_dataset_shard("valid")  # [1]
    model = ray.train.torch.prepare_model(resnet18_mnist())  # as in lesson 02; no prepare_data_loader
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(config["num_epochs"]):
        model.train()
        started_at, total_loss, num_images = time.time(), 0.0, 0
        batches = train_shard.iter_torch_batches(  # [2] a new pass over the shard every epoch
            batch_size=batch_size_per_worker,
            dtypes=DTYPES,  # [3] NumPy columns -> torch tensors of these types
            device=ray.train.torch.get_device(),  # [4] ... already on this worker's device
            prefetch_batches=config["prefetch_batches"],  # [5] prepare the next batches while training
            local_shuffle_buffer_size=config["shuffle_buffer"],  # [6] shuffle within this many rows ...
            local_shuffle_seed=config["seed"] + epoch,  # [7] ... in a new, repeatable order every epoch
        )
        for batch in batches:  # [8] a dict of tensors: batch["image"], batch["label"]
            optimizer.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch["label"])
            num_images += len(batch["label"])
        epoch_s = time.time() - started_at

        plain_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        valid = evaluate_shard(plain_model, valid_shard, batch_size=512)  # [9] every worker, its shard; then all-reduce
        metrics = {"epoch": epoch, "train_loss": total_loss / num_images, "test_loss": valid["loss"],
                   "test_acc": valid["accuracy"], "epoch_s": epoch_s,
                   "images_per_s": num_images * world_size / epoch_s, "epoch_started_at": started_at,
                   "node_id": ray.get_runtime_context().get_node_id()}
        with tempfile.TemporaryDirectory() as checkpoint_dir:
            checkpoint = None
            if rank == 0:  # as in lesson 02: rank 0 writes, every worker reports
                torch.save(plain_model.state_dict(), Path(checkpoint_dir) / "model.pt")
                checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
            ray.train.report(metrics, checkpoint=checkpoint)

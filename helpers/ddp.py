"""Lesson 02's training loop: lesson 01's loop, data-parallel under Ray Train.

Lesson 02 defines the same function in a cell the learner edits; this copy is the one `train_ray_ddp.py`
and later lessons import, and tests/test_lesson_code.py fails when the two differ.
`config` holds num_epochs, global_batch_size, lr, seed, max_steps_per_epoch, max_test_batches and data_dir.
The numbered comments mark what changed from lesson 01's `train_single_device`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers.data import load_mnist
from helpers.models import resnet18_mnist
from helpers.training import evaluate, loader_workers, seed_everything


def train_loop_per_worker(config: dict) -> dict:
    """Runs on every Ray Train worker; `config` is the trainer's `train_loop_config`."""
    seed_everything(config["seed"])
    context = ray.train.get_context()  # [1] this worker's place in the group
    world_size, rank = context.get_world_size(), context.get_world_rank()
    batch_size_per_worker = config["global_batch_size"] // world_size  # [1] split the global batch

    # Load data and build the model *inside* the function: every worker makes its own.
    processes = loader_workers()  # [2] DataLoader processes: the CPUs Ray reserved for this worker, less one
    train_loader = DataLoader(load_mnist(config["data_dir"], train=True), batch_size=batch_size_per_worker,
                              shuffle=True, num_workers=processes)
    test_loader = DataLoader(load_mnist(config["data_dir"], train=False), batch_size=512, num_workers=processes)
    train_loader = ray.train.torch.prepare_data_loader(train_loader)  # [2] shard + move batches to the device
    test_loader = ray.train.torch.prepare_data_loader(test_loader, add_dist_sampler=False)  # [2] no shard: all of it
    model = ray.train.torch.prepare_model(resnet18_mnist())  # [3] move to the device, wrap in DDP
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()
    train_s, images_seen = 0.0, 0  # [4] no run_dir, no metrics.csv: ray.train.report stores them

    for epoch in range(config["num_epochs"]):
        if world_size > 1:
            train_loader.sampler.set_epoch(epoch)  # [5] a new shuffle every epoch
        model.train()
        started_at, total_loss, num_images = time.time(), 0.0, 0  # [6] wall-clock start, kept in the metrics
        for step, (images, labels) in enumerate(train_loader):  # [7] train_one_epoch's steps, no .to(device)
            if config["max_steps_per_epoch"] is not None and step >= config["max_steps_per_epoch"]:
                break
            optimizer.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()  # [8] DDP all-reduces the gradients here
            optimizer.step()
            total_loss += loss.item() * len(labels)
            num_images += len(labels)
        epoch_s = time.time() - started_at

        plain_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # [9]
        test = evaluate(plain_model, test_loader, ray.train.torch.get_device(), config["max_test_batches"])  # [9] no DDP
        # [10] report() keeps rank 0's metrics: first add up every worker's loss and images
        sums = torch.tensor([total_loss, num_images], dtype=torch.float64, device=ray.train.torch.get_device())
        if world_size > 1:
            torch.distributed.all_reduce(sums)  # [10] every worker gets the sums over all workers
        all_loss, all_images = sums.tolist()
        train_s, images_seen = train_s + epoch_s, images_seen + all_images
        metrics = {"epoch": epoch, "train_loss": all_loss / all_images, "test_loss": test["loss"],
                   "test_acc": test["accuracy"], "epoch_s": epoch_s,
                   "images_per_s": all_images / epoch_s,  # [10] both over all workers' images
                   "epoch_started_at": started_at,  # [10] when this epoch began
                   "node_id": ray.get_runtime_context().get_node_id()}  # [10] the node this worker runs on
        if rank == 0:  # [10] one progress line per epoch, from one worker
            print(f"epoch {epoch + 1}/{config['num_epochs']}: train_loss={metrics['train_loss']:.4f}, "
                  f"test_acc={metrics['test_acc']:.2%}")
        with tempfile.TemporaryDirectory() as checkpoint_dir:
            checkpoint = None
            if rank == 0:  # [11] one copy of the weights is enough: rank 0 writes it
                torch.save(plain_model.state_dict(), Path(checkpoint_dir) / "model.pt")
                checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
            # [12] every worker reports, with or without a checkpoint: it is a barrier
            ray.train.report(metrics, checkpoint=checkpoint)
    # [13] what rank 0 returns becomes Result.return_value: here, lesson 01's throughput over all epochs
    return {"train_s": train_s, "images_per_s": images_seen / train_s}

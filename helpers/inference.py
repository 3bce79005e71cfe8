"""Lesson 04's batch inference: a trained checkpoint applied to a Ray Data dataset by a pool of actors."""

from __future__ import annotations

import os

import numpy as np
import torch
from ray.train import Checkpoint

from helpers.models import resnet18_mnist
from helpers.training import has_a_gpu


def load_model(checkpoint: Checkpoint, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A ResNet-18 with the weights of a course checkpoint (`model.pt`), in eval mode on `device`.

    `checkpoint.as_directory()` is the folder itself on a local or shared filesystem, and a temporary
    download of it when the checkpoint lives in object storage (s3://, gs://).
    """
    model = resnet18_mnist()
    with checkpoint.as_directory() as checkpoint_dir:
        model.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt"), map_location="cpu"))
    return model.to(device).eval()


class MNISTPredictor:
    """Adds a `prediction` column to batches of normalised MNIST images.

    Ray Data creates one instance per actor of the pool and calls it once per batch: the model is
    loaded once per actor, in `__init__`, not once per batch.
    """

    def __init__(self, checkpoint: Checkpoint):
        self.device = torch.device("cuda" if has_a_gpu() else "cpu")  # the GPU Ray gave this actor, if any
        self.model = load_model(checkpoint, self.device)

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = torch.tensor(batch["image"], device=self.device)  # a copy: Ray Data's arrays are read-only
        batch["prediction"] = self.model(images).argmax(dim=1).cpu().numpy()
        return batch


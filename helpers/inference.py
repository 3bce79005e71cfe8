"""Lesson 04's batch inference: a trained checkpoint applied to a Ray Data dataset by a pool of actors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from helpers.models import resnet18_mnist


def load_model(checkpoint_dir: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A ResNet-18 with the weights of a course checkpoint (`model.pt`), in eval mode on `device`."""
    model = resnet18_mnist()
    model.load_state_dict(torch.load(Path(checkpoint_dir) / "model.pt", map_location="cpu"))
    return model.to(device).eval()


class MNISTPredictor:
    """Adds a `prediction` column to batches of normalised MNIST images.

    Ray Data creates one instance per actor of the pool and calls it once per batch: the model is
    loaded once per actor, in `__init__`, not once per batch.
    """

    def __init__(self, checkpoint_dir: str):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a GPU when the actor has one
        self.model = load_model(checkpoint_dir, self.device)

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = torch.tensor(batch["image"], device=self.device)  # a copy: Ray Data's arrays are read-only
        batch["prediction"] = self.model(images).argmax(dim=1).cpu().numpy()
        return batch

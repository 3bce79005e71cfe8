"""Figures the lessons show: predictions and training curves."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure


def predictions_grid(
    images: torch.Tensor,
    labels: Sequence[int],
    predictions: Sequence[int],
    ncols: int = 8,
    title: str = "Predictions (green: right, red: wrong)",
) -> Figure:
    """A grid of images, each titled 'pred (true)' in green when right and red when wrong."""
    count = len(images)
    nrows = max(1, -(-count // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(1.4 * ncols, 1.6 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label, pred in zip(axes.flat, images, labels, predictions):
        ax.imshow(torch.as_tensor(image).squeeze().cpu().numpy(), cmap="gray")
        ax.set_title(f"{int(pred)} ({int(label)})", color="green" if int(pred) == int(label) else "red", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)  # the notebook shows the returned figure once; pyplot need not keep it
    return fig


def training_curves(metrics: pd.DataFrame, x: str = "epoch") -> Figure:
    """Loss (left) and accuracy (right) per `x` from a metrics table (e.g. the lesson's CSV).

    Plots every column whose name contains 'loss' on the left and 'acc' on the right.
    """
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    for column in metrics.columns:
        if "loss" in column:
            ax_loss.plot(metrics[x], metrics[column], marker="o", label=column)
        elif "acc" in column:
            ax_acc.plot(metrics[x], metrics[column], marker="o", label=column)
    for ax, name in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set_xlabel(x)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig

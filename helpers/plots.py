"""Figures the lessons show: predictions, training curves, spreads and the parts of a run's wall time."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


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
        ax.imshow(image.squeeze().cpu().numpy() if torch.is_tensor(image) else np.squeeze(image), cmap="gray")
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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        ax.set_xlabel(x)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def spread_bars(figures: dict[str, dict], ylabel: str) -> Figure:
    """One bar per figure at its median, with a whisker from its min to its max (a benchmark report's spreads)."""
    names = list(figures)
    medians = np.array([figures[name]["median"] for name in names])
    whiskers = np.array([[figures[name]["median"] - figures[name]["min"] for name in names],
                         [figures[name]["max"] - figures[name]["median"] for name in names]])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 3.8))
    ax.bar(range(len(names)), medians, yerr=whiskers, capsize=4, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig


def confusion_matrix(labels: Sequence[int], predictions: Sequence[int], num_classes: int = 10) -> Figure:
    """A confusion matrix: rows are the true classes, columns the predicted ones, each cell a count."""
    pairs = torch.as_tensor(labels, dtype=torch.int64) * num_classes + torch.as_tensor(predictions, dtype=torch.int64)
    counts = torch.bincount(pairs, minlength=num_classes * num_classes).reshape(num_classes, num_classes)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.imshow(counts.numpy(), cmap="Blues")
    for row, col in torch.nonzero(counts).tolist():
        count = counts[row, col].item()
        ax.text(col, row, str(count), ha="center", va="center", fontsize=7,
                color="white" if count > counts.max().item() / 2 else "black")
    ax.set_xticks(range(num_classes))
    ax.set_yticks(range(num_classes))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = counts.diag().sum().item() / max(1, counts.sum().item())
    ax.set_title(f"Confusion matrix ({counts.sum().item()} images, accuracy {accuracy:.2%})")
    fig.tight_layout()
    plt.close(fig)
    return fig


def streaming_scaling(reports: list[dict]) -> Figure:
    """Training time (left) and peak memory per kind of process (right) against the data size, from
    `train_streaming.py`'s JSON reports, one or more runs per size: the median run, whiskers from the smallest to the
    largest. Time should grow with the size, memory should stay flat. When the runs sized the object store
    (`--object-store-mib`), a dashed line marks its capacity."""
    sizes = sorted({report["size_gb_requested"] for report in reports})
    runs = [[report for report in reports if report["size_gb_requested"] == size] for size in sizes]

    def plot(ax, figure, label: str) -> None:
        values = [[figure(report) for report in size_runs] for size_runs in runs]
        medians = np.array([np.median(size_values) for size_values in values])
        spread = [medians - [min(v) for v in values], [max(v) for v in values] - medians]
        ax.errorbar(sizes, medians, yerr=spread, marker="o", capsize=3, label=label)

    fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(10, 3.5))
    plot(ax_time, lambda report: report["fit_s"], "training (fit)")
    plot(ax_time, lambda report: sum(report["epoch_s"]), "the epochs alone")
    ax_time.set_ylabel("time (s)")
    for kind in reports[0]["peak_mib"]:
        plot(ax_memory, lambda report, kind=kind: report["peak_mib"][kind], kind)
    sized = {report["object_store"]["capacity_mib"] for report in reports
             if report.get("stream", {}).get("object_store_mib_requested") is not None}
    if len(sized) == 1:
        ax_memory.axhline(sized.pop(), linestyle="--", color="gray", label="object store capacity")
    ax_memory.set_ylabel("peak memory (MiB)")
    for ax in (ax_time, ax_memory):
        ax.set_xlabel("data size (GB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def stacked_parts(table: pd.DataFrame, parts: Sequence[str], xlabel: str) -> Figure:
    """One horizontal bar per row of `table`, split into the seconds of its `parts` columns, in order."""
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.55 * len(table)))
    left = np.zeros(len(table))
    for part in parts:
        seconds = table[part].astype(float).to_numpy()
        ax.barh(table.index, seconds, left=left, label=part.removesuffix(" (s)"))
        left += seconds
    ax.invert_yaxis()  # the first row on top, as in the table
    ax.set_xlabel(xlabel)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(parts), frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


def trial_curves(history: pd.DataFrame, metric: str = "test_acc", x: str = "epoch", best: str | None = None) -> Figure:
    """`metric` per `x` for every trial of a search (`history`: one row per result, with `trial_id`), one line per
    trial; trials that stopped before the longest ones end in a cross, and the `best` trial's line is the thickest."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    last = history.groupby("trial_id")[x].max()
    for trial_id, rows in history.groupby("trial_id", sort=True):
        rows = rows.sort_values(x)
        stopped = last[trial_id] < last.max()
        line, = ax.plot(rows[x], rows[metric], marker="o", markersize=3, linewidth=3 if trial_id == best else 1.2,
                        label=f"{trial_id}{' (best)' if trial_id == best else ''}{' (stopped)' if stopped else ''}")
        if stopped:
            ax.plot(rows[x].iloc[-1], rows[metric].iloc[-1], marker="x", markersize=10, color=line.get_color())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig

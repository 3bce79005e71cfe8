"""helpers.models, helpers.plots, helpers.training and helpers.inference on small inputs."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure
from ray.train import Checkpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.inference import MNISTPredictor, load_model
from helpers.models import resnet18_mnist
from helpers.plots import confusion_matrix, predictions_grid, spread_bars, training_curves
from helpers.training import evaluate, predict, seed_everything, train_for


@pytest.mark.parametrize("batch", [1, 5])
def test_resnet18_mnist_shapes(batch):
    model = resnet18_mnist().eval()  # eval mode: batch norm accepts a batch of one
    assert model.conv1.in_channels == 1
    assert model(torch.zeros(batch, 1, 28, 28)).shape == (batch, 10)
    assert sum(p.numel() for p in model.parameters()) == 11_175_370


def test_resnet18_mnist_rejects_colour_images():
    with pytest.raises(RuntimeError):
        resnet18_mnist()(torch.zeros(1, 3, 28, 28))


class _FixedClassifier(nn.Module):
    """Predicts class 1 for positive inputs and class 0 otherwise."""

    def forward(self, x):
        positive = (x.flatten(1).sum(dim=1) > 0).float()
        return torch.stack([1 - positive, positive], dim=1) * 10


def test_evaluate_and_predict():
    images = torch.tensor([[1.0], [2.0], [-1.0], [-3.0]])
    labels = torch.tensor([1, 0, 0, 0])  # the second one is wrong
    metrics = evaluate(_FixedClassifier(), DataLoader(TensorDataset(images, labels), batch_size=3), "cpu")
    assert metrics["accuracy"] == pytest.approx(0.75)
    assert metrics["loss"] > 0
    assert predict(_FixedClassifier(), images).tolist() == [1, 1, 0, 0]


def test_seed_everything_repeats_random_draws():
    seed_everything(3)
    first = torch.rand(3)
    seed_everything(3)
    assert torch.equal(first, torch.rand(3))


def test_predictions_grid_marks_right_and_wrong():
    fig = predictions_grid(torch.zeros(10, 1, 28, 28), labels=[1] * 10, predictions=[1] * 9 + [7], ncols=4)
    assert isinstance(fig, Figure)
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert len(fig.axes) == 12 and len(titled) == 10
    assert titled[-1].get_title() == "7 (1)" and titled[-1].title.get_color() == "red"
    assert titled[0].title.get_color() == "green"


def test_training_curves_plots_losses_and_accuracies():
    metrics = pd.DataFrame({"epoch": [0, 1], "train_loss": [1.0, 0.5], "test_loss": [1.1, 0.6],
                            "test_acc": [0.8, 0.9], "epoch_s": [3.0, 3.0]})
    fig = training_curves(metrics)
    assert isinstance(fig, Figure)
    loss_ax, acc_ax = fig.axes
    assert [line.get_label() for line in loss_ax.lines] == ["train_loss", "test_loss"]
    assert [line.get_label() for line in acc_ax.lines] == ["test_acc"]


def test_spread_bars_draw_medians_with_min_max_whiskers():
    figures = {"a": {"median": 10.0, "min": 8.0, "max": 13.0}, "b": {"median": 5.0, "min": 5.0, "max": 6.0}}
    ax = spread_bars(figures, "images/s").axes[0]
    assert [bar.get_height() for bar in ax.patches] == [10.0, 5.0]
    segments = ax.collections[0].get_segments()  # the whiskers, one per bar
    assert [(seg[0][1], seg[1][1]) for seg in segments] == [(8.0, 13.0), (5.0, 6.0)]
    assert [label.get_text() for label in ax.get_xticklabels()] == ["a", "b"]


def test_confusion_matrix_counts_every_pair():
    fig = confusion_matrix([0, 0, 1, 2, 2, 2], [0, 1, 1, 2, 2, 0], num_classes=3)
    counts = fig.axes[0].images[0].get_array()
    assert counts.tolist() == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    assert "6 images, accuracy 66.67%" in fig.axes[0].get_title()


def test_the_predictor_loads_a_checkpoint_once_and_labels_batches(tmp_path):
    seed_everything(0)
    model = resnet18_mnist().eval()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    images = torch.randn(6, 1, 28, 28)
    checkpoint = Checkpoint.from_directory(str(tmp_path))
    predictor = MNISTPredictor(checkpoint)
    batch = predictor({"image": images.numpy(), "label": torch.arange(6).numpy()})
    assert batch["prediction"].tolist() == model(images).argmax(dim=1).tolist()
    assert list(batch) == ["image", "label", "prediction"]
    assert not load_model(checkpoint).training, "a loaded model is in eval mode"


def test_train_for_trains_until_its_time_is_up_and_not_at_all_for_zero_seconds():
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    assert train_for(model, optimizer, seconds=0.0) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    started = time.perf_counter()
    steps = train_for(model, optimizer, seconds=0.3)
    assert time.perf_counter() - started >= 0.3 and steps >= 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the steps changed the weights"

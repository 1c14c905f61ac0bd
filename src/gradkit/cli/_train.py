"""The demo's data, model and training loop: a small CNN on scikit-learn's bundled digits.

The digits (1797 grey 8x8 images, values 0..16, ten classes) ship inside scikit-learn, so
nothing is downloaded. Shapes: images ``[N, 1, 8, 8]`` scaled to [0, 1], labels ``[N]``.
Everything random (split, subsets, initialization, batch order) follows one seed; the loop
reports progress through a callback and never prints.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Digits",
    "EpochStats",
    "TrainResult",
    "bundled_digits",
    "evaluate",
    "load_digits",
    "make_model",
    "stratified_split",
    "train",
]


@dataclass(frozen=True)
class Digits:
    """A train/test split of the digits: images ``[N, 1, 8, 8]`` float32, labels ``[N]``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def sizes(self) -> tuple[int, int]:
        """``(train examples, test examples)``."""
        return len(self.y_train), len(self.y_test)


def bundled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits: values ``[1797, 64]`` float32 in 0..16, labels ``[1797]``.

    Read from scikit-learn's own data file (``sklearn/datasets/data/digits.csv.gz``, what
    ``sklearn.datasets.load_digits`` reads) without importing scikit-learn, which takes about
    a second; falls back to ``load_digits`` if the file is not where it has always been.
    """
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return torch.tensor(table[:, :-1], dtype=torch.float32), torch.tensor(
                table[:, -1].astype(np.int64)
            )
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return torch.tensor(bunch.data, dtype=torch.float32), torch.tensor(bunch.target)


def stratified_split(
    y: torch.Tensor, test_fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train indices, test indices)``, each in random order, with ``round(test_fraction *
    n_c)`` of the ``n_c`` examples of every class ``c`` in the test part.

    Examples:
        >>> y = torch.tensor([0] * 8 + [1] * 4)
        >>> tr, te = stratified_split(y, 0.25, torch.Generator().manual_seed(0))
        >>> sorted(y[te].tolist()), len(tr)
        ([0, 0, 1], 9)
    """
    order = torch.randperm(len(y), generator=generator)
    test = torch.zeros(len(y), dtype=torch.bool)
    for c in torch.unique(y):
        members = order[y[order] == c]
        test[members[: round(test_fraction * len(members))]] = True
    return order[~test[order]], order[test[order]]


def load_digits(
    seed: int,
    *,
    test_fraction: float = 0.25,
    max_train: int | None = None,
    max_test: int | None = None,
) -> Digits:
    """Load the bundled digits and split them, stratified by class, with ``seed``.

    ``max_train`` / ``max_test`` keep the first examples of each (shuffled) split.
    """
    values, y = bundled_digits()
    x = values.reshape(-1, 1, 8, 8) / 16.0
    tr, te = stratified_split(y, test_fraction, torch.Generator().manual_seed(seed))
    tr, te = tr[:max_train], te[:max_test]
    return Digits(x[tr], y[tr], x[te], y[te])


def make_model(num_classes: int = 10) -> nn.Sequential:
    """The demo CNN for ``[N, 1, 8, 8]`` inputs: two 3x3 convolutions, two linear layers.

    Shapes: ``[N,1,8,8] -> conv -> [N,8,6,6] -> conv -> [N,16,4,4] -> [N,256] -> [N,64]
    -> [N,num_classes]`` (18,346 parameters for ten classes).

    Examples:
        >>> import torch
        >>> make_model()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


@dataclass(frozen=True)
class EpochStats:
    """Averages over one epoch (train: running, in training mode) and the test set after it."""

    epoch: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float


@dataclass
class TrainResult:
    """What :func:`train` returns: per-epoch stats and the loss of every step."""

    epochs: list[EpochStats] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    steps_per_epoch: int = 0

    @property
    def final(self) -> EpochStats:
        """The last epoch's stats."""
        return self.epochs[-1]


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 512
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)`` (in eval mode)."""
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        total_loss += F.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(1) == target).sum())
    model.train(was_training)
    return total_loss / len(y), correct / len(y)


def train(
    model: nn.Module,
    data: Digits,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
    step_context: Callable[[int], AbstractContextManager[Any]] | None = None,
) -> TrainResult:
    """Train with Adam on mean cross-entropy, the learning rate decaying from ``lr`` to 0
    along a half cosine over all steps; shuffles with ``generator``.

    Args:
        model: the network (trained in place).
        data: the split; the test part is evaluated after every epoch.
        epochs: passes over the training set.
        batch_size: examples per step (the last batch of an epoch may be smaller).
        lr: Adam's initial learning rate.
        generator: the source of the batch order.
        on_step: called after each step with ``(global step, loss)`` (e.g. a progress bar).
        step_context: called with the step number (from 1) before each step; the forward and
            backward run inside the context it returns (e.g. ``gradkit.per_example.track``).

    Raises:
        FloatingPointError: the loss became NaN or infinite (lower the learning rate).
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    n = len(data.y_train)
    result = TrainResult(steps_per_epoch=math.ceil(n / batch_size))
    total = epochs * result.steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * s / total))
    )
    step = 0
    for epoch in range(1, epochs + 1):
        start_time = time.perf_counter()
        model.train()
        order = torch.randperm(n, generator=generator)
        loss_sum, correct = 0.0, 0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            x, y = data.x_train[idx], data.y_train[idx]
            optimizer.zero_grad(set_to_none=True)
            with step_context(step + 1) if step_context is not None else nullcontext():
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"train: the loss is {loss.item()} at step {step + 1}; "
                        "lower the learning rate"
                    )
                loss.backward()
            optimizer.step()
            schedule.step()
            value = loss.item()
            loss_sum += value * len(idx)
            correct += int((logits.detach().argmax(1) == y).sum())
            result.step_losses.append(value)
            step += 1
            if on_step is not None:
                on_step(step, value)
        test_loss, test_acc = evaluate(model, data.x_test, data.y_test)
        result.epochs.append(
            EpochStats(
                epoch,
                loss_sum / n,
                correct / n,
                test_loss,
                test_acc,
                time.perf_counter() - start_time,
            )
        )
    model.eval()
    return result

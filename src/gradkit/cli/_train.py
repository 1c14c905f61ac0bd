"""The demo's training loop for the digits CNN (:mod:`gradkit._digits`).

Everything random (initialization, batch order) follows one seed; the loop reports progress
through a callback and never prints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradkit._digits import Digits

__all__ = ["EpochStats", "TrainResult", "evaluate", "train"]


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
    on_step: Callable[[int, Mapping[str, float]], None] | None = None,
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
        on_step: called after each step with ``(global step, {"loss": loss})`` (e.g. a
            progress bar).
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
                on_step(step, {"loss": value})
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

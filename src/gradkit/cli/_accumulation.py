"""The demo's "Exact accumulation" section: batch 256 as 8 exact micro-batches of 32 (the same
gradient as one pass), its training compared with batch 32, and an adaptive number of
micro-batches driven by the gradient noise scale."""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._digits import Digits
from gradkit.accumulate import Accumulator, AdaptiveBatchSize
from gradkit.cli._train import evaluate
from gradkit.per_example import track

__all__ = ["accumulation_markdown"]


def _loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def exactness(model: nn.Module, data: Digits, examples: int, micro: int) -> dict[str, float]:
    """Max |difference| between the gradient of ``examples`` examples in one pass and as
    exact micro-batches of ``micro``."""
    net = copy.deepcopy(model)
    batch = (data.x_train[:examples], data.y_train[:examples])
    one = torch.autograd.grad(F.cross_entropy(net(batch[0]), batch[1]), list(net.parameters()))
    got: list[torch.Tensor] = []
    keep = torch.optim.SGD(net.parameters(), lr=0.0)
    keep.register_step_pre_hook(
        lambda *_: got.extend(p.grad.clone() for p in net.parameters() if p.grad is not None)
    )
    acc = Accumulator(net, keep)
    for mb in acc.split(batch, micro_batch_size=micro):
        with acc.micro_step():
            acc.backward(_loss_sum(net, mb))
    acc.step()
    naive = [torch.zeros_like(g) for g in one]
    for xb, yb in zip(
        batch[0].split(micro * 3 // 2), batch[1].split(micro * 3 // 2), strict=True
    ):  # per-micro-batch means / k, unequal sizes
        parts = torch.autograd.grad(F.cross_entropy(net(xb), yb), list(net.parameters()))
        k = -(-examples // (micro * 3 // 2))
        naive = [a + b / k for a, b in zip(naive, parts, strict=True)]
    scale = max(float(g.abs().max()) for g in one)
    return {
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, one, strict=True)),
        "naive_max_abs_diff": max(
            float((a - b).abs().max()) for a, b in zip(naive, one, strict=True)
        ),
        "max_abs_gradient": scale,
    }


def train_windows(
    model: nn.Module,
    data: Digits,
    *,
    epochs: int,
    micro: int,
    lr: float,
    generator: torch.Generator,
    num_micro: Callable[[], int],
    after_window: Callable[[Any, float], object] | None = None,
) -> list[dict[str, float]]:
    """Train with Adam where each step is a window of ``num_micro()`` exact micro-batches."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    acc = Accumulator(model, opt)
    n = len(data.y_train)
    curve: list[dict[str, float]] = []
    seen = 0
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(n, generator=generator)
        start = 0
        while start < n:
            k = num_micro()
            idx = order[start : start + k * micro]
            start += len(idx)
            batch = (data.x_train[idx], data.y_train[idx])
            with track(model, "variance", loss_reduction="sum") as stats:
                total = 0.0
                for mb in acc.split(batch, micro_batch_size=micro):
                    with acc.micro_step():
                        loss = _loss_sum(model, mb)
                        acc.backward(loss)
                    total += float(loss.detach())
            acc.step()
            seen += len(idx)
            if after_window is not None:
                after_window(stats, total / len(idx))
        test_loss, test_acc = evaluate(model, data.x_test, data.y_test)
        curve.append(
            {
                "epoch": float(epoch),
                "examples": float(seen),
                "test_loss": test_loss,
                "test_accuracy": test_acc,
            }
        )
    return curve


def _figure(curves: dict[str, list[dict[str, float]]], history: list[dict[str, float]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.4))
    ax_acc, ax_bs = fig.subplots(1, 2)
    for label, curve in curves.items():
        ax_acc.plot(
            [c["epoch"] for c in curve], [c["test_accuracy"] for c in curve], "o-", label=label
        )
    ax_acc.set(
        xlabel="epoch",
        ylabel="test accuracy",
        ylim=(0.0, 1.02),
        title="batch 32 vs batch 256 (8 x 32, exact)",
    )
    ax_acc.legend(fontsize=8)
    ax_acc.grid(alpha=0.3)
    ax_bs.step(
        [h["step"] for h in history],
        [h["batch_size"] for h in history],
        where="post",
        label="batch size used",
    )
    ax_bs.plot(
        [h["step"] for h in history],
        [h["smoothed"] for h in history],
        lw=0.8,
        label="noise scale (smoothed)",
    )
    ax_bs.set(xlabel="optimizer step", ylabel="examples", yscale="log", title="adaptive batch size")
    ax_bs.legend(fontsize=8)
    ax_bs.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def accumulation_markdown(
    model_fn: Callable[[], nn.Module],
    trained: nn.Module,
    data: Digits,
    *,
    epochs: int,
    lr: float,
    seed: int,
) -> tuple[str, Any, dict[str, Any]]:
    """Markdown, figure and metrics of the section."""
    start = time.perf_counter()
    check = exactness(trained, data, examples=min(256, len(data.y_train)), micro=32)
    curves: dict[str, list[dict[str, float]]] = {}
    for label, k in (("batch 32", 1), ("batch 256 = 8 x 32", 8)):
        torch.manual_seed(seed)
        curves[label] = train_windows(
            model_fn(),
            data,
            epochs=epochs,
            micro=32,
            lr=lr,
            generator=torch.Generator().manual_seed(seed),
            num_micro=functools.partial(int, k),
        )
    torch.manual_seed(seed)
    ctl = AdaptiveBatchSize(micro_batch_size=16, max_micro=16, smoothing=0.7)
    curves["adaptive (noise scale)"] = train_windows(
        model_fn(),
        data,
        epochs=epochs,
        micro=16,
        lr=lr,
        generator=torch.Generator().manual_seed(seed),
        num_micro=lambda: ctl.num_micro,
        after_window=lambda stats, loss: ctl.update(stats),
    )
    rows = "\n".join(
        f"| {label} | {c[-1]['examples']:.0f} | {c[-1]['test_accuracy']:.3f} | "
        f"{c[-1]['test_loss']:.4f} |"
        for label, c in curves.items()
    )
    sizes = [h["batch_size"] for h in ctl.history]
    markdown = f"""`gradkit.accumulate.Accumulator` sums the micro-batches' summed losses and
divides once by the window's count, so a batch split into micro-batches gives the gradient of
the whole batch. On {min(256, len(data.y_train))} training examples of the trained model, one
pass vs 8 micro-batches of 32: max |difference| **{check["max_abs_diff"]:.2g}** (largest
gradient entry {check["max_abs_gradient"]:.3g}); averaging per-micro-batch means of unequal
micro-batches (48 examples each, the last shorter) is off by {check["naive_max_abs_diff"]:.2g}.

The same model trained for {epochs} epochs with batch 32, with batch 256 as 8 exact
micro-batches of 32, and with an adaptive number of micro-batches of 16 set after every step
from the gradient noise scale (`AdaptiveBatchSize(rule="noise_scale")`, smoothed, at most 16
micro-batches; it went from {sizes[0]:.0f} to {sizes[-1]:.0f} examples per step):

| run | examples seen | test accuracy | test loss |
|---|---|---|---|
{rows}

{{{{figure:accumulation}}}}
"""
    metrics = {
        "exactness": check,
        "curves": curves,
        "adaptive_history": ctl.history,
        "seconds": time.perf_counter() - start,
    }
    return markdown, _figure(curves, ctl.history), metrics

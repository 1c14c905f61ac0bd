"""The demo's "Sharpness over training" section: the largest eigenvalue of the loss Hessian
(``gradkit.curvature``) at weights saved during training, on one fixed batch."""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit.curvature import Hessian, eigenvalues

__all__ = ["sharpness_markdown"]


def top_eigenvalue(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    max_iter: int,
    generator: torch.Generator,
) -> float:
    """The largest Hessian eigenvalue of the mean cross-entropy on ``batch`` (Lanczos)."""
    with warnings.catch_warnings():  # a few Lanczos steps may stop short of full accuracy
        warnings.simplefilter("ignore")
        values = eigenvalues(
            Hessian(model, F.cross_entropy, batch), k=1, max_iter=max_iter, generator=generator
        )
    return float(values[0])


def _figure(steps: list[int], values: list[float], losses: list[float]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.2))
    ax = fig.subplots(1, 1)
    ax.plot(steps, values, "o-", label="top Hessian eigenvalue")
    ax.set(xlabel="training step", ylabel="largest eigenvalue", title="sharpness over training")
    twin = ax.twinx()
    twin.plot(steps, losses, "s--", color="tab:gray", label="loss on the batch")
    twin.set_ylabel("cross-entropy")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def sharpness_markdown(
    model: nn.Module,
    snapshots: list[tuple[int, dict[str, torch.Tensor]]],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    points: int,
    max_iter: int,
    seed: int,
) -> tuple[str, Any, dict[str, Any]]:
    """Markdown, figure and metrics of the section (``points`` snapshots, evenly spaced)."""
    start = time.perf_counter()
    net = copy.deepcopy(model).eval()
    picks = snapshots[:: max(1, len(snapshots) // max(1, points))]
    steps, values, losses = [], [], []
    for step, weights in picks:
        net.load_state_dict(weights)
        values.append(
            top_eigenvalue(
                net, batch, max_iter=max_iter, generator=torch.Generator().manual_seed(seed)
            )
        )
        with torch.no_grad():
            losses.append(float(F.cross_entropy(net(batch[0]), batch[1])))
        steps.append(step)
    rows = "\n".join(
        f"| {s} | {v:.4g} | {loss:.4f} |" for s, v, loss in zip(steps, values, losses, strict=True)
    )
    seconds = time.perf_counter() - start
    markdown = f"""The largest eigenvalue of the Hessian of the mean cross-entropy on
{len(batch[1])} fixed training examples, at weights saved during training:
`gradkit.curvature.eigenvalues(Hessian(model, F.cross_entropy, batch), k=1)`, Lanczos with full
reorthogonalization, at most {max_iter} Hessian-vector products per point ({seconds:.1f} s for
{len(steps)} points).

| step | top eigenvalue | loss on the batch |
|---|---|---|
{rows}

{{{{figure:sharpness}}}}
"""
    metrics = {"steps": steps, "top_eigenvalue": values, "loss": losses, "seconds": seconds}
    return markdown, _figure(steps, values, losses), metrics

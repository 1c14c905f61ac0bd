"""Higher moments in float32 keep float's range: the loss's factor (a gradient scaler's 65536,
or 1/N of a mean over many examples) goes on the per-example gradients before their p-th
power, not on the sum of powers of the unscaled ones (65536**8 is float32's largest number;
``(g / 2048) ** 4`` of a small gradient falls among the subnormals)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradkit.per_example import _fused, track
from gradkit.testing import per_example_grads

MODELS: dict[str, Callable[[], tuple[nn.Module, Callable[[int], torch.Tensor]]]] = {
    "linear": lambda: (nn.Linear(8, 4), lambda n: torch.randn(n, 8)),
    "linear_on_sequences": lambda: (nn.Linear(8, 4), lambda n: torch.randn(n, 3, 8)),
    "conv1d": lambda: (nn.Conv1d(3, 4, 3), lambda n: torch.randn(n, 3, 7)),
    "embedding": lambda: (nn.Embedding(10, 4), lambda n: torch.randint(0, 10, (n, 3))),
}


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(
    "case",
    [("sum", 65536.0, 8, 16, 1.0), ("mean", None, 4, 2048, 1e-4)],
    ids=["grad_scaler_8th", "mean_of_2048_4th"],
)
def test_float32_moments_keep_their_range(monkeypatch, case, model_name, fuse) -> None:
    reduction, loss_scale, p, n, size = case
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)  # the fused forms too, on this small layer
    torch.manual_seed(0)
    model, inputs = MODELS[model_name]()
    x = inputs(n)

    def loss_one(out: torch.Tensor, _: object) -> torch.Tensor:
        return (out * size).square().sum() / 2

    want = {k: g.pow(p).mean(0) for k, g in per_example_grads(model, loss_one, x, None).items()}
    with track(model, moments=(p,), loss_reduction=reduction, loss_scale=loss_scale) as stats:
        per = (model(x) * size).square().flatten(1).sum(1) / 2
        loss = per.mean() if reduction == "mean" else per.sum()
        (loss * (loss_scale or 1.0)).backward()
    for name, w in want.items():
        got = stats[name].moment(p).double()
        assert torch.isfinite(got).all(), name
        err = float((got - w).abs().max() / w.abs().max())
        assert err < 1e-5, (name, err)

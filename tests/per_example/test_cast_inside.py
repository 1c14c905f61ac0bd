"""A module that casts its parameter to compute (Gemma's RMSNorm works in float32 inside a
float64 model: ``weight.float()``). Autograd's sum at the parameter's edge then has float32
precision while the per-example gradients are summed in float64, and the variance,
``E[g^2] - mean^2``, mixed the two: at a high signal-to-noise ratio entries were 1.9x off or
clamped to 0. The mean of such a call now comes from the per-example gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradkit.per_example import track

D = torch.float64


class Float32Inside(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _check(module: nn.Module) -> None:
    n, t, d = 8, 5, 16
    x = (1.0 + 1e-3 * torch.randn(n, t, d)).to(D)  # a large gradient common to all examples
    c = torch.randn(d, dtype=D)

    def loss(xb: torch.Tensor) -> torch.Tensor:
        return (module(xb) * c).sum(dim=(1, 2)).mean()

    rows = []
    for i in range(n):
        (g,) = torch.autograd.grad(loss(x[i : i + 1]), [module.weight])
        rows.append(g)
    want = torch.stack(rows)
    with track(module, "variance") as stats:
        loss(x).backward()
    true = want.var(0, unbiased=False)
    assert float(true.min()) > 0
    torch.testing.assert_close(stats["weight"].variance, true, rtol=1e-9, atol=0)
    torch.testing.assert_close(stats["weight"].mean, want.mean(0), rtol=1e-12, atol=0)


def test_a_parameter_cast_to_float32_inside_a_float64_model() -> None:
    torch.manual_seed(0)
    _check(Float32Inside(16).to(D))


def test_gemmas_rms_norm() -> None:
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(0)
    norm = GemmaRMSNorm(16).to(D)
    with torch.no_grad():
        norm.weight.normal_()
    _check(norm)

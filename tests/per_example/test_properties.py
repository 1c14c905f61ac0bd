"""Hypothesis-drawn shapes for Linear and Conv against the per-example loop (float64)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads


def compare(model: nn.Module, x: torch.Tensor, p: int) -> None:
    def loss(o):
        return (o**3 + o).flatten(1).sum(1)

    ref = per_example_grads(model, lambda o, t: loss(o).sum(), x, None)
    with track(model, "variance", "batch_l2", moments=(p,)) as stats:
        loss(model(x)).mean().backward()
    for name, g in ref.items():
        # the variance is second_moment - mean**2: its rounding scales with the second moment
        var_atol = 1e-12 * max(1.0, float((g**2).mean(0).max()))
        assert_close(stats[name].variance, g.var(0, unbiased=False), atol=var_atol)
        assert_close(
            [stats[name].batch_l2, stats[name].moment(p)],
            [g.flatten(1).square().sum(1), (g**p).mean(0)],
        )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4),
    lead=st.lists(st.integers(1, 3), max_size=2),
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
    p=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_linear_any_shape(n, lead, d_in, d_out, bias, p, seed):
    torch.manual_seed(seed)
    model = nn.Linear(d_in, d_out, bias=bias).double()
    compare(model, torch.randn(n, *lead, d_in, dtype=torch.float64), p)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    dims=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    c=st.integers(1, 2),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.integers(0, 2),
    bias=st.booleans(),
    p=st.integers(2, 3),
    seed=st.integers(0, 1000),
)
def test_conv_any_shape(n, dims, groups, c, k, stride, dilation, padding, bias, p, seed):
    torch.manual_seed(seed)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    model = conv(
        c * groups,
        2 * groups,
        k,
        stride=stride,
        dilation=dilation,
        padding=padding,
        groups=groups,
        bias=bias,
    ).double()
    size = dilation * (k - 1) + 1 + 2
    x = torch.randn(n, c * groups, *([size] * dims), dtype=torch.float64)
    compare(model, x, p)

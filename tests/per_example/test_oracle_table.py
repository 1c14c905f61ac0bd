"""Every rule and quantity against the one-example-at-a-time autograd loop in float64
(rtol 1e-10): settings x {mean, sum} x {one pass, unequal micro-batches} x N in {1, 5}."""

from __future__ import annotations

import pytest
import torch

import gradkit
from gradkit.per_example import _fused
from gradkit.testing import assert_close, per_example_grads

from ._grads_check import same_grads
from .settings import SETTINGS, Setting

QUANTITIES = ("mean", "second_moment", "variance", "batch_l2", "batch_grad")
MOMENTS = (1, 2, 3, 4)


def reference(setting: Setting, model, x, y):
    return per_example_grads(model, lambda o, t: setting.loss_fn(o, t).sum(), x, y)


def run_tracked(setting: Setting, model, x, y, reduction: str, splits: list[int], **kw):
    with gradkit.per_example.track(
        model, *QUANTITIES, moments=MOMENTS, loss_reduction=reduction, **kw
    ) as stats:
        start = 0
        for size in splits:
            xb, yb = x[start : start + size], y[start : start + size]
            losses = setting.loss_fn(model(xb), yb)
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
            start += size
    return stats


def check(stats, ref: dict[str, torch.Tensor]) -> None:
    got, want = {}, {}
    for name, g in ref.items():
        s = stats[name]
        n = g.shape[0]
        got[name] = {
            "mean": s.mean,
            "second_moment": s.second_moment,
            "variance": s.variance,
            "unbiased": s.var(unbiased=True) if n > 1 else None,
            "batch_l2": s.batch_l2,
            "batch_grad": s.batch_grad,
            **{f"moment{p}": s.moment(p) for p in MOMENTS},
        }
        want[name] = {
            "mean": g.mean(0),
            "second_moment": (g**2).mean(0),
            "variance": g.var(0, unbiased=False),
            "unbiased": g.var(0, unbiased=True) if n > 1 else None,
            "batch_l2": g.flatten(1).square().sum(1),
            "batch_grad": g,
            **{f"moment{p}": (g**p).mean(0) for p in MOMENTS},
        }
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert_close(
        stats.batch_l2(), sum(w["batch_l2"] for w in want.values()), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.id)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n,splits", [(1, [1]), (5, [5]), (5, [2, 3]), (7, [3, 1, 3])])
def test_matches_per_example_loop(setting, reduction, n, splits):
    torch.manual_seed(0)
    model = setting.module_fn().double()
    x, y = setting.input_fn(n, torch.Generator(torch.get_default_device()).manual_seed(n))
    ref = reference(setting, model, x, y)
    stats = run_tracked(setting, model, x, y, reduction, splits)
    assert stats.num_examples == n
    check(stats, ref)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.id)
def test_tiny_chunks_equal_unchunked(setting):
    model = setting.module_fn().double()
    x, y = setting.input_fn(6, torch.Generator(torch.get_default_device()).manual_seed(1))
    a = run_tracked(setting, model, x, y, "mean", [6], chunk_size=1)
    b = run_tracked(setting, model, x, y, "mean", [6])
    for name in b:
        assert_close(
            [a[name].moment(3), a[name].batch_grad, a[name].batch_l2],
            [b[name].moment(3), b[name].batch_grad, b[name].batch_l2],
        )


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.id)
@pytest.mark.parametrize("fuse", [True, False])
def test_grad_is_untouched(setting, fuse, monkeypatch):
    """Bit-for-bit, except (fuse=True, every layer call that can be fused is) the weights
    summed from their per-example gradients."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    model = setting.module_fn().double()
    x, y = setting.input_fn(4, torch.Generator(torch.get_default_device()).manual_seed(2))
    setting.loss_fn(model(x), y).mean().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with gradkit.per_example.track(model, "variance", "batch_l2", "batch_grad", fuse=fuse):
        setting.loss_fn(model(x), y).mean().backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    if fuse:
        assert same_grads(got, plain) == []
    else:
        assert all(torch.equal(got[n], plain[n]) for n in plain)

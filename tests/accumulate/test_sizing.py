"""Automatic micro-batch size and the adaptive number of micro-batches."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradkit
from gradkit.accumulate import (
    Accumulator,
    AdaptiveBatchSize,
    activation_bytes,
    find_micro_batch_size,
)
from gradkit.testing import assert_close


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(50, 200), nn.Tanh(), nn.Linear(200, 200), nn.Tanh(), nn.Linear(200, 1)
    )


def loss_fn(m, b):
    x, y = b
    return F.mse_loss(m(x), y, reduction="sum")


def test_activation_bytes_is_linear_in_batch_and_restores_grads():
    model = mlp()
    x, y = torch.randn(32, 50), torch.randn(32, 1)
    model(x).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    b8, b16 = (activation_bytes(model, loss_fn, (x[:k], y[:k])) for k in (8, 16))
    assert b16 == pytest.approx(2 * b8, rel=0.05)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("budget_micro", [1, 5, 12, 64])
def test_found_size_fits_the_budget_and_accumulation_stays_exact(budget_micro):
    model = mlp()
    x, y = torch.randn(64, 50), torch.randn(64, 1)
    budget = activation_bytes(model, loss_fn, (x[:budget_micro], y[:budget_micro]))
    size = find_micro_batch_size(model, loss_fn, (x, y), budget_bytes=budget)
    assert activation_bytes(model, loss_fn, (x[:size], y[:size])) <= budget
    assert size >= max(1, budget_micro // 2)
    full = torch.autograd.grad(loss_fn(model, (x, y)) / 64, list(model.parameters()))
    seen = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            seen.append([p.grad.clone() for p in model.parameters()])

    acc = Accumulator(model, Capture(model.parameters(), lr=0.0))
    for mb in acc.split((x, y), micro_batch_size=size):
        with acc.micro_step():
            acc.backward(loss_fn(model, mb))
    acc.step()
    assert_close(seen[0], list(full), rtol=1e-5, atol=1e-6)


@pytest.mark.cpu_only  # on CUDA the free device memory is the default budget
def test_find_micro_batch_size_errors():
    model = mlp()
    with pytest.raises(ValueError, match="budget_bytes: expected a byte budget on a cpu"):
        find_micro_batch_size(model, loss_fn, (torch.randn(4, 50), torch.randn(4, 1)))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: Python 3.11")
def test_a_loss_of_output_and_targets_is_told_the_convention():
    """loss_fn(output, targets), as the module transforms and curvature take it, fails inside
    torch here (a tuple has no .size): the error says how loss_fn is called."""
    model = mlp()
    batch = (torch.randn(4, 50), torch.randn(4, 1))
    for run in (
        lambda: activation_bytes(model, F.mse_loss, batch),
        lambda: find_micro_batch_size(model, F.mse_loss, batch, budget_bytes=10**6),
    ):
        with pytest.raises(AttributeError) as info:
            run()
        assert "calls loss_fn(model, micro_batch)" in "".join(info.value.__notes__)


def noisy_stats(model, noise):
    gen = torch.Generator("cpu").manual_seed(1)  # the same draws on every test device
    here = torch.get_default_device()
    x = torch.randn(32, 50, generator=gen, device="cpu").to(here)
    y = model(x).detach() + noise * torch.randn(32, 1, generator=gen, device="cpu").to(here) + 0.5
    with gradkit.per_example.track(model, "variance") as stats:
        F.mse_loss(model(x), y).backward()
    model.zero_grad()
    return stats


def test_adaptive_more_micro_batches_for_noisier_gradients():
    with torch.device("cpu"):  # the same weights on every test device
        model = mlp()
    model.to(torch.get_default_device())
    quiet = AdaptiveBatchSize(micro_batch_size=4, smoothing=0.0, max_micro=1000)
    loud = AdaptiveBatchSize(micro_batch_size=4, smoothing=0.0, max_micro=1000)
    n_quiet = quiet.update(noisy_stats(model, 0.01))
    n_loud = loud.update(noisy_stats(model, 10.0))
    assert n_loud > n_quiet
    h = loud.history[-1]
    assert h["num_micro"] == n_loud and h["batch_size"] == 4 * n_loud


def test_adaptive_bounds_smoothing_and_cabs():
    model = mlp()
    ctl = AdaptiveBatchSize(micro_batch_size=4, min_micro=2, max_micro=3)
    for _ in range(3):
        assert 2 <= ctl.update(noisy_stats(model, 10.0)) <= 3
    assert len(ctl.history) == 3
    cabs = AdaptiveBatchSize(micro_batch_size=4, rule="cabs", lr=0.1, smoothing=0.0)
    stats = noisy_stats(model, 1.0)
    n = cabs.update(stats, loss=2.0)
    trace = sum(float(stats[k].var(unbiased=True).double().sum()) for k in stats)
    want = 0.1 * trace / 2.0
    assert cabs.history[-1]["estimate"] == pytest.approx(want, rel=1e-6)
    assert n == min(max(math.ceil(max(want, 1) / 4), 1), 64)
    with pytest.raises(ValueError, match="lr: expected the"):
        AdaptiveBatchSize(micro_batch_size=4, rule="cabs")
    with pytest.raises(ValueError, match="loss: expected the window's loss"):
        cabs.update(stats)
    with pytest.raises(ValueError, match="rule: expected one of"):
        AdaptiveBatchSize(micro_batch_size=4, rule="fast")
    with pytest.raises(ValueError, match="min_micro / max_micro"):
        AdaptiveBatchSize(micro_batch_size=4, min_micro=5, max_micro=2)


def test_cabs_smooths_the_estimate_before_rounding():
    """B = lr tr(Sigma) / loss is smoothed, then turned into ceil(B / micro_batch_size)
    micro-batches: B = 2.4 takes 3 micro-batches of 1 (rounding B first gave 2)."""
    model = mlp()
    stats = noisy_stats(model, 1.0)
    trace = sum(float(stats[k].var(unbiased=True).double().sum()) for k in stats)
    ctl = AdaptiveBatchSize(micro_batch_size=1, rule="cabs", lr=2.4 / trace, max_micro=100)
    assert ctl.update(stats, loss=1.0) == 3
    assert ctl.history[-1]["estimate"] == pytest.approx(2.4, rel=1e-6)
    ctl = AdaptiveBatchSize(
        micro_batch_size=2, rule="cabs", lr=1 / trace, max_micro=100, smoothing=0.5
    )
    ctl.update(stats, loss=1 / 2.4)
    assert ctl.update(stats, loss=1 / 4.4) == 2  # ceil(3.4 / 2)
    assert ctl.history[-1]["smoothed"] == pytest.approx(3.4, rel=1e-6)  # rounded first: 3

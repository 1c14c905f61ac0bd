"""The gradient noise scale estimates McCandlish et al.'s ``B_simple = tr(Sigma) / |G|^2`` with
``G`` the expected gradient, not the window's mean.

A problem whose ``G`` and ``Sigma`` are known in closed form: least squares with Gaussian
inputs, ``y = x . w* + e``, the model at ``w* + delta``. Summed squared error: example ``i``'s
gradient is ``g_i = 2 x_i (x_i . delta - e_i)``, so ``G = 2 delta`` and
``Sigma = 4 (|delta|^2 + s^2) I + 4 delta delta^T``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

import gradkit
from gradkit.accumulate import AdaptiveBatchSize
from gradkit.monitor import GradientMonitor
from gradkit.per_example import noise_scale, track
from gradkit.testing import per_example_grads

from .test_behaviour import KeyBias

D = torch.float64
DIM, NOISE, DELTA = 10, 1.0, 0.6


class LeastSquares:
    """The closed-form problem of the module docstring, drawn from one generator."""

    def __init__(self) -> None:
        self.gen = torch.Generator(torch.get_default_device()).manual_seed(0)
        self.w = torch.randn(DIM, 1, dtype=D, generator=self.gen)
        delta = torch.randn(DIM, 1, dtype=D, generator=self.gen)
        self.delta = DELTA * delta / delta.norm()
        self.model = nn.Linear(DIM, 1, bias=False).to(D)
        with torch.no_grad():
            self.model.weight.copy_((self.w + self.delta).T)

    def truth(self) -> tuple[float, float]:
        """``(tr(Sigma), |G|^2)``."""
        d2 = DELTA**2
        return 4 * DIM * (d2 + NOISE**2) + 4 * d2, 4 * d2

    def window(self, n: int) -> gradkit.per_example.Tracker:
        x = torch.randn(n, DIM, dtype=D, generator=self.gen)
        y = x @ self.w + NOISE * torch.randn(n, 1, dtype=D, generator=self.gen)
        with track(self.model, "variance", loss_reduction="sum") as stats:
            ((self.model(x) - y) ** 2).sum().backward()
        self.model.zero_grad()
        return stats


def test_the_estimate_of_the_signal_is_unbiased():
    """Averaged over windows of 16 examples, the two parts estimate ``tr(Sigma)`` and ``|G|^2``
    and their ratio ``B_simple`` (38.8 here); the plain ``|mean|^2`` overstates ``|G|^2`` by
    ``tr(Sigma) / 16`` and its ratio reads back about the window's size (11)."""
    from gradkit.per_example._derived import noise_parts

    problem = LeastSquares()
    trace, signal = problem.truth()
    parts = [noise_parts(problem.window(16), None, "test") for _ in range(1000)]
    mean_trace = statistics.fmean(t for t, _ in parts)
    mean_signal = statistics.fmean(g for _, g in parts)
    assert mean_trace == pytest.approx(trace, rel=0.05)
    assert mean_signal == pytest.approx(signal, rel=0.15)
    assert mean_trace / mean_signal == pytest.approx(trace / signal, rel=0.2)
    plain = mean_signal + mean_trace / 16  # what E|mean|^2 is
    assert mean_trace / plain < 0.35 * trace / signal


def test_adaptive_batch_size_grows_to_the_noise_scale():
    """From 8 examples a step, the number of micro-batches of 8 settles around
    ``B_simple / 8`` (about 5); with the plain estimate it read back about the batch it had
    (2 or 3 micro-batches)."""
    problem = LeastSquares()
    trace, signal = problem.truth()
    ctl = AdaptiveBatchSize(micro_batch_size=8, max_micro=64)
    for _ in range(60):
        ctl.update(problem.window(8 * ctl.num_micro))
    settled = statistics.median(h["batch_size"] for h in ctl.history[20:])
    assert 0.8 * trace / signal < settled < 2.5 * trace / signal  # the plain estimate: 16-24
    assert all(math.isfinite(h["smoothed"]) for h in ctl.history[20:])


def test_noise_scale_matches_its_definition_over_micro_batches_and_parameters():
    """Each parameter's ``|G|^2`` is estimated with its own number of examples: the second
    micro-batch reaches only the last layer (``backward(inputs=...)``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = torch.randn(11, 3, dtype=D), torch.randn(11, 2, dtype=D) + 3  # a resolved signal

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((o - t) ** 2).sum()

    with track(model, "variance", loss_reduction="sum") as stats:
        loss(model(x[:6]), y[:6]).backward()
        loss(model(x[6:]), y[6:]).backward(inputs=list(model[2].parameters()))
    first = per_example_grads(model, loss, x[:6], y[:6])
    every = per_example_grads(model, loss, x, y)
    trace = signal = 0.0
    for name in first:
        g = every[name] if name.startswith("2.") else first[name]
        t = float(g.var(0, unbiased=True).sum())
        trace += t
        signal += float(g.mean(0).square().sum()) - t / len(g)
    assert noise_scale(stats) == pytest.approx(trace / signal, rel=1e-10)


def test_a_window_that_does_not_resolve_the_signal_gives_inf():
    """Two examples with opposite gradients: ``|mean|^2 = 0 < tr(Sigma) / N``."""
    model = nn.Linear(1, 1, bias=False).to(D)
    with torch.no_grad():
        model.weight.fill_(1.0)
    x = torch.tensor([[1.0], [-1.0]], dtype=D)
    with track(model, "variance", loss_reduction="sum") as stats:
        model(x).sum().backward()
    assert noise_scale(stats) == math.inf
    with track(model, "variance", loss_reduction="sum") as zero:
        (model(x) * 0).sum().backward()
    assert math.isnan(noise_scale(zero))


def test_a_name_given_twice_is_refused():
    """Counted twice, a sum over parameters was silently off (CABS by 2x)."""
    model = nn.Linear(3, 1)
    with track(model, "variance") as stats:
        model(torch.randn(5, 3)).pow(2).mean().backward()
    for call in (
        lambda: noise_scale(stats, ["weight", "weight"]),
        lambda: gradkit.per_example.cabs_batch_size(stats, 0.1, 1.0, names=["weight", "weight"]),
        lambda: gradkit.per_example.gradient_snr(stats, ["bias", "bias"]),
    ):
        with pytest.raises(ValueError, match="names: expected distinct parameter names"):
            call()


def test_the_summary_reads_the_snr_of_all_parameters_together():
    """A parameter whose exact gradient is 0 (an attention's key bias: rounding only) had an SNR
    and a noise scale in the summary table, read on its own, where ``gradient_snr(stats)``
    gives nan."""
    torch.manual_seed(0)
    model = KeyBias().to(D)
    x, y = torch.randn(6, 5, 4, dtype=D), torch.randn(6, 2, dtype=D)
    with track(model, "variance") as stats:
        ((model(x) - y) ** 2).sum(1).mean().backward()
    assert math.isnan(gradkit.per_example.gradient_snr(stats)["key.bias"])
    (row,) = [line for line in stats.summary().splitlines() if line.startswith("key.bias")]
    assert row.split()[4] == "nan", row


def test_the_monitor_counts_every_example_and_keeps_a_float64_loss():
    """``examples`` was the first parameter's count (4 here, where the last layer saw 10), and
    the loss was rounded to float32 (3e-8 off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = torch.randn(10, 3, dtype=D), torch.randn(10, 2, dtype=D)
    monitor = GradientMonitor(model, quantities=("variance",), loss_reduction="sum")
    with monitor.step() as step:
        loss = ((model(x[:4]) - y[:4]) ** 2).sum()
        loss.backward()
        ((model(x[4:]) - y[4:]) ** 2).sum().backward(inputs=list(model[2].parameters()))
        step.loss = loss / 3
    (record,) = monitor.records
    assert record["examples"] == 10
    assert record["loss"] == float(loss.detach() / 3)

"""The Accumulator used the way a plain loop is written: each habit that would make its
window's gradient differ from the large batch's is refused, naming the fix, or handled; found
by trying the old recipes against the float64 large-batch oracle."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.accumulate import Accumulator, activation_bytes, find_micro_batch_size
from gradkit.testing import assert_close

D = torch.float64


def _problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(D), torch.randn(8, 4, dtype=D), torch.randint(0, 3, (8,))


def test_a_mean_divided_by_the_number_of_micro_steps_is_warned_about() -> None:
    """``mean / k``: step() divides by the window's count again (8 times too small)."""
    model, x, y = _problem()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (xb, yb), *_ = acc.split((x, y), num_micro_batches=4)
    with (
        pytest.warns(UserWarning, match=r"a mean, times 0.25: if that is a plain loop's mean / 4"),
        acc.micro_step(count=2),
    ):
        acc.backward(F.cross_entropy(model(xb), yb) / 4)


def test_a_weighted_mean_times_the_count_is_not_warned_about() -> None:
    """A task weight times the count (0.3 * 2) is a weighted sum, and with normalize='sum'
    a plain loop's mean / k is the recipe."""
    model, x, y = _problem()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (xb, yb), *_ = acc.split((x, y), num_micro_batches=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with acc.micro_step(count=2):
            acc.backward(0.3 * F.cross_entropy(model(xb), yb) * len(yb))
        summed = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), normalize="sum")
        summed.reset()
        with summed.micro_step(count=2):
            summed.backward(F.cross_entropy(model(xb), yb) / 4)


def test_a_mean_times_the_count_is_the_sum_and_exact() -> None:
    model, x, y = _problem()
    F.cross_entropy(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt)
    got: list[torch.Tensor] = []
    opt.step = lambda *a, **k: got.extend(p.grad.clone() for p in model.parameters())  # type: ignore[method-assign]
    for xb, yb in acc.split((x, y), num_micro_batches=4):
        with acc.micro_step():
            acc.backward(F.cross_entropy(model(xb), yb) * len(yb))
    assert acc.step().stepped
    assert_close(got, want, rtol=1e-12)


@pytest.mark.parametrize("how", ["optimizer.zero_grad", "model.zero_grad", "stray backward"])
def test_gradients_changed_inside_the_window_are_refused(how: str) -> None:
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt)
    batches = list(acc.split((x, y), num_micro_batches=2))
    with acc.micro_step(count=4):
        acc.backward(F.cross_entropy(model(batches[0][0]), batches[0][1], reduction="sum"))
    if how == "optimizer.zero_grad":
        opt.zero_grad()
    elif how == "model.zero_grad":
        model.zero_grad(set_to_none=False)
    else:
        F.cross_entropy(model(x), y).backward()
    xb, yb = batches[1]
    with (
        pytest.raises(GradkitError, match=r"gradients cleared or changed since"),
        acc.micro_step(count=4),
    ):
        acc.backward(F.cross_entropy(model(xb), yb, reduction="sum"))


def test_a_disabled_grad_scaler_still_skips_a_non_finite_window() -> None:
    """``GradScaler(enabled=use_amp)`` with AMP off decides nothing: the window is checked."""
    model, x, y = _problem()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    with acc.micro_step(count=8):
        acc.backward(F.cross_entropy(model(x * float("nan")), y, reduction="sum"))
    result = acc.step()
    assert not result.stepped and result.skipped_reason == "non-finite gradient"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_reduce_lr_on_plateau_is_refused_at_construction() -> None:
    model, _, _ = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau.*scheduler.step\(metric\)"):
        Accumulator(model, opt, scheduler=plateau)


class FixedCost(nn.Module):
    """Activations of ``N * 64`` floats plus a saved ``[2048]`` tensor whatever the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.table = nn.Parameter(torch.randn(2048))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).sum(1) + torch.tanh(self.table).sum()


def test_find_micro_batch_size_returns_the_largest_size_that_fits() -> None:
    torch.manual_seed(0)
    model = FixedCost()
    batch = torch.randn(64, 64)
    crit = nn.Linear(1, 1)  # a parameter outside the model that the loss uses

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return crit(m(b)[:, None]).sum()

    budget = activation_bytes(model, loss_fn, batch[:40]) + 1
    size = find_micro_batch_size(model, loss_fn, batch, budget_bytes=budget)
    assert activation_bytes(model, loss_fn, batch[:size]) <= budget
    assert activation_bytes(model, loss_fn, batch[: size + 1]) > budget
    assert size >= 40
    assert crit.weight.grad is None  # the probes left no gradient outside the model

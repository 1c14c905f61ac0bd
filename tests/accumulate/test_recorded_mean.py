"""A micro-batch loss whose graph records a mean is refused by ``Accumulator.backward``: each
micro-batch's items would weigh ``1/n_j`` instead of ``1/N`` (63 % off on a 3 + 3 + 2 split).
Sums, and means turned into sums, stay exact against the full batch in one pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.accumulate import Accumulator

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    x = torch.randn(8, 4, dtype=torch.float64, generator=g)
    return x, torch.randint(0, 3, (8,), generator=g)


MEANS: dict[str, Loss] = {
    "cross_entropy": lambda out, y: F.cross_entropy(out, y),
    "none_then_mean": lambda out, y: F.cross_entropy(out, y, reduction="none").mean(),
    "with_regularizer": lambda out, y: F.cross_entropy(out, y) + 0.1 * out.pow(2).sum(),
    "class_weighted": lambda out, y: F.cross_entropy(
        out, y, weight=torch.tensor([1.0, 2.0, 3.0], dtype=out.dtype)
    ),
    "mse": lambda out, y: F.mse_loss(out, F.one_hot(y, 3).to(out.dtype)),
}


@pytest.mark.parametrize("name", sorted(MEANS))
def test_a_recorded_mean_is_refused_and_adds_nothing(name: str) -> None:
    model, (x, y) = _model(), _data()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(GradkitError, match=r"Accumulator.backward\(loss\): loss: .*a mean over"):
        for xb, yb in acc.split((x, y), micro_batch_size=3):
            with acc.micro_step():
                acc.backward(MEANS[name](model(xb), yb))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_token_mean_of_one_sequence_is_refused() -> None:
    """A micro-batch of one sequence, ``cross_entropy`` on ``[1, C, T]``: a mean over its
    tokens, read as "a mean over one row" (its sum) and accepted, 117 % off the large batch's
    mean over all tokens with padding."""
    torch.manual_seed(0)
    lm = nn.Sequential(nn.Embedding(10, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    tokens, labels = (
        torch.randint(1, 10, (4, 6), generator=g),
        torch.randint(0, 10, (4, 6), generator=g),
    )
    labels[0, 2:] = -100
    acc = Accumulator(lm, torch.optim.SGD(lm.parameters(), lr=0.1))
    with pytest.raises(
        GradkitError, match=r"NllLoss2DBackward0 \(reduction='mean'\), a mean over 6"
    ) as info:
        for t, lab in acc.split((tokens, labels), micro_batch_size=1):
            with acc.micro_step():
                acc.backward(F.cross_entropy(lm(t).transpose(1, 2), lab))
    # the count to pass is the targets kept, not the examples (87 % off with the examples)
    assert "count of the targets kept" in str(info.value)
    assert "normalize='tokens'" in str(info.value)
    assert all(p.grad is None for p in lm.parameters())


PLAIN_MEANS: dict[str, Loss] = {
    "margin_ranking_loss": lambda out, y: F.margin_ranking_loss(
        out[:, 0], out[:, 1], torch.ones(out.shape[0], dtype=out.dtype)
    ),
    "triplet_margin_loss": lambda out, y: F.triplet_margin_loss(out, out.flip(0), 2 * out),
    "hinge_embedding_loss": lambda out, y: F.hinge_embedding_loss(out, torch.ones_like(out)),
    "squares_mean": lambda out, y: out.pow(2).mean(),
    "rows_mean_then_sum": lambda out, y: F.mse_loss(out, 0 * out, reduction="none").mean(0).sum(),
    "row_sums_mean_dim0": lambda out, y: out.pow(2).sum(1).mean(0),
}


@pytest.mark.parametrize("name", sorted(PLAIN_MEANS))
def test_a_mean_over_the_rows_the_loss_graph_shows_is_refused(name: str) -> None:
    """Means torch writes out in plain operations (its margin and hinge losses), and plain
    means over the rows, were accepted: 20 to 100 % off after one step on a 3 + 3 + 2 split."""
    model, (x, y) = _model(), _data()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        GradkitError, match=r"Accumulator.backward\(loss\): loss: .*a mean over 3 rows"
    ):
        for xb, yb in acc.split((x, y), micro_batch_size=3):
            with acc.micro_step():
                acc.backward(PLAIN_MEANS[name](model(xb), yb))
    assert all(p.grad is None for p in model.parameters())


SUMS_OF_ROWS: dict[str, Loss] = {
    "rows_summed_then_mean_over_features": lambda out, y: out.pow(2).sum(0).mean(),
    "features_mean_then_sum": lambda out, y: out.pow(2).mean(1).sum(),
    "mean_times_count": lambda out, y: out.pow(2).sum(1).mean() * out.shape[0],
}


@pytest.mark.parametrize("name", sorted(SUMS_OF_ROWS))
def test_a_sum_over_the_rows_with_a_mean_elsewhere_is_exact(name: str) -> None:
    model, (x, y) = _model(), _data()
    want = torch.autograd.grad(SUMS_OF_ROWS[name](model(x), y), list(model.parameters()))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for xb, yb in acc.split((x, y), micro_batch_size=3):
        with acc.micro_step():
            acc.backward(SUMS_OF_ROWS[name](model(xb), yb))
    for p, w in zip(model.parameters(), want, strict=True):  # the sum, before step() divides
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-14)
    assert acc.step().count == 8


SUMS: dict[str, Loss] = {
    "sum": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "mean_times_count": lambda out, y: F.cross_entropy(out, y) * y.shape[0],
    "none_then_sum": lambda out, y: F.cross_entropy(out, y, reduction="none").sum(),
}


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("name", sorted(SUMS))
def test_sums_are_the_full_batch_gradient(name: str, size: int) -> None:
    """Also a mean over one example (micro-batches of 1), which is its sum."""
    x, y = _data()
    full = _model()
    F.cross_entropy(full(x), y).backward()
    model = _model()
    seen: list[torch.Tensor] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(
        lambda o, *_: seen.extend(p.grad.clone() for p in model.parameters())
    )
    acc = Accumulator(model, opt)
    loss = MEANS["cross_entropy"] if size == 1 and name == "sum" else SUMS[name]
    for xb, yb in acc.split((x, y), micro_batch_size=size):
        with acc.micro_step():
            acc.backward(loss(model(xb), yb))
    acc.step()  # divides by the count before the optimizer's step
    for got, want in zip(seen, [p.grad for p in full.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)

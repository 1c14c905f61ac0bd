"""A model that mixes the examples between tracked layers has no individual gradients: an
example's loss depends on the others' activations, which the layers before see in their own
rows. Statistics beyond the mean are refused there, at the forward, naming the operation and
the layers it mixes; per-row versions of the same operations (over the features, statistics of
the batch detached, batch normalization in eval mode) stay exact.

Found by a probe: ``h - h.mean(0)`` between two Linears gave every statistic silently (the
exact GGN diagonal built on them was 47 % off), while ``nn.BatchNorm1d`` in training mode, the
same computation, was refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close

D = torch.float64
N = 6


class Between(nn.Module):
    """``b(f(tanh(a(x))))``: ``f`` between two tracked Linears."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.f = f
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.f(torch.tanh(self.a(x))))


MIXING = {
    "centered over the batch": lambda h: h - h.mean(0, keepdim=True),
    "mean without keepdim": lambda h: h - h.mean(0),
    "divided by the batch's norm": lambda h: h / h.norm(),
    "normalized over the batch": lambda h: F.normalize(h, dim=0),
    "softmax over the batch": lambda h: torch.softmax(h, 0),
    "log-softmax over the batch (negative dim)": lambda h: torch.log_softmax(h, -2),
    "cumulative sum over the batch": lambda h: h.cumsum(0),
    "one example's row broadcast": lambda h: h + h[:1],
    "attention across the batch": lambda h: torch.softmax(h @ h.T, -1) @ h,
    "batch norm, functional, training": lambda h: F.batch_norm(h, None, None, training=True),
}
PER_ROW = {
    "centered over the features": lambda h: h - h.mean(1, keepdim=True),
    "batch mean detached": lambda h: h - h.mean(0, keepdim=True).detach(),
    "softmax over the features": lambda h: torch.softmax(h, -1),
    "layer norm": lambda h: F.layer_norm(h, (5,)),
    "batch norm, functional, eval": lambda h: F.batch_norm(
        h, torch.zeros(5, dtype=D), torch.ones(5, dtype=D), training=False
    ),
    "cumulative sum over the features": lambda h: h.cumsum(1),
}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    return torch.randn(N, 4, generator=gen, dtype=D), torch.randint(0, 3, (N,), generator=gen)


@pytest.mark.parametrize("quantity", ["variance", "second_moment", "batch_l2", "batch_grad"])
@pytest.mark.parametrize("kind", list(MIXING))
def test_mixing_between_layers_is_refused_before_any_gradient(kind, quantity):
    torch.manual_seed(0)
    model = Between(MIXING[kind]).double()
    x, y = _data()
    words = r"the input of b \(Linear\).*applied to the outputs of a \(Linear\).*freeze the"
    with pytest.raises(GradkitError, match=words), track(model, quantity):
        F.cross_entropy(model(x), y).backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kind", list(MIXING))
def test_the_mean_alone_is_exact_whatever_the_model_mixes(kind):
    torch.manual_seed(0)
    model = Between(MIXING[kind]).double()
    x, y = _data()
    with track(model, "mean") as stats:
        F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        assert_close(stats[name].mean, p.grad, rtol=1e-12, atol=1e-15)


def _own_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``d l_i / d theta`` of each example's loss on the batch's forward, one at a time (a
    loop over examples run alone would change what the batch's statistics are)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(N):
        loss = F.cross_entropy(model(x)[i : i + 1], y[i : i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named]))
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def _check_exact(model: nn.Module) -> None:
    x, y = _data()
    with track(model, "batch_grad", "variance") as stats:
        F.cross_entropy(model(x), y).backward()
    for name, g in _own_gradients(model, x, y).items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-13)
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-9, atol=1e-13)


def test_freezing_the_layers_before_the_mixing_tracks_the_rest():
    torch.manual_seed(0)
    model = Between(MIXING["centered over the batch"]).double()
    model.a.requires_grad_(False)
    _check_exact(model)


@pytest.mark.parametrize("kind", list(PER_ROW))
def test_per_row_operations_stay_exact(kind):
    torch.manual_seed(0)
    _check_exact(Between(PER_ROW[kind]).double())

"""The operators take a batch's examples along dimension 0. A model with a sequence-first layer
(an RNN or attention with ``batch_first=False``) fed ``[T, N, ...]`` batches would have several
batches weighed by ``T`` and its empirical Fisher built from time steps (13 % and 39 % off, no
word): where that can matter, they warn, naming the layer."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.curvature import GGN, Fisher, Hessian

D = torch.float64


class Last(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = nn.GRU(3, 2, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return out[:, -1] if self.batch_first else out[-1]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(5, k, 3, dtype=D), torch.randn(k, 2, dtype=D)) for k in (2, n)]


@pytest.mark.parametrize("op", [Hessian, GGN])
def test_several_sequence_first_batches_warn(op) -> None:
    model = Last(batch_first=False).to(D)
    with pytest.warns(UserWarning, match=r"rnn \(GRU\) takes its examples along dimension 1") as w:
        op(model, F.mse_loss, _batches(4))
    assert w[0].filename == __file__
    with warnings.catch_warnings():  # one batch: nothing is weighed
        warnings.simplefilter("error")
        op(model, F.mse_loss, _batches(4)[1])
        batch_first = Last(batch_first=True).to(D)
        op(batch_first, F.mse_loss, [(x.transpose(0, 1), y) for x, y in _batches(4)])


def test_the_empirical_fisher_of_a_sequence_first_model_warns() -> None:
    model = Last(batch_first=False).to(D)
    x, y = _batches(3)[1]
    with pytest.warns(UserWarning, match=r"empirical Fisher takes the gradients of examples") as w:
        Fisher(model, F.mse_loss, (x, y), kind="empirical")
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Fisher(model, F.mse_loss, (x, y))  # Monte Carlo, one batch

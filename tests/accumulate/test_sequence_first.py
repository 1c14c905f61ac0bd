"""A sequence-first batch (``[T, N, ...]``) is split by example with ``batch_dim=1``, exactly
(against the full batch in one pass, float64); left out, ``batch_dim`` is 0 and a model with a
sequence-first layer gets a warning, since the split would cut along time (52 % off, silently,
before)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.accumulate import Accumulator, split_batch


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])  # [T, N, 3]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return SeqFirst().double()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="sum")


def _data(t: int = 6, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    x = torch.randn(t, n, 4, dtype=torch.float64, generator=g)
    return x, torch.randint(0, 3, (t, n), generator=g)


def test_batch_dim_1_gives_the_full_batch_gradient() -> None:
    x, y = _data()
    full = _model()
    (_loss(full(x), y) / x.shape[1]).backward()
    model, seen = _model(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(
        lambda o, *_: seen.extend(p.grad.clone() for p in model.parameters())
    )
    acc = Accumulator(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # batch_dim given: no warning
        for xb, yb in acc.split((x, y), micro_batch_size=2, batch_dim=1):
            assert xb.shape[:2] == (6, min(2, xb.shape[1])) and yb.shape[0] == 6
            with acc.micro_step():
                acc.backward(_loss(model(xb), yb))
    assert acc.step().count == 5.0
    for got, want in zip(seen, [p.grad for p in full.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_sequence_first_layer_warns_once_when_batch_dim_is_left_out() -> None:
    x, y = _data()
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.warns(UserWarning, match=r"rnn \(LSTM\) takes its examples along dimension 1"):
        parts = list(acc.split((x, y), micro_batch_size=2))
    assert [p[0].shape[0] for p in parts] == [2, 2, 2]  # dimension 0, as documented
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(acc.split((x, y), micro_batch_size=2))  # once per accumulator
        other = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
        list(other.split((x, y), micro_batch_size=2, batch_dim=0))  # said explicitly


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.MultiheadAttention(4, 2),
        lambda: nn.TransformerEncoderLayer(4, 2, dim_feedforward=8),
        lambda: nn.GRU(4, 3),
    ],
)
def test_other_sequence_first_layers_warn(make) -> None:  # type: ignore[no-untyped-def]
    model = nn.Sequential(make())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.warns(UserWarning, match="batch_first=False"):
        list(acc.split(torch.zeros(3, 2, 4), micro_batch_size=1))


def test_batch_first_layers_do_not_warn() -> None:
    model = nn.Sequential(nn.LSTM(4, 3, batch_first=True))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(acc.split(torch.zeros(3, 2, 4), micro_batch_size=1))


def test_split_batch_refuses_what_batch_dim_cannot_split() -> None:
    with pytest.raises(
        ValueError, match=r"batch\[1\]: expected a tensor with the examples along dimension 1"
    ):
        split_batch((torch.zeros(6, 5, 4), torch.zeros(5)), micro_batch_size=2, batch_dim=1)
    with pytest.raises(ValueError, match="pass batch_dim=1"):
        split_batch((torch.zeros(6, 5, 4), torch.zeros(5)), micro_batch_size=2)
    with pytest.raises(ValueError, match="batch_dim"):
        split_batch(torch.zeros(6, 5), micro_batch_size=2, batch_dim=-1)

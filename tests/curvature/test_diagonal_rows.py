"""The exact GGN and Fisher diagonals sum squared per-example gradients, so they need each
example's outputs in its own rows. A language model that flattens its ``[N, T, C]`` logits to
``[N * T, C]`` inside ``forward`` got them summed over each example's tokens, cross terms
included (1.5x off, silently); it is refused, and the same model returning ``[N, T, C]`` (the
loss flattening them) is exact against the dense operator's diagonal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import GGN, Fisher, diagonal, trace


class _LM(nn.Module):
    def __init__(self, flatten: bool) -> None:
        super().__init__()
        self.flatten = flatten
        self.e, self.h = nn.Embedding(6, 4), nn.Linear(4, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.h(torch.tanh(self.e(ids)))  # [N, T, C]
        return logits.reshape(-1, 6) if self.flatten else logits


def _flat_ce(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 6), labels.reshape(-1))


def _problem(flatten: bool) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    ids = torch.randint(0, 6, (4, 3), generator=g)
    labels = torch.randint(0, 6, (4, 3), generator=g)
    return _LM(flatten).double(), (ids, labels.reshape(-1) if flatten else labels)


OPERATORS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "GGN": lambda m, b: GGN(m, _flat_ce, b),
    "Fisher empirical": lambda m, b: Fisher(m, _flat_ce, b, kind="empirical"),
    "Fisher mc": lambda m, b: Fisher(m, _flat_ce, b, samples=3, likelihood="categorical"),
}


@pytest.mark.parametrize("name", ["GGN", "Fisher mc"])
def test_flattened_logits_are_refused(name: str) -> None:
    model, batch = _problem(flatten=True)
    op = OPERATORS[name](model, batch)
    with pytest.raises(GradkitError, match=r"4 examples along dimension 0.*\(12, 6\)"):
        diagonal(op)
    with pytest.raises(GradkitError, match="flatten them in loss_fn"):
        trace(op, method="exact")
    assert diagonal(op, method="hutchinson", probes=4).value.shape == (op.shape[0],)


def test_the_empirical_fisher_of_flattened_logits_is_refused_whole() -> None:
    """Built from each example's gradient, it would be the per-token matrix of flattened
    logits: its products were accepted while its exact diagonal refused."""
    model, batch = _problem(flatten=True)
    with pytest.raises(GradkitError, match=r"4 examples along dimension 0.*empirical Fisher"):
        OPERATORS["Fisher empirical"](model, batch).dense()


@pytest.mark.parametrize("name", ["GGN", "Fisher empirical"])
def test_examples_first_logits_are_exact(name: str) -> None:
    model, batch = _problem(flatten=False)
    op = OPERATORS[name](model, batch)
    torch.testing.assert_close(diagonal(op).value, op.dense().diagonal(), rtol=1e-10, atol=1e-13)

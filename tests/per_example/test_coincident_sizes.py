"""A layer called on tensors made inside the model (no gradient, no view of its inputs) whose
size happens to equal the number of examples: its rows are the examples only if the model
treats them so.

Found by a probe: nanoGPT's ``wpe(torch.arange(T))`` is exact for ``T != N`` (the ``[T, d]``
output gets a batch dimension) but with ``T == N`` its rows were split as the examples,
silently (``wpe.weight`` norms 3x off); a T5-style table looked up on ``[T, T]`` buckets and
permuted likewise. Such calls are followed to the model's outputs and refused where the model
broadcasts or moves those rows; calls whose rows are the examples stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64
VOCAB, WIDTH = 11, 6


class TinyGPT(nn.Module):
    """Token and position embeddings, positions looked up as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(8, WIDTH)
        self.cls = nn.Embedding(1, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, t = idx.shape
        h = self.wte(idx)
        if self.how == "positions":  # nanoGPT: [T, d], broadcast over the examples
            h = h + self.wpe(torch.arange(t))
        elif self.how == "positions_batched":  # [1, T, d]: a batch dimension of 1
            h = h + self.wpe(torch.arange(t)[None])
        elif self.how == "buckets":  # a [T, T] table, permuted and broadcast (T5-style)
            table = self.wpe((torch.arange(t)[:, None] - torch.arange(t)[None]).abs())
            h = h + table.permute(1, 0, 2).mean(0)
        elif self.how == "cls_ids":  # [N] ids made inside: one per example, exact
            cls = self.cls(torch.zeros(n, dtype=torch.long))
            h = torch.cat([cls[:, None], h[:, 1:]], dim=1)
        return self.head(torch.tanh(h))


def _batch(n: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    return torch.randint(0, VOCAB, (n, t), generator=gen), torch.randint(
        0, VOCAB, (n, t), generator=gen
    )


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


@pytest.mark.parametrize("how", ["positions", "buckets"])
def test_rows_made_inside_and_broadcast_are_refused_when_they_number_the_examples(how: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(how).to(D)
    idx, y = _batch(4, 4)  # T == N
    with (
        pytest.raises(
            GradkitError,
            match=r"wpe \(Embedding\) was called on tensors made inside.*arange\(T\)\[None\]",
        ),
        track(model, "variance", loss_reduction="sum"),
    ):
        _loss(model(idx), y).backward()


@pytest.mark.parametrize(
    ("how", "n", "t"),
    [("positions", 3, 4), ("positions_batched", 4, 4), ("cls_ids", 4, 4), ("cls_ids", 3, 4)],
)
def test_rows_made_inside_that_are_the_examples_or_broadcast_by_shape_are_exact(
    how: str, n: int, t: int
) -> None:
    torch.manual_seed(0)
    model = TinyGPT(how).to(D)
    idx, y = _batch(n, t)
    want = per_example_grads(model, _loss, idx, y)
    with track(model, "batch_grad", "variance", loss_reduction="sum") as stats:
        _loss(model(idx), y).backward()
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


class Flattened(nn.Module):
    """Rows of positions flattened for a Linear: ``[N, T, d]`` (the examples' rows together) or
    a transposed ``[T, N, d]`` (each example's rows apart), both ``[N * T, d]``."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        h = self.a(x)
        if self.transposed:
            return self.b(h.transpose(0, 1).reshape(t * n, 4)).view(t, n, 2).sum(0)
        return self.b(h.reshape(n * t, 4)).view(n, t, 2).sum(1)


def test_rows_flattened_from_positions_first_are_refused_when_t_equals_n() -> None:
    """With T != N the row count already told; with T == N only the graph does."""
    torch.manual_seed(0)
    model = Flattened(transposed=True).to(D)
    x = torch.randn(3, 3, 3, dtype=D)
    with (
        pytest.raises(GradkitError, match=r"b \(Linear\) returned outputs of shapes \[\(9, 2\)\]"),
        track(model, "variance"),
    ):
        model(x).pow(2).sum().backward()


def test_rows_flattened_from_examples_first_are_exact_when_t_equals_n() -> None:
    torch.manual_seed(0)
    model = Flattened(transposed=False).to(D)
    x, y = torch.randn(3, 3, 3, dtype=D), torch.randn(3, 2, dtype=D)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).sum()

    want = per_example_grads(model, loss, x, y)
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        loss(model(x), y).backward()
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


class TimeMean(nn.Module):
    """Sequence-first activations ``[T, N, F]`` reduced over time (``mean(0)``) or read at the
    last step (``[-1]``) for the head: with T == N the sizes cannot tell time from examples."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.head(h.mean(0) if self.read == "mean" else h[-1])


@pytest.mark.parametrize("read", ["mean", "last"])
def test_sequence_first_activations_with_as_many_steps_as_examples(read: str) -> None:
    """Without batch_dim the layer's output [T, N, F] reads as [N, T, F]: its mean over time
    looks like a per-example mean, and a's per-example gradients came out 58 % off. The walk
    from the head finds the examples in dimension 1 of a's output, which its call holds in
    dimension 0, and refuses; with batch_dim=1 every statistic is the loop's."""
    torch.manual_seed(0)
    model = TimeMean(read).to(D)
    x, y = torch.randn(4, 4, 3, dtype=D), torch.randint(0, 2, (4,))
    refused = pytest.raises(GradkitError, match=r"batch_dim: .*dimension 1 of the output of a")
    with refused, track(model, "batch_grad", loss_reduction="sum"):
        F.cross_entropy(model(x), y, reduction="sum").backward()
    model.zero_grad()
    with track(model, "batch_grad", loss_reduction="sum", batch_dim={"a": 1, "head": 0}) as st:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    want = per_example_grads(
        model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y, batch_dim=1
    )
    for name, g in want.items():
        assert_close(st[name].batch_grad, g, rtol=1e-10, atol=1e-12, name=name)

"""Per-example results are given in the examples' order, or refused: a layer whose input rows
reach it reordered along the batch (a flip, a roll, an index; rows sorted by length for
``pack_padded_sequence`` and restored after) has rows that are not the examples in order.

Found by a probe: ``b(h.flip(0)).flip(0)`` and the sort, pack, LSTM, unsort idiom gave such
layers' ``batch_grad`` and ``batch_l2`` in the permuted order, and ``stats.batch_l2()`` summed
the norms of different examples, silently. The order-free statistics were right, and stay
readable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64
N = 4


class Reordered(nn.Module):
    """``b`` called on the rows of ``tanh(a(x))`` reordered by ``how``, then restored."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        n = x.shape[0]
        perm = torch.tensor([2, 0, 3, 1][:n]) if n == N else torch.arange(n)
        inverse = perm.argsort()
        if self.how == "flip":
            return self.b(h.flip(0)).flip(0)
        if self.how == "roll":
            return self.b(h.roll(1, 0)).roll(-1, 0)
        if self.how == "index":
            return self.b(h[perm])[inverse]
        if self.how == "index_select":
            return self.b(h.index_select(0, perm)).index_select(0, inverse)
        if self.how == "cat":  # the halves swapped by slices (a roll), then back
            return self.b(torch.cat([h[n // 2 :], h[: n // 2]])).roll(n // 2, 0)
        if self.how == "unbind_stack":  # reversed by unbind and stack, then back
            return self.b(torch.stack(h.unbind(0)[::-1])).flip(0)
        if self.how == "cat_restored":  # swapped and swapped back before b
            s = torch.cat([h[1:], h[:1]])
            return self.b(torch.cat([s[-1:], s[:-1]]))
        if self.how == "restored":  # reordered and restored before b: in order
            return self.b(h[perm].flip(0).flip(0)[inverse])
        if self.how == "identity":  # an index that keeps the order
            return self.b(h[torch.arange(n)])
        raise AssertionError(self.how)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    return torch.randn(N, 3, dtype=D, generator=gen), torch.randn(N, 2, dtype=D, generator=gen)


@pytest.mark.parametrize("how", ["flip", "roll", "index", "index_select", "cat", "unbind_stack"])
def test_per_example_results_of_a_layer_on_reordered_rows_are_refused(how: str) -> None:
    torch.manual_seed(0)
    model = Reordered(how).to(D)
    x, y = _data()
    want = per_example_grads(model, _loss, x, y)
    with track(model, "batch_grad", "batch_l2", "variance", loss_reduction="sum") as stats:
        _loss(model(x), y).backward()
    for read in (
        lambda: stats["b.weight"].batch_grad,
        lambda: stats["b.bias"].batch_l2,
        lambda: stats.batch_l2(),
    ):
        with pytest.raises(GradkitError, match=r"b \(Linear\) called on rows reordered"):
            read()
    for name, g in want.items():  # the order-free statistics, and the layer in order
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-8, atol=1e-12)
        if name.startswith("a."):
            assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", ["restored", "identity", "cat_restored"])
def test_rows_in_order_again_are_exact(how: str) -> None:
    torch.manual_seed(0)
    model = Reordered(how).to(D)
    x, y = _data()
    want = per_example_grads(model, _loss, x, y)
    with track(model, "batch_grad", "batch_l2", loss_reduction="sum") as stats:
        _loss(model(x), y).backward()
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)
    total = sum(g.flatten(1).square().sum(1) for g in want.values())
    assert_close(stats.batch_l2(), total, rtol=1e-10, atol=1e-12)


class SortedRNN(nn.Module):
    """The rows sorted by length for ``pack_padded_sequence``, an LSTM, and the last states
    restored to the examples' order for the head (``enforce_sorted=False`` does the same
    inside torch, which the LSTM's rule follows)."""

    def __init__(self, sort_here: bool) -> None:
        super().__init__()
        self.sort_here = sort_here
        self.emb = nn.Embedding(9, 4)
        self.rnn = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if not self.sort_here:
            packed = pack_padded_sequence(
                self.emb(ids), lengths.cpu(), batch_first=True, enforce_sorted=False
            )
            _, (h, _) = self.rnn(packed)
            return self.head(h[-1])
        lengths, order = lengths.sort(descending=True)
        packed = pack_padded_sequence(self.emb(ids)[order], lengths.cpu(), batch_first=True)
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1][order.argsort()])


def _each_alone(
    model: nn.Module, ids: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``[N, *shape]`` per parameter: each example's gradient alone, on its own length."""
    want: dict[str, list[torch.Tensor]] = {}
    for i in range(N):
        loss = F.cross_entropy(
            model(ids[i : i + 1, : lengths[i]], lengths[i : i + 1]), y[i : i + 1]
        )
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads, strict=True):
            want.setdefault(name, []).append(g)
    return {name: torch.stack(gs) for name, gs in want.items()}


@pytest.mark.parametrize("sort_here", [True, False])
def test_rows_sorted_for_packing_and_restored(sort_here: bool) -> None:
    torch.manual_seed(0)
    model = SortedRNN(sort_here).to(D)
    ids = torch.randint(1, 9, (N, 5))
    lengths = torch.tensor([2, 5, 3, 4])
    y = torch.randint(0, 3, (N,))
    want = _each_alone(model, ids, lengths, y)
    with track(model, "batch_grad", "batch_l2", "variance", loss_reduction="sum") as stats:
        F.cross_entropy(model(ids, lengths), y, reduction="sum").backward()
    for name, g in want.items():
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-8, atol=1e-12)
        if sort_here and name.startswith("rnn."):  # the LSTM ran on the sorted rows
            with pytest.raises(GradkitError, match=r"rnn \(LSTM\) called on rows reordered"):
                _ = stats[name].batch_grad
        else:  # the head on rows restored to the examples' order, the embedding before
            assert_close(stats[name].batch_grad, g, rtol=1e-8, atol=1e-12)


class BiGRU(nn.Module):
    """Both directions' last states of a bidirectional GRU on a packed embedding, combined for
    the head (``flip``: one of them with its rows reversed: each row then mixes two examples)."""

    def __init__(self, combine: str) -> None:
        super().__init__()
        self.combine = combine
        self.emb = nn.Embedding(9, 4)
        self.rnn = nn.GRU(4, 5, batch_first=True, bidirectional=True)
        self.head = nn.Linear(10 if combine != "sum" else 5, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(
            self.emb(ids), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        _, h = self.rnn(packed)
        if self.combine == "cat":
            return self.head(torch.cat([h[-2], h[-1]], -1))
        if self.combine == "sum":
            return self.head(h[0] + h[1])
        return self.head(torch.cat([h[-2], h[-1].flip(0)], -1))


@pytest.mark.parametrize("combine", ["cat", "sum", "flip"])
def test_one_order_reached_along_two_paths_is_that_order(combine: str) -> None:
    """The walk reaches the GRU's output (rows in the examples' order, unsorted from the packed
    order) through two selections: one order, not a reordering (it was refused)."""
    torch.manual_seed(0)
    model = BiGRU(combine).to(D)
    ids = torch.randint(1, 9, (N, 5))
    lengths = torch.tensor([2, 5, 3, 4])
    y = torch.randint(0, 3, (N,))
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        F.cross_entropy(model(ids, lengths), y, reduction="sum").backward()
    if combine == "flip":
        with pytest.raises(GradkitError, match=r"input of head \(Linear\) combining the rows"):
            _ = stats["head.weight"].batch_grad
        return
    want = _each_alone(model, ids, lengths, y)
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-8, atol=1e-12, name=name)


def test_reordered_rows_used_by_two_layers_flag_both() -> None:
    """The walk of the second layer's input goes through the same reordering as the first's
    (a cache of nodes seen in order once let the second through)."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x)).flip(0)
            return (self.b(h) + self.c(h)).flip(0)

    torch.manual_seed(0)
    model = Two().to(D)
    x, y = _data()
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        _loss(model(x), y).backward()
    for name in ("b.weight", "c.weight"):
        with pytest.raises(GradkitError, match=r"called on rows reordered"):
            _ = stats[name].batch_grad
    assert stats["a.weight"].batch_grad.shape == (N, 3, 3)


class PaddedHead(nn.Module):
    """A GRU on a packed sequence (``enforce_sorted=False``), its padded outputs unpacked by
    ``pad_packed_sequence`` (which puts the rows back in the examples' order) and a head on
    every position; ``resort`` sorts the unpacked rows by length again before the head."""

    def __init__(self, batch_first: bool, resort: bool = False) -> None:
        super().__init__()
        self.batch_first, self.resort = batch_first, resort
        self.rnn = nn.GRU(3, 5, batch_first=batch_first)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        bf = self.batch_first
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=bf, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=bf, total_length=6)
        if not bf:
            out = out.transpose(0, 1)
        if self.resort:
            assert packed.sorted_indices is not None
            out = out.index_select(0, packed.sorted_indices)
        return self.head(out).pow(2).sum((1, 2))


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_head_on_unpacked_rows_is_in_the_examples_order(batch_first: bool) -> None:
    """``pad_packed_sequence`` unpacks in the sorted order and restores the examples' order by
    ``unsorted_indices``: the head's per-example results were refused as reordered (with
    batch_first=True), advising the enforce_sorted=False the model used."""
    torch.manual_seed(0)
    model = PaddedHead(batch_first).to(D)
    lengths = torch.tensor([6, 3, 5, 2])
    x = torch.randn(N, 6, 3, dtype=D)
    xs = x if batch_first else x.transpose(0, 1).contiguous()
    kw = {} if batch_first else {"batch_dim": {"": 1, "head": 0}}
    want = {}
    for i in range(N):
        xi = x[i : i + 1] if batch_first else x[i : i + 1].transpose(0, 1)
        grads = torch.autograd.grad(model(xi, lengths[i : i + 1]).sum(), list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads, strict=True):
            want.setdefault(name, []).append(g)
    with track(model, "batch_grad", "batch_l2", loss_reduction="sum", **kw) as stats:
        model(xs, lengths).sum().backward()
    for name, gs in want.items():
        assert_close(stats[name].batch_grad, torch.stack(gs), rtol=1e-8, atol=1e-12)
    resorted = PaddedHead(True, resort=True).to(D)
    with track(resorted, "batch_grad", loss_reduction="sum") as stats:
        resorted(x, lengths).sum().backward()
    with pytest.raises(GradkitError, match=r"head \(Linear\) called on rows reordered"):
        _ = stats["head.weight"].batch_grad

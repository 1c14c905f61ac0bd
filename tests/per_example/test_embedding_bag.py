"""The ``nn.EmbeddingBag`` rule against a one-bag-at-a-time autograd loop in float64 (rtol 1e-10).

Each bag is one example: the oracle calls the module on that bag alone (the same layout: 2-D,
offsets positional or keyword, ``include_last_offset``) and differentiates that bag's loss.
``gradkit.testing.per_example_grads`` cannot pass offsets, hence the loop here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradkit
from gradkit import GradkitError
from gradkit.per_example import RuleContext, Use
from gradkit.per_example.rules._embedding_bag import embedding_bag_rule
from gradkit.testing import assert_close

V, D, OUT = 12, 3, 2
LENGTHS = (3, 0, 4, 1, 2, 3, 2)  # bag 1 is empty; bag 3 only padding when padding_idx is set
Call = tuple[tuple[Any, ...], dict[str, Any]]


def cubic_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-bag losses ``[N]``, asymmetric so odd moments are not trivially symmetric."""
    return (out * y + 0.3 * out**3).flatten(1).sum(1)


class Bags:
    """``n`` bags of row indices (with a repeat, padding entries, an empty bag) and optional
    per-sample weights; :meth:`call` packs any subset as the module's arguments."""

    def __init__(self, n: int, layout: str, pad: int | None, weighted: bool, seed: int) -> None:
        g = torch.Generator(torch.get_default_device()).manual_seed(seed)
        self.layout, self.pad = layout, pad
        lengths = [4] * n if layout == "2d" else [LENGTHS[b % len(LENGTHS)] for b in range(n)]
        self.idx = [torch.randint(1, V, (k,), generator=g) for k in lengths]
        self.idx[0][1] = self.idx[0][0]  # a row twice in one bag
        if pad is not None:
            for b, bag in enumerate(self.idx):
                if len(bag) >= 2 and b % 2 == 0:
                    bag[-1] = pad
                if len(bag) == 1:
                    bag[0] = pad  # a bag of padding only: empty for mean's count
        self.w = [torch.randn(k, generator=g, dtype=torch.float64) for k in lengths]
        self.weighted = weighted
        self.y = torch.randn(n, OUT, generator=g, dtype=torch.float64)

    def call(self, bags: list[int]) -> Call:
        idx = [self.idx[b] for b in bags]
        w = [self.w[b] for b in bags] if self.weighted else None
        if self.layout == "2d":  # [N, L], per_sample_weights positional after offsets=None
            return (torch.stack(idx), None, None if w is None else torch.stack(w)), {}
        starts = torch.tensor([0] + [len(i) for i in idx]).cumsum(0)
        flat, wflat = torch.cat(idx), None if w is None else torch.cat(w)
        if self.layout == "last":  # include_last_offset: offsets end with the input's length
            return (flat, starts, wflat), {}
        if self.layout == "offsets":
            return (flat, starts[:-1], wflat), {}
        kw = {"offsets": starts[:-1]} | ({} if wflat is None else {"per_sample_weights": wflat})
        return (flat,), kw  # layout "keyword"

    def cast(self, call: Call, dtype: torch.dtype) -> Call:
        def c(t: Any) -> Any:
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tuple(c(a) for a in call[0]), {k: c(v) for k, v in call[1].items()}


class BagNet(nn.Module):
    """EmbeddingBag -> Linear; arguments passed to the bag as given (positional or keyword)."""

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        super().__init__()
        self.bag, self.lin = bag, nn.Linear(D, OUT)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.lin(torch.tanh(self.bag(*args, **kwargs)))


def make_model(mode: str, pad: int | None, layout: str, head: bool = True) -> nn.Module:
    bag = nn.EmbeddingBag(
        V, D if head else OUT, mode=mode, padding_idx=pad, include_last_offset=layout == "last"
    )
    return (BagNet(bag) if head else bag).double()


def oracle(
    model: nn.Module, data: Any, n: int, loss_fn: Callable[..., torch.Tensor] = cubic_loss
) -> dict[str, torch.Tensor]:
    """Per-example gradients by a loop over bags in float64."""
    m = copy.deepcopy(model).double()
    named = [(k, p) for k, p in m.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {k: [] for k, _ in named}
    for b in range(n):
        args, kwargs = data.cast(data.call([b]), torch.float64)
        loss = loss_fn(m(*args, **kwargs), data.y[b : b + 1]).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (k, p), g in zip(named, grads, strict=True):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(r) for k, r in rows.items()}


def tracked(
    model: nn.Module,
    data: Any,
    splits: list[int],
    reduction: str,
    dtype: torch.dtype = torch.float64,
    loss_fn: Callable[..., torch.Tensor] = cubic_loss,
) -> gradkit.per_example.Tracker:
    with gradkit.per_example.track(
        model, "mean", "second_moment", "variance", "batch_l2", "batch_grad",
        moments=(3,), loss_reduction=reduction, fallback="error",
    ) as stats:  # fmt: skip
        start = 0
        for size in splits:
            bags = list(range(start, start + size))
            args, kwargs = data.cast(data.call(bags), dtype)
            losses = loss_fn(model(*args, **kwargs), data.y[bags].to(dtype))
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
            start += size
    return stats


def check(stats: Any, ref: dict[str, torch.Tensor], rtol: float = 1e-10, atol: float = 1e-12):
    got, want = {}, {}
    for name, g in ref.items():
        s = stats[name]
        got[name] = [s.mean, s.second_moment, s.variance, s.moment(3), s.batch_l2, s.batch_grad]
        want[name] = [
            g.mean(0),
            (g**2).mean(0),
            g.var(0, unbiased=False),
            (g**3).mean(0),
            g.flatten(1).square().sum(1),
            g,
        ]
    assert stats.num_examples == next(iter(ref.values())).shape[0]
    assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("layout", ["2d", "offsets", "keyword", "last"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("pad", [None, 0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("splits", [[5], [2, 3]], ids=["one", "micro"])
def test_matches_per_bag_loop(layout, mode, pad, reduction, splits):
    data = Bags(sum(splits), layout, pad, weighted=False, seed=len(splits))
    model = make_model(mode, pad, layout)
    check(tracked(model, data, splits, reduction), oracle(model, data, sum(splits)))


@pytest.mark.parametrize("layout", ["2d", "offsets", "keyword", "last"])
@pytest.mark.parametrize("splits", [[6], [4, 2]], ids=["one", "micro"])
def test_per_sample_weights(layout, splits):
    data = Bags(sum(splits), layout, 0, weighted=True, seed=3)
    model = make_model("sum", 0, layout)
    check(tracked(model, data, splits, "mean"), oracle(model, data, sum(splits)))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_alone(mode):
    """A plain EmbeddingBag (no head): the output gradient is the loss's alone."""
    data = Bags(7, "offsets", 0, weighted=False, seed=4)
    model = make_model(mode, 0, "offsets", head=False)
    check(tracked(model, data, [3, 4], "sum"), oracle(model, data, 7))


def test_max_ties_follow_torch():
    """Tied values in a bag: each bag's gradient goes where torch's own backward sends it."""
    data = Bags(7, "offsets", None, weighted=False, seed=5)
    model = make_model("max", None, "offsets", head=False)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-1, 2, model.weight.shape))
    check(tracked(model, data, [7], "sum"), oracle(model, data, 7))


class TwoUses(nn.Module):
    """One EmbeddingBag called twice per example (positional, then keyword offsets)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, OUT, mode=mode, padding_idx=0)

    def forward(self, a: torch.Tensor, oa: torch.Tensor, b: torch.Tensor, ob: torch.Tensor):
        return self.bag(a, oa) * torch.tanh(self.bag(b, offsets=ob))


class PairedBags:
    """Example ``n`` = bag ``n`` of each of two bag sets, for :class:`TwoUses`."""

    def __init__(self, n: int) -> None:
        self.a = Bags(n, "offsets", 0, weighted=False, seed=6)
        self.b = Bags(n, "offsets", 0, weighted=False, seed=7)
        self.y = self.a.y

    def call(self, bags: list[int]) -> Call:
        (a, oa, _), _ = self.a.call(bags)
        (b, ob, _), _ = self.b.call(bags)
        return (a, oa, b, ob), {}

    def cast(self, call: Call, dtype: torch.dtype) -> Call:
        return call


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_uses_are_summed_per_example(mode):
    data = PairedBags(6)
    model = TwoUses(mode).double()
    check(tracked(model, data, [2, 4], "mean"), oracle(model, data, 6))


class Tied(nn.Module):
    """An EmbeddingBag whose weight is also the output Linear's."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="mean")
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.bag.weight

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.out(torch.tanh(self.bag(*args, **kwargs)))


def test_weight_shared_with_linear():
    data = Bags(5, "keyword", None, weighted=False, seed=8)
    gen = torch.Generator(torch.get_default_device()).manual_seed(9)
    data.y = torch.randn(5, V, generator=gen, dtype=torch.float64)
    model = Tied().double()
    check(tracked(model, data, [5], "sum"), oracle(model, data, 5))


def test_nested_input():
    """A jagged nested tensor of bags, as torch's EmbeddingBag accepts it."""
    data = Bags(5, "offsets", 0, weighted=False, seed=10)
    model = make_model("mean", 0, "offsets")
    x = torch.nested.nested_tensor([data.idx[b] for b in range(5)], layout=torch.jagged)
    with gradkit.per_example.track(model, "batch_grad", loss_reduction="sum") as stats:
        cubic_loss(model(x), data.y).sum().backward()
    assert_close(stats["bag.weight"].batch_grad, oracle(model, data, 5)["bag.weight"])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_float32_agrees(mode):
    data = Bags(6, "offsets", 0, weighted=mode == "sum", seed=11)
    model = make_model(mode, 0, "offsets")
    ref = oracle(model, data, 6)
    stats = tracked(model.float(), data, [6], "mean", dtype=torch.float32)
    assert stats["bag.weight"].batch_grad.dtype == torch.float32
    want = {k: g.float() for k, g in ref.items()}
    got = {k: stats[k].batch_grad for k in ref}
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    got = {k: [stats[k].mean, stats[k].second_moment, stats[k].batch_l2] for k in ref}
    want = {k: [g.mean(0), (g**2).mean(0), g.flatten(1).square().sum(1)] for k, g in want.items()}
    assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_grad_is_untouched(mode):
    data = Bags(5, "offsets", 0, weighted=mode == "sum", seed=12)
    model = make_model(mode, 0, "offsets")
    args, kwargs = data.call(list(range(5)))
    cubic_loss(model(*args, **kwargs), data.y).mean().backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    tracked(model, data, [5], "mean")
    assert all(torch.equal(p.grad, plain[k]) for k, p in model.named_parameters())


def test_max_norm_is_refused():
    model = nn.EmbeddingBag(V, D, max_norm=1.0).double()
    x, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    with (
        pytest.raises(GradkitError, match=r"EmbeddingBag\(12, 3\)\.max_norm.*in place"),
        gradkit.per_example.track(model, "variance"),
    ):
        model(x, offsets).sum().backward()


def test_scale_grad_by_freq_is_refused():
    model = nn.EmbeddingBag(V, D, scale_grad_by_freq=True).double()
    x, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    with (
        pytest.raises(GradkitError, match=r"scale_grad_by_freq.*whole batch"),
        gradkit.per_example.track(model, "variance"),
    ):
        model(x, offsets).sum().backward()


def test_a_rules_refusal_names_the_module_it_was_raised_for():
    """The rule names the layer by its class (``Embedding(8, 4)``); in a model of many, the
    note says which module it was."""
    model = nn.Sequential(
        nn.Embedding(8, 4, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 2)
    )
    with pytest.raises(GradkitError) as raised, gradkit.per_example.track(model, "variance"):
        model(torch.randint(0, 8, (5, 3))).sum().backward()
    assert "(raised by the per-example rule of 0 (Embedding))" in raised.value.__notes__


def test_entries_past_the_last_offset_are_refused():
    """torch ignores them in the forward but not in its backward (wrong p.grad): refuse."""
    model = nn.EmbeddingBag(V, D, include_last_offset=True).double()
    x, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3])
    with (
        pytest.raises(GradkitError, match=r"offsets\[-1\] == 4.*got offsets\[-1\] == 3"),
        gradkit.per_example.track(model, "variance"),
    ):
        model(x, offsets).sum().backward()


def test_output_gradient_of_another_shape_is_refused():
    model = nn.EmbeddingBag(V, D).double()
    x, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1])
    use = Use((x, offsets), torch.ones(2, 2 * D, dtype=torch.float64))
    with pytest.raises(GradkitError, match=r"grad_output: expected .*\[2, 3\], got Tensor"):
        embedding_bag_rule(model, [use], RuleContext(dict(model.named_parameters())))


def test_bags_are_the_examples_whatever_batch_dim_says():
    """The layout decides: an EmbeddingBag's output is [bags, d] under any batch_dim."""
    model = nn.EmbeddingBag(V, D).double()
    x, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1])
    results = []
    for batch_dim in (0, 1):
        with gradkit.per_example.track(model, "batch_grad", batch_dim=batch_dim) as stats:
            model(x, offsets).sum().backward()
        results.append(stats["weight"].batch_grad)
    assert results[0].shape[0] == 2
    assert torch.equal(results[0], results[1])

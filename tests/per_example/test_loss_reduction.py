"""The loss reduction read from the graph of torch losses built of several nodes.

``F.l1_loss``, ``F.kl_div``, ``F.gaussian_nll_loss``, ``F.poisson_nll_loss``,
``F.multilabel_soft_margin_loss``, ``F.cosine_embedding_loss`` and ``F.cross_entropy`` with
class probabilities or label smoothing save no ``reduction``: their node chains are matched.
For each, a contradicting ``loss_reduction`` is refused (leaving ``p.grad`` as it was) and the
matching one gives the statistics of the one-example-at-a-time loop in float64, for N = 6 and
N = 1. What cannot be told from a user's constant (``sum / k``, ``kl_div(reduction='batchmean')``)
goes through. A class-weighted mean cross entropy is refused under ``"mean"`` (its examples'
shares are ``w[y_i] / sum(w[y])``) and read as a sum of those shares under ``"sum"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64
C = 4  # classes, or outputs of the model


def targets(n: int, seed: int = 0) -> torch.Tensor:
    """Every loss's targets in one ``[n, 18]`` tensor (the oracle slices its rows): a class
    index, 4 regression targets, 4 class probabilities, 4 multilabel bits, 4 variances, a
    cosine sign."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    index = torch.arange(n) % C  # every class present from n = 4 on
    return torch.cat(
        [
            index[:, None].to(D),
            torch.randn(n, C, generator=g, dtype=D),
            torch.randn(n, C, generator=g, dtype=D).softmax(1),
            (torch.rand(n, C, generator=g, dtype=D) > 0.5).to(D),
            torch.rand(n, C, generator=g, dtype=D) + 0.5,
            torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)[:, None].to(D),
        ],
        1,
    )


def idx(t: torch.Tensor) -> torch.Tensor:
    return t[:, 0].long()


def reg(t: torch.Tensor) -> torch.Tensor:
    return t[:, 1:5]


def probs(t: torch.Tensor) -> torch.Tensor:
    return t[:, 5:9]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t[:, 9:13]


def var(t: torch.Tensor) -> torch.Tensor:
    return t[:, 13:17]


def sign(t: torch.Tensor) -> torch.Tensor:
    return t[:, 17]


def kl_div(o: torch.Tensor, t: torch.Tensor, r: str, log_target: bool = False) -> torch.Tensor:
    target = probs(t).log() if log_target else probs(t)
    with warnings.catch_warnings():  # reduction='mean' warns that it divides by N * C
        warnings.simplefilter("ignore", UserWarning)
        return F.kl_div(o.log_softmax(1), target, reduction=r, log_target=log_target)


Loss = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]

# name: (loss(output, targets, reduction), the reductions a contradiction is refused for)
LOSSES: dict[str, tuple[Loss, tuple[str, ...]]] = {
    "cross_entropy_label_smoothing": (
        lambda o, t, r: F.cross_entropy(o, idx(t), label_smoothing=0.1, reduction=r),
        ("mean", "sum"),
    ),
    "cross_entropy_probabilities": (
        lambda o, t, r: F.cross_entropy(o, probs(t), reduction=r),
        ("mean", "sum"),
    ),
    "cross_entropy_probabilities_label_smoothing": (
        lambda o, t, r: F.cross_entropy(o, probs(t), label_smoothing=0.2, reduction=r),
        ("mean", "sum"),
    ),
    "cross_entropy_probabilities_weight": (  # a weight holds a constant: its sum is not read
        lambda o, t, r: F.cross_entropy(
            o, probs(t), weight=torch.linspace(0.5, 2.0, C, dtype=o.dtype), reduction=r
        ),
        ("mean",),
    ),
    "l1_loss": (lambda o, t, r: F.l1_loss(o, reg(t), reduction=r), ("mean", "sum")),
    "l1_loss_one_output": (
        lambda o, t, r: F.l1_loss(o[:, 0], reg(t)[:, 0], reduction=r),
        ("mean", "sum"),
    ),
    "kl_div": (kl_div, ("mean", "sum")),
    "kl_div_log_target": (
        lambda o, t, r: kl_div(o, t, r, log_target=True),
        ("mean", "sum"),
    ),
    "gaussian_nll_loss": (
        lambda o, t, r: F.gaussian_nll_loss(o, reg(t), var(t), reduction=r),
        ("mean", "sum"),
    ),
    "gaussian_nll_loss_full_learned_var": (
        lambda o, t, r: F.gaussian_nll_loss(
            o[:, :2], reg(t)[:, :2], o[:, 2:].exp(), full=True, reduction=r
        ),
        ("mean", "sum"),
    ),
    "poisson_nll_loss": (
        lambda o, t, r: F.poisson_nll_loss(o, reg(t).abs(), reduction=r),
        ("mean", "sum"),
    ),
    "poisson_nll_loss_rates_full": (
        lambda o, t, r: F.poisson_nll_loss(
            o.exp(), 3 * reg(t).abs(), log_input=False, full=True, reduction=r
        ),
        ("mean", "sum"),
    ),
    "multilabel_soft_margin_loss": (  # its / C could be a user's / N: the sum is not read
        lambda o, t, r: F.multilabel_soft_margin_loss(o, bits(t), reduction=r),
        ("mean",),
    ),
    "cosine_embedding_loss": (
        lambda o, t, r: F.cosine_embedding_loss(o, reg(t), sign(t), margin=0.2, reduction=r),
        ("mean", "sum"),
    ),
}
OTHER = {"mean": "sum", "sum": "mean"}
REFUSED = [(name, r) for name, (_, rs) in LOSSES.items() for r in rs]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, C)).to(D)


def inputs(n: int) -> torch.Tensor:
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(n, 5, generator=gen, dtype=D)


def check_stats(stats, ref: dict[str, torch.Tensor]) -> None:
    """The statistics against the oracle's per-example gradients ``ref``."""
    got = {k: [stats[k].mean, stats[k].variance, stats[k].batch_grad] for k in ref}
    want = {k: [g.mean(0), g.var(0, unbiased=False), g] for k, g in ref.items()}
    assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("loss", "reduction"), REFUSED, ids=[f"{a}-{b}" for a, b in REFUSED])
def test_a_contradicting_declaration_is_refused(loss, reduction):
    fn, _ = LOSSES[loss]
    net, x, t = model(), inputs(6), targets(6)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    declared = OTHER[reduction]
    with track(net, "variance", loss_reduction=declared), pytest.raises(GradkitError) as err:
        fn(net(x), t, reduction).backward()
    text = str(err.value)
    assert f"loss_reduction={declared!r}" in text, text
    assert f"pass loss_reduction={reduction!r}" in text, text
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in net.parameters())


@pytest.mark.parametrize("loss", ["l1_loss", "cross_entropy_label_smoothing", "kl_div"])
def test_a_contradiction_is_refused_below_a_regularizer(loss):
    fn, _ = LOSSES[loss]
    net, x, t = model(), inputs(6), targets(6)
    with track(net, "variance", loss_reduction="sum"), pytest.raises(GradkitError, match="mean"):
        (fn(net(x), t, "mean") + 1e-3 * net[0].weight.square().sum()).backward()


@pytest.mark.parametrize("n", [6, 1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_matching_declaration_gives_the_loop_statistics(loss, reduction, n):
    fn, _ = LOSSES[loss]
    net, x, t = model(), inputs(n), targets(n)
    ref = per_example_grads(net, lambda o, y: fn(o, y, reduction), x, t)
    with track(net, "mean", "variance", "batch_grad", loss_reduction=reduction) as stats:
        fn(net(x), t, reduction).backward()
    check_stats(stats, ref)


# -- what a user's constant could have made: not read ----------------------------------------


def test_a_division_written_in_python_is_not_read_as_a_mean():
    """``sum / k`` with ``k == N`` (k micro-batches of N examples) is a sum declared with
    ``loss_scale``; ``kl_div(reduction='batchmean')`` is that same graph, so it goes through
    either way (declared ``"sum"``, its statistics are of ``g_i / N``)."""
    net, x, t = model(), inputs(6), targets(6)
    ref = per_example_grads(net, lambda o, y: F.cross_entropy(o, probs(y), reduction="sum"), x, t)
    with track(net, "mean", "variance", "batch_grad", loss_reduction="sum", loss_scale=1 / 6) as s:
        (F.cross_entropy(net(x), probs(t), reduction="sum") / 6).backward()
    check_stats(s, ref)
    ref = per_example_grads(net, lambda o, y: kl_div(o, y, "sum"), x, t)
    with track(net, "mean", "variance", "batch_grad") as stats:
        kl_div(net(x), t, "batchmean").backward()
    check_stats(stats, ref)
    with track(net, "mean", "variance", "batch_grad", loss_reduction="sum") as stats:
        kl_div(net(x), t, "batchmean").backward()
    check_stats(stats, {k: g / 6 for k, g in ref.items()})


def test_unequal_micro_batches_summed_over_the_total_count_give_the_large_batch():
    """The documented recipe for micro-batches of unequal sizes: each one's summed loss over
    the total ``N`` (the same constant in every pass), declared ``loss_reduction="sum"``,
    ``loss_scale=1/N``, gives the statistics of one pass over all ``N`` examples and the mean
    gradient over them in ``p.grad``."""
    net, x, t = model(), inputs(7), targets(7)
    ref = per_example_grads(net, lambda o, y: F.cross_entropy(o, idx(y)), x, t)
    net.zero_grad(set_to_none=True)
    with track(net, "mean", "variance", "batch_grad", loss_reduction="sum", loss_scale=1 / 7) as s:
        for part in (slice(0, 3), slice(3, 7)):
            (F.cross_entropy(net(x[part]), idx(t[part]), reduction="sum") / 7).backward()
    check_stats(s, ref)
    assert_close(
        {k: p.grad for k, p in net.named_parameters()},
        {k: g.mean(0) for k, g in ref.items()},
        rtol=1e-10,
        atol=1e-12,
    )


def test_micro_batch_means_times_their_shares_give_the_scaled_gradients_statistics():
    """Undeclared factors are not read (the engine has freed them before any tracked hook):
    each micro-batch's mean times its share ``n_b / N`` gives the statistics of the
    per-example gradients as backpropagated, ``n_b / N * g_i``, mixed over micro-batches, as
    the documentation says (the reason for the recipe above)."""
    net, x, t = model(), inputs(7), targets(7)
    ref = per_example_grads(net, lambda o, y: F.cross_entropy(o, idx(y)), x, t)
    shares = torch.tensor([3 / 7] * 3 + [4 / 7] * 4, dtype=D)
    with track(net, "mean", "variance", "batch_grad") as s:
        for part in (slice(0, 3), slice(3, 7)):
            size = part.stop - part.start
            (F.cross_entropy(net(x[part]), idx(t[part])) * size / 7).backward()
    scaled = {k: g * shares.view(-1, *[1] * (g.dim() - 1)) for k, g in ref.items()}
    check_stats(s, scaled)
    variance = {k: s[k].variance for k in ref}
    with pytest.raises(AssertionError):  # not the large batch's: the factors differ
        assert_close(variance, {k: g.var(0, unbiased=False) for k, g in ref.items()})


def test_per_example_losses_divided_by_the_batch_size_then_summed_are_a_mean():
    """A hand-written multilabel loss ``(per_example / N).sum()`` has the node chain of
    ``multilabel_soft_margin_loss(reduction='sum')`` with ``N`` for ``C``: a mean, not
    refused."""

    def per_example(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        y = bits(t)
        return -(y * F.logsigmoid(o) + (1 - y) * F.logsigmoid(-o)).sum(1)

    net, x, t = model(), inputs(C), targets(C)
    ref = per_example_grads(net, lambda o, y: per_example(o, y).sum(), x, t)
    with track(net, "mean", "variance", "batch_grad") as stats:
        (per_example(net(x), t) / C).sum().backward()
    check_stats(stats, ref)


# -- class weights and ignored targets ------------------------------------------------------


def class_weights() -> torch.Tensor:
    return torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=D)


WEIGHTED: dict[str, Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]] = {
    "cross_entropy": lambda o, y, r: F.cross_entropy(o, y, weight=class_weights(), reduction=r),
    "nll_loss": lambda o, y, r: F.nll_loss(
        o.log_softmax(1), y, weight=class_weights(), reduction=r
    ),
    "cross_entropy_label_smoothing": lambda o, y, r: F.cross_entropy(
        o, y, weight=class_weights(), label_smoothing=0.1, reduction=r
    ),
}


@pytest.mark.parametrize("loss", list(WEIGHTED))
def test_a_class_weighted_mean_is_refused_as_a_mean(loss):
    net, x, y = model(), inputs(6), idx(targets(6))
    with track(net, "variance"), pytest.raises(GradkitError) as err:
        WEIGHTED[loss](net(x), y, "mean").backward()
    text = str(err.value)
    assert "w[y_i] / sum(w[y])" in text and "loss_reduction='mean'" in text, text
    assert "pass loss_reduction='sum'" in text and "reduction='sum' (dividing" in text, text
    assert net[0].weight.grad is None


def test_a_class_weighted_mean_over_an_image_is_refused_as_a_mean():
    """``NllLoss2DBackward0`` (4-D input) saves its weight as ``NllLossBackward0`` does."""
    net, x = model(), inputs(6)
    y = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0], [0, 1], [1, 1]])[:, :, None]
    with track(net, "variance"), pytest.raises(GradkitError, match="NllLoss2DBackward0"):
        out = net(x).view(6, 2, 2, 1)
        F.cross_entropy(out, y, weight=class_weights()[:2]).backward()


@pytest.mark.parametrize("loss", list(WEIGHTED))
def test_a_class_weighted_mean_read_as_a_sum_gives_the_shares_statistics(loss):
    """Declared ``"sum"``: ``l_i = w[y_i] loss_i / sum(w[y])``, whose sum is the loss."""
    fn = WEIGHTED[loss]
    net, x, t = model(), inputs(6), targets(6)
    total = class_weights()[idx(t)].sum()
    ref = per_example_grads(net, lambda o, y: fn(o, idx(y), "sum") / total, x, t)
    with track(net, "mean", "variance", "batch_grad", loss_reduction="sum") as stats:
        fn(net(x), idx(t), "mean").backward()
    check_stats(stats, ref)


@pytest.mark.parametrize("loss", list(WEIGHTED))
def test_a_class_weighted_loss_of_one_example_is_its_mean(loss):
    fn = WEIGHTED[loss]
    net, x, t = model(), inputs(1), targets(1, seed=3)
    ref = per_example_grads(net, lambda o, y: fn(o, idx(y), "mean"), x, t)
    with track(net, "mean", "variance", "batch_grad") as stats:
        fn(net(x), idx(t), "mean").backward()
    check_stats(stats, ref)


def test_a_class_weighted_sum_is_a_sum():
    fn = WEIGHTED["cross_entropy"]
    net, x, t = model(), inputs(6), targets(6)
    ref = per_example_grads(net, lambda o, y: fn(o, idx(y), "sum"), x, t)
    with track(net, "mean", "variance", "batch_grad", loss_reduction="sum") as stats:
        fn(net(x), idx(t), "sum").backward()
    check_stats(stats, ref)
    with track(net, "variance"), pytest.raises(GradkitError, match="pass loss_reduction='sum'"):
        fn(net(x), idx(t), "sum").backward()


@pytest.mark.parametrize("declared", ["mean", "sum"])
def test_a_token_mean_with_ignored_tokens_goes_through(declared):
    """A mean over the non-ignored tokens of ``[N * T, C]`` logits: ``"mean"`` (equal counts
    per example) and ``"sum"`` (``l_i`` = the example's token losses over the batch's count)
    are both valid readings."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(2)
    net, x = model(), torch.randn(3, 4, 5, generator=gen, dtype=D)
    y = torch.tensor([[0, 1, 2, -100], [3, 2, 1, -100], [1, 1, 0, -100]])

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=-100)

    ref = per_example_grads(net, loss, x, y)
    if declared == "sum":  # the batch's 9 tokens, not the example's 3
        ref = {k: g / 3 for k, g in ref.items()}
    with track(net, "mean", "variance", "batch_grad", loss_reduction=declared) as stats:
        loss(net(x), y).backward()
    check_stats(stats, ref)


_TOKEN_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # cross entropy on [N, C, T] views its [N, 1, T] terms as [N, T]
    "per_token_sum": lambda o, y: F.cross_entropy(o, y, reduction="none").sum(),
    "per_example_mean_summed": lambda o, y: F.cross_entropy(o, y, reduction="none").mean(1).sum(),
    # flattened tokens, viewed back per example
    "flat_tokens": lambda o, y: (
        F.cross_entropy(o.transpose(1, 2).reshape(-1, o.shape[1]), y.reshape(-1), reduction="none")
        .view(y.shape)
        .mean(1)
        .sum()
    ),
}


@pytest.mark.parametrize("loss", list(_TOKEN_LOSSES))
def test_per_token_losses_viewed_per_example_are_read(loss: str) -> None:
    """A sum over examples of per-token cross entropies (its terms viewed by torch or by the
    user) declared a mean was not refused: the variance came out N**2 = 25 times the loop's."""
    torch.manual_seed(0)
    model = nn.Conv1d(3, 4, 1).double()
    x, y = torch.randn(5, 3, 6, dtype=torch.float64), torch.randint(0, 4, (5, 6))
    fn = _TOKEN_LOSSES[loss]
    refused = pytest.raises(GradkitError, match=r"loss_reduction: .*reduction='none'")
    with refused, track(model, "variance", loss_reduction="mean"):
        fn(model(x), y).backward()
    model.zero_grad()
    with track(model, "variance", loss_reduction="sum") as stats:
        fn(model(x), y).backward()
    for name, g in per_example_grads(model, fn, x, y).items():
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-9, atol=1e-12)

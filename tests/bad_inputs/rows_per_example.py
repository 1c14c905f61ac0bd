"""Bad inputs to gradkit.per_example: track() and its statistics, the derived quantities and
register_rule. A refused backward pass must leave the weights and the gradients accumulated
before it (``p.grad``) as they were; rows that must succeed compare with the float64
one-example-at-a-time loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import (
    Tracker,
    cabs_batch_size,
    gradient_snr,
    noise_scale,
    register_rule,
    track,
)
from gradkit.testing import assert_close, per_example_grads

from ._case import Case

D = torch.float64


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _x(*shape: int) -> torch.Tensor:
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(*shape, dtype=D, generator=gen)


def _with_grads(model: nn.Module) -> nn.Module:
    """Gradients accumulated before the failing call (they must survive it)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    return model


def _state(model: Callable[[], nn.Module]) -> Callable[[], Sequence[torch.Tensor]]:
    return lambda: [t for p in model().parameters() for t in (p, p.grad) if t is not None]


def _cubic(out: torch.Tensor) -> torch.Tensor:
    return (out**3 + out).flatten(1).sum(1)


def _tracked(*quantities: str, n: int = 5, **kwargs):
    """Statistics of a small MLP over ``n`` examples."""
    model = _mlp()
    with track(model, *quantities, **kwargs) as stats:
        _cubic(model(_x(n, 3))).mean().backward()
    return stats


# -- failing backward passes (state must survive) --------------------------------------------


@cache
def _sum_loss_model() -> nn.Module:
    return _with_grads(_mlp())


@cache
def _mean_loss_model() -> nn.Module:
    return _with_grads(_mlp())


def _sum_loss_declared_mean() -> None:
    model, labels = _sum_loss_model(), torch.tensor([0, 1, 1, 0, 1])
    with track(model, "variance"):
        F.cross_entropy(model(_x(5, 3)), labels, reduction="sum").backward()


def _mean_loss_declared_sum() -> None:
    model = _mean_loss_model()
    with track(model, "variance", loss_reduction="sum"):
        F.mse_loss(model(_x(5, 3)), torch.zeros(5, 2, dtype=D)).backward()


class _GRUAll(nn.Module):
    """A sequence-first GRU with a head on every step ([T, N, H])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class _GRULast(_GRUAll):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][-1])


@cache
def _seq_first() -> nn.Module:
    return _with_grads(_GRUAll().double())


def _sequence_first_head() -> None:
    model = _seq_first()
    with track(model, "variance"):
        _cubic(model(_x(5, 3, 4)).transpose(0, 1)).mean().backward()


@cache
def _on_features() -> nn.Module:
    return _with_grads(nn.Linear(4, 4).double())


def _batch_dim_on_features() -> None:
    model = _on_features()
    with track(model, "variance", batch_dim=1):
        model(_x(4, 4)).sum().backward()


class _Rows(nn.Module):
    """A layer on [T * N, d] rows (cannot be split), before one that can."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rows = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        h = self.rows(x.transpose(0, 1).reshape(t * n, d)).reshape(t, n, d).transpose(0, 1)
        return self.out(h)


@cache
def _rows() -> nn.Module:
    return _with_grads(_Rows().double())


def _unsplittable_rows() -> None:
    model = _rows()
    with track(model, "variance"):
        _cubic(model(_x(3, 5, 4))).mean().backward()


@cache
def _late_frozen() -> tuple[nn.Module, Tracker]:
    """A model, and a tracker made for it before one of its weights is frozen."""
    model = _mlp()
    return model, track(model, "variance")


def _frozen_after_track() -> None:
    model, tracker = _late_frozen()
    model[0].weight.requires_grad_(False)
    try:
        with tracker:
            model(_x(2, 3)).sum().backward()
    finally:
        model[0].weight.requires_grad_(True)


def _nested() -> None:
    model = _mlp()
    with track(model, "variance"), track(model, "batch_l2"):
        pass


# -- reading statistics ------------------------------------------------------------------------


def _read_before_backward() -> object:
    model = _mlp()
    with track(model, "variance") as stats:
        pass
    return stats["0.weight"].variance


def _read_after_unbackwarded_forward() -> object:
    model = _mlp()
    with track(model, "variance") as stats:
        model(_x(2, 3)).sum().backward()
        model(_x(2, 3))
        return stats["0.weight"].variance


def _empty_batch_only() -> object:
    model = _mlp()
    with track(model, "variance") as stats:
        model(_x(0, 3)).sum().backward()
    return stats["0.weight"].variance


# -- rows that must succeed: compared with the loop ----------------------------------------------


def _zero_example_micro_batch() -> None:
    model, x = _mlp(), _x(5, 3)
    ref = per_example_grads(model, lambda o, _: _cubic(o).sum(), x, None)
    with track(model, "variance", "batch_grad", moments=(3,)) as stats:
        for lo, hi in [(0, 3), (3, 3), (3, 5)]:
            losses = _cubic(model(x[lo:hi]))
            (losses.mean() if hi > lo else losses.sum()).backward()
    for name, g in ref.items():
        s = stats[name]
        assert_close([s.variance, s.moment(3), s.batch_grad], [g.var(0, False), (g**3).mean(0), g])


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3, 4)
        self.a = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.body(x)))


def _unreached_head() -> None:
    model, x = _TwoHeads().double(), _x(4, 3)
    ref = per_example_grads(model, lambda o, _: _cubic(o).sum(), x, None)  # 0 for `unused`
    with track(model, "mean", "variance", "batch_l2", "batch_grad") as stats:
        _cubic(model(x)).mean().backward()
    for name, g in ref.items():
        s = stats[name]
        got = [s.mean, s.variance, s.batch_l2, s.batch_grad]
        assert_close(got, [g.mean(0), g.var(0, False), g.flatten(1).square().sum(1), g])
    assert noise_scale(stats) == noise_scale(
        stats, ["body.weight", "body.bias", "a.weight", "a.bias"]
    )


def _gru_sequence_first_default_batch_dim() -> None:
    model, x = _GRULast().double(), _x(5, 3, 4)  # [T, N, F]: the GRU's layout says N = 3
    ref = per_example_grads(model, lambda o, _: _cubic(o).sum(), x, None, batch_dim=1)
    with track(model, "variance", "batch_l2") as stats:
        _cubic(model(x)).mean().backward()
    for name, g in ref.items():
        assert_close(stats[name].variance, g.var(0, unbiased=False))
        assert_close(stats[name].batch_l2, g.flatten(1).square().sum(1))


class _Fresh(nn.Module):
    pass


ROWS = [
    Case(
        "per_example.track.model_is_a_list",
        lambda: track([nn.Linear(2, 2)], "variance"),  # type: ignore[arg-type]
        TypeError,
        ("model", "torch.nn.Module", "list"),
    ),
    Case(
        "per_example.track.lazy_layer_not_run",
        lambda: track(nn.Sequential(nn.LazyLinear(3), nn.Tanh()), "variance"),
        ValueError,
        ("'0.weight' uninitialized", "nn.LazyLinear", "run the model once"),
    ),
    Case(
        "per_example.track.quantities_as_one_list",
        lambda: track(nn.Linear(2, 2), ["variance", "mean"]),  # type: ignore[arg-type]
        ValueError,
        ("quantities", "separate arguments", "track(model, 'variance', 'mean')"),
    ),
    Case(
        "per_example.track.moments_positional",
        lambda: track(nn.Linear(2, 2), "variance", (3,)),  # type: ignore[arg-type]
        ValueError,
        ("quantities", "keyword-only", "moments=(3,)"),
    ),
    Case(
        "per_example.track.moments_an_int",
        lambda: track(nn.Linear(2, 2), moments=3),  # type: ignore[arg-type]
        TypeError,
        ("moments", "sequence of positive integers", "moments=(3,)"),
    ),
    Case(
        "per_example.track.moment_zero",
        lambda: track(nn.Linear(2, 2), moments=(0,)),
        ValueError,
        ("moments", "positive integers", "(0,)"),
    ),
    Case(
        "per_example.track.max_memory_zero",
        lambda: track(nn.Linear(2, 2), "variance", max_memory=0),
        ValueError,
        ("max_memory", "int >= 1", "got 0"),
    ),
    Case(
        "per_example.track.chunk_size_negative",
        lambda: track(nn.Linear(2, 2), "variance", chunk_size=-1),
        ValueError,
        ("chunk_size", "int >= 1", "-1"),
    ),
    Case(
        "per_example.track.unbiased_not_a_bool",
        lambda: track(nn.Linear(2, 2), "variance", unbiased="yes"),  # type: ignore[arg-type]
        TypeError,
        ("unbiased", "a bool", "'yes'"),
    ),
    Case(
        "per_example.track.no_trainable_parameter",
        lambda: track(nn.Linear(2, 2).requires_grad_(False), "variance"),
        ValueError,
        ("model", "require grad", "none requiring grad"),
    ),
    Case(
        "per_example.track.batch_dim_unknown_submodule",
        lambda: track(_mlp(), "variance", batch_dim={"head": 0}),
        ValueError,
        ("batch_dim", "'head'", "named_modules"),
    ),
    Case(
        "per_example.track.batch_dim_on_the_features",
        _batch_dim_on_features,
        GradkitError,
        ("batch_dim=1", "model (Linear)", "features", "batch_dim=0"),
        _state(_on_features),
    ),
    Case(
        "per_example.track.sum_loss_declared_mean",
        _sum_loss_declared_mean,
        GradkitError,
        ("loss_reduction='mean'", "NllLossBackward0 (reduction='sum')", "loss_reduction='sum'"),
        _state(_sum_loss_model),
    ),
    Case(
        "per_example.track.mean_loss_declared_sum",
        _mean_loss_declared_sum,
        GradkitError,
        ("loss_reduction='sum'", "MseLossBackward0 (reduction='mean')", "loss_reduction='mean'"),
        _state(_mean_loss_model),
    ),
    Case(
        "per_example.track.sequence_first_head_on_every_step",
        _sequence_first_head,
        GradkitError,
        ("batch_dim", "head (Linear)", "(5, 3, 2)", "3 examples"),
        _state(_seq_first),
    ),
    Case(
        "per_example.track.rows_of_every_step_merged",
        _unsplittable_rows,
        GradkitError,
        ("rows (Linear)", "(15, 4)", "[T * N, d]", "requires_grad_(False)"),
        _state(_rows),
    ),
    Case(
        "per_example.track.frozen_after_track",
        _frozen_after_track,
        GradkitError,
        ("'0.weight'", "requires_grad=False", "before calling track()"),
        _state(lambda: _late_frozen()[0]),
    ),
    Case(
        "per_example.track.nested_blocks_on_one_model",
        _nested,
        GradkitError,
        ("model", "already tracked", "one track(model, ...) call"),
    ),
    Case(
        "per_example.track.gru_sequence_first_default_batch_dim",
        _gru_sequence_first_default_batch_dim,
    ),
    Case("per_example.track.zero_example_micro_batch", _zero_example_micro_batch),
    Case("per_example.track.unreached_head_is_zero_per_example", _unreached_head),
    Case(
        "per_example.stats.read_before_backward",
        _read_before_backward,
        GradkitError,
        ("stats['0.weight'].variance", "0 examples", "loss.backward()"),
    ),
    Case(
        "per_example.stats.only_an_empty_batch",
        _empty_batch_only,
        GradkitError,
        ("0 examples", "a batch of 0 examples contributes nothing"),
    ),
    Case(
        "per_example.stats.read_after_forward_without_backward",
        _read_after_unbackwarded_forward,
        GradkitError,
        ("1 forward call", "call backward", "torch.no_grad()"),
    ),
    Case(
        "per_example.stats.moment_of_power_zero",
        lambda: _tracked("variance")["0.weight"].moment(0),
        ValueError,
        ("moment(p)", "positive integer", "got 0", "(1, 2)"),
    ),
    Case(
        "per_example.stats.unknown_parameter",
        lambda: _tracked("variance")["0.wieght"],
        KeyError,
        ("no tracked parameter '0.wieght'", "named_parameters"),
    ),
    Case(
        "per_example.stats.unbiased_variance_of_one_example",
        lambda: _tracked("variance", n=1)["0.weight"].var(unbiased=True),
        GradkitError,
        ("unbiased", "at least 2 examples", "1 example", "unbiased=False"),
    ),
    Case(
        "per_example.stats.all_reduce_without_distributed",
        lambda: _tracked("variance").all_reduce(),
        GradkitError,
        ("all_reduce", "group", "init_process_group"),
    ),
    Case(
        "per_example.noise_scale.names_is_a_string",
        lambda: noise_scale(_tracked("variance"), "0.weight"),
        TypeError,
        ("names", "iterable of parameter names", "names=['0.weight']"),
    ),
    Case(
        "per_example.noise_scale.one_example",
        lambda: noise_scale(_tracked("variance", n=1)),
        GradkitError,
        ("noise_scale(stats, names)", "at least 2 examples", "1 example for '0.weight'"),
    ),
    Case(
        "per_example.cabs_batch_size.one_example",
        lambda: cabs_batch_size(_tracked("variance", n=1), 0.1, 1.0),
        GradkitError,
        ("cabs_batch_size(stats, lr, loss)", "at least 2 examples", "1 example"),
    ),
    Case(
        "per_example.noise_scale.stats_is_a_model",
        lambda: noise_scale(_mlp()),  # type: ignore[arg-type]
        TypeError,
        ("stats", "ParamStats", "Sequential"),
    ),
    Case(
        "per_example.gradient_snr.unknown_name",
        lambda: gradient_snr(_tracked("variance"), ["0.wieght"]),
        ValueError,
        ("names", "['0.wieght']", "list(stats)"),
    ),
    Case(
        "per_example.cabs_batch_size.negative_lr",
        lambda: cabs_batch_size(_tracked("variance"), -0.1, 1.0),
        ValueError,
        ("lr", "> 0", "-0.1"),
    ),
    Case(
        "per_example.cabs_batch_size.max_below_min",
        lambda: cabs_batch_size(_tracked("variance"), 0.1, 1.0, min_size=8, max_size=4),
        ValueError,
        ("max_size", "min_size (8)", "got 4"),
    ),
    Case(
        "per_example.cabs_batch_size.loss_not_a_scalar",
        lambda: cabs_batch_size(_tracked("variance"), 0.1, torch.ones(3)),
        ValueError,
        ("loss", "scalar", "shape=(3,)"),
    ),
    Case(
        "per_example.register_rule.not_a_function",
        lambda: register_rule(_Fresh)("a rule"),  # type: ignore[arg-type]
        TypeError,
        ("register_rule(_Fresh)", "rule", "function", "'a rule'"),
    ),
]

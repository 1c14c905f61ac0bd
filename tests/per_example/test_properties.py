"""Hypothesis-drawn shapes for Linear and Conv against the per-example loop (float64), and
random small models (Linear, Conv1d/2d, Embedding, LayerNorm, GRU stacks; float32/float64;
mean/sum losses; random quantities) that must give the loop's statistics or a GradkitError.
Derandomized, so that CI draws the same examples every run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads


def compare(model: nn.Module, x: torch.Tensor, p: int) -> None:
    def loss(o):
        return (o**3 + o).flatten(1).sum(1)

    ref = per_example_grads(model, lambda o, t: loss(o).sum(), x, None)
    with track(model, "variance", "batch_l2", moments=(p,)) as stats:
        loss(model(x)).mean().backward()
    for name, g in ref.items():
        # the variance is second_moment - mean**2: its rounding scales with the second moment
        var_atol = 1e-12 * max(1.0, float((g**2).mean(0).max()))
        assert_close(stats[name].variance, g.var(0, unbiased=False), atol=var_atol)
        assert_close(
            [stats[name].batch_l2, stats[name].moment(p)],
            [g.flatten(1).square().sum(1), (g**p).mean(0)],
        )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 4),
    lead=st.lists(st.integers(1, 3), max_size=2),
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
    p=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_linear_any_shape(n, lead, d_in, d_out, bias, p, seed):
    torch.manual_seed(seed)
    model = nn.Linear(d_in, d_out, bias=bias).double()
    compare(model, torch.randn(n, *lead, d_in, dtype=torch.float64), p)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 3),
    dims=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    c=st.integers(1, 2),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.integers(0, 2),
    bias=st.booleans(),
    p=st.integers(2, 3),
    seed=st.integers(0, 1000),
)
def test_conv_any_shape(n, dims, groups, c, k, stride, dilation, padding, bias, p, seed):
    torch.manual_seed(seed)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    model = conv(
        c * groups,
        2 * groups,
        k,
        stride=stride,
        dilation=dilation,
        padding=padding,
        groups=groups,
        bias=bias,
    ).double()
    size = dilation * (k - 1) + 1 + 2
    x = torch.randn(n, c * groups, *([size] * dims), dtype=torch.float64)
    compare(model, x, p)


# -- random small models: the loop oracle's statistics, or a GradkitError ------------------------

QUANTITIES = ("mean", "second_moment", "variance", "batch_l2", "batch_grad")


class GRUOut(nn.Module):
    """A batch-first GRU whose output (not its state) goes on."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.gru = nn.GRU(d_in, d_out, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


@st.composite
def random_setups(draw):
    """A random small model with its batch, loss and track() arguments."""
    kind = draw(st.sampled_from(["vec", "seq", "tokens", "conv1d", "conv2d"]))
    n = draw(st.integers(1, 5))
    width = draw(st.integers(1, 4))
    layers: list[nn.Module] = []
    if kind in ("conv1d", "conv2d"):
        channels, size = draw(st.integers(1, 3)), draw(st.integers(3, 5))
        k = draw(st.integers(1, 3))
        conv = nn.Conv1d if kind == "conv1d" else nn.Conv2d
        layers += [conv(channels, width, k, padding=draw(st.integers(0, 1))), nn.Flatten()]
        shape = (channels, *[size] * (1 if kind == "conv1d" else 2))
        flat = nn.Sequential(*layers)(torch.zeros(1, *shape)).shape[1]
        layers.append(nn.Linear(flat, width))
    else:
        shape = (draw(st.integers(1, 3)),) if kind != "vec" else ()
        if kind == "tokens":
            layers.append(nn.Embedding(draw(st.integers(2, 6)), width))
        else:
            d_in = draw(st.integers(1, 4))
            shape += (d_in,)
            layers.append(nn.Linear(d_in, width))
        choices = ["linear", "layernorm", "tanh"] + (["gru"] if kind != "vec" else [])
        for layer in draw(st.lists(st.sampled_from(choices), max_size=2)):
            d_out = draw(st.integers(1, 4))
            if layer == "linear":
                layers.append(nn.Linear(width, d_out))
                width = d_out
            elif layer == "gru":
                layers.append(GRUOut(width, d_out))
                width = d_out
            elif layer == "layernorm":
                layers.append(nn.LayerNorm(width))
            else:
                layers.append(nn.Tanh())
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = nn.Sequential(*layers)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    if kind == "tokens":
        x = torch.randint(0, layers[0].num_embeddings, (n, *shape))
    else:
        x = torch.randn(n, *shape, dtype=dtype)
    with torch.no_grad():
        out_shape = model(x[:1].float() if x.is_floating_point() else x).shape[1:]
    loss = draw(st.sampled_from(["cubic", "mse"] + (["ce"] if len(out_shape) == 1 else [])))
    y = torch.randint(0, out_shape[0], (n,)) if loss == "ce" else torch.randn(n, *out_shape)
    quantities = draw(st.sets(st.sampled_from(QUANTITIES), max_size=3))
    moments = tuple(draw(st.sets(st.sampled_from([1, 3, 4]), max_size=2)))
    if not quantities and not moments:
        quantities = {"variance"}
    reduction = draw(st.sampled_from(["mean", "sum"]))
    declared = reduction
    if loss != "cubic" and draw(st.booleans()) and draw(st.booleans()):
        declared = "sum" if reduction == "mean" else "mean"  # detectable: must be refused
    return (
        model.to(dtype),
        x,
        y.to(dtype) if y.is_floating_point() else y,
        loss,
        reduction,
        (
            declared,
            sorted(quantities),
            moments,
        ),
    )


def per_example_loss(loss: str, reduction: str):
    def f(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if loss == "cubic":
            per = (out * y + 0.3 * out**3).flatten(1).sum(1)
            return per.mean() if reduction == "mean" else per.sum()
        if loss == "mse":
            return F.mse_loss(out, y.to(out.dtype), reduction=reduction)
        return F.cross_entropy(out, y, reduction=reduction)

    return f


@settings(max_examples=300, deadline=None, derandomize=True)
@given(setup=random_setups())
def test_random_models_give_the_loop_statistics_or_a_gradkit_error(setup):
    model, x, y, loss, reduction, (declared, quantities, moments) = setup
    f = per_example_loss(loss, reduction)
    ref = per_example_grads(model, f, x, y)  # float64, one example at a time
    try:
        with track(model, *quantities, moments=moments, loss_reduction=declared) as stats:
            f(model(x), y).backward()
    except GradkitError as err:
        assert declared != reduction, f"refused a matching declaration: {err}"
        assert "loss_reduction" in str(err)
        event("refused")
        return
    event(f"compared {type(model[-1]).__name__} {x.dtype}")
    # one example's mean loss is its sum: either reading gives its gradient, and passes
    one = x.shape[0] == 1
    assert declared == reduction or one, "a contradicting loss_reduction was not refused"
    float64 = x.dtype == torch.float64 or next(model.parameters()).dtype == torch.float64
    rtol, atol = (1e-8, 1e-10) if float64 else (1e-3, 1e-4)
    got, want = {}, {}
    for name, g in ref.items():
        s, scale = stats[name], max(1.0, float(g.abs().max()))
        expected = {
            "mean": g.mean(0),
            "second_moment": (g**2).mean(0),
            "variance": g.var(0, unbiased=False),
            "batch_l2": g.flatten(1).square().sum(1),
            "batch_grad": g,
        }
        for q in quantities:
            power = 2 if q in ("second_moment", "variance", "batch_l2") else 1
            got[f"{name}.{q}"] = getattr(s, q) / scale**power
            want[f"{name}.{q}"] = expected[q] / scale**power
        for p in moments:
            got[f"{name}.m{p}"], want[f"{name}.m{p}"] = (
                s.moment(p) / scale**p,
                (g**p).mean(0) / scale**p,
            )
    assert_close(got, want, rtol=rtol, atol=atol)

"""The native per-example rules on the layer grid peers test their own rules with (Opacus
``tests/grad_samples/``, BackPACK ``test/extensions/firstorder/firstorder_settings.py``).

Every case is compared with the one-example-at-a-time autograd loop
(:func:`gradkit.testing.per_example_grads`) in float64 at rtol 1e-10 (atol 1e-12): ``mean``,
``variance``, ``moment(3)``, ``batch_l2`` and ``batch_grad``, under ``loss_reduction`` "mean"
and "sum", for N = 1, N = 3 and N = 3 split [2, 1] over two backward passes in one ``track``
block; a float32 run must agree with the float64 oracle at the float32 long-reduction
tolerance, and ``p.grad`` must be bitwise what it is without tracking (up to float rounding
for what ``fuse`` sums from the per-example gradients: every call that can be fused is, the size
threshold set to 0 here, so that each convolution and sequence configuration goes through
:mod:`gradkit.per_example._fused`). A third run per case
leaves out ``batch_grad`` and materializes one example at a time (``chunk_size=1``), through
``.backward()`` and through ``torch.autograd.grad`` (where the mean comes from the rule rather
than from the parameters' gradient edges).

The grid covers each axis one value at a time around a base configuration, plus seeded random
combined configurations (the full cross product would take minutes):

* Conv1d/2d/3d: kernel size, stride, padding (int, tuple, "same", "valid"), dilation, groups
  (up to depthwise), bias, padding mode; the Gram-form norm and one-output-position paths;
  ConvTranspose1d/2d (vmap fallback).
* Linear on inputs of rank 2, 3, 4, with and without bias (closed forms and Gram form).
* Embedding on index tensors of rank 1, 2, 3, with ``padding_idx`` and repeated indices,
  ``max_norm``.
* LayerNorm / RMSNorm over the last dim, the last two, and all non-batch dims; without affine
  parameters or bias; GroupNorm with 1, C and in-between groups on 2-D to 5-D inputs;
  InstanceNorm1d/2d with affine parameters (vmap fallback).
* Embedding with ``sparse=True`` (the mean read at a sparse gradient edge) and
  ``scale_grad_by_freq``
  (refused: no per-example decomposition).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import gradkit
from gradkit import GradkitError
from gradkit.per_example import _fused
from gradkit.testing import assert_close, per_example_grads, tolerances

from ._grads_check import same_grads

D = torch.float64
QUANTITIES = ("mean", "variance", "batch_l2", "batch_grad")


@pytest.fixture(autouse=True)
def fuse_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fuse the grid's small layers too (see the module docstring)."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)


@dataclass(frozen=True)
class Case:
    id: str
    module_fn: Callable[[], nn.Module]
    input_fn: Callable[[int, torch.Generator], torch.Tensor]


def floats(*shape: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    """Inputs ``[n, *shape]`` drawn in float32 (exact in float64 too)."""
    return lambda n, g: torch.randn((n, *shape), generator=g)


def indices(vocab: int, *shape: int, pad: int | None = None):
    """Indices ``[n, *shape]`` with a repeated index in each example (or across examples for
    rank 1) and, with ``pad``, some ``padding_idx`` entries."""

    def make(n: int, g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, vocab, (n, *shape), generator=g)
        flat = idx.view(n, -1)
        if flat.shape[1] > 1:
            flat[:, 0] = flat[:, 1]
        elif n > 1:
            flat[0] = flat[1]
        if pad is not None:
            flat[:, -1] = pad
        return idx

    return make


# -- convolutions ------------------------------------------------------------------------------

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SPATIAL = {1: (9,), 2: (6, 5), 3: (5, 4, 4)}
BASE = {
    "kernel_size": 3,
    "stride": 1,
    "padding": 1,
    "dilation": 1,
    "groups": 1,
    "bias": True,
    "padding_mode": "zeros",
}


def _tag(v: Any) -> str:
    """``(2, 1)`` -> ``"2x1"`` for test ids."""
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _tup(v: Any, dim: int) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, tuple) else (v,) * dim


def _conv_ok(dim: int, c_in: int, c_out: int, cfg: dict[str, Any]) -> bool:
    """Whether torch accepts the configuration and gives a non-empty output."""
    if c_in % cfg["groups"] or c_out % cfg["groups"]:
        return False
    pad = cfg["padding"]
    if isinstance(pad, str):
        return pad == "valid" or _tup(cfg["stride"], dim) == (1,) * dim
    for size, k, s, p, d in zip(
        SPATIAL[dim],
        _tup(cfg["kernel_size"], dim),
        _tup(cfg["stride"], dim),
        _tup(pad, dim),
        _tup(cfg["dilation"], dim),
        strict=True,
    ):
        if cfg["padding_mode"] == "reflect" and p >= size:
            return False
        if (size + 2 * p - d * (k - 1) - 1) // s + 1 < 1:
            return False
    return True


def conv_case(dim: int, tag: str, c_in: int = 4, c_out: int = 6, **over: Any) -> Case:
    cfg = {**BASE, **over}
    assert _conv_ok(dim, c_in, c_out, cfg), (dim, cfg)
    return Case(
        f"conv{dim}d_{tag}",
        lambda: CONV[dim](c_in, c_out, **cfg),
        floats(c_in, *SPATIAL[dim]),
    )


def _axis_cases(dim: int) -> list[Case]:
    """One axis at a time around ``BASE``."""
    odd = {1: (2,), 2: (2, 3), 3: (3, 1, 2)}[dim]
    cases = [conv_case(dim, "base")]
    strides = (2, {1: (3,), 2: (2, 1), 3: (1, 2, 1)}[dim])
    pads = (0, 2, "same", "valid", {1: (2,), 2: (1, 0), 3: (0, 1, 2)}[dim])
    cases += [conv_case(dim, f"k{_tag(k)}", kernel_size=k) for k in (1, 2, odd)]
    cases += [conv_case(dim, f"s{_tag(s)}", stride=s) for s in strides]
    cases += [conv_case(dim, f"p{_tag(p)}", padding=p) for p in pads]
    cases += [conv_case(dim, "d2", dilation=2, padding=2)]
    cases += [conv_case(dim, "g2", groups=2), conv_case(dim, "depthwise", c_out=8, groups=4)]
    cases += [conv_case(dim, "nobias", bias=False)]
    cases += [conv_case(dim, m, padding_mode=m) for m in ("reflect", "replicate", "circular")]
    return cases


def _random_conv_cases(count: int, seed: int = 0) -> list[Case]:
    """Seeded random combinations of every axis (invalid ones redrawn)."""
    rng = random.Random(seed)
    cases: list[Case] = []
    while len(cases) < count:
        dim = rng.choice((1, 2, 3))
        c_in, c_out = rng.choice(((2, 4), (4, 6), (4, 8), (3, 3)))

        def pick(*values: Any, dim: int = dim) -> Any:
            v = rng.choice(values)
            if v != "tuple":
                return v
            return tuple(rng.choice([u for u in values if isinstance(u, int)]) for _ in range(dim))

        cfg = {
            "kernel_size": pick(1, 2, 3, "tuple"),
            "stride": pick(1, 2, "tuple"),
            "padding": pick(0, 1, "same", "valid", "tuple"),
            "dilation": pick(1, 2, "tuple"),
            "groups": rng.choice((1, 2, c_in)),
            "bias": rng.choice((True, False)),
            "padding_mode": rng.choice(("zeros", "reflect", "replicate", "circular")),
        }
        if _conv_ok(dim, c_in, c_out, cfg):
            cases.append(conv_case(dim, f"random{len(cases)}", c_in, c_out, **cfg))
    return cases


CONV_CASES = [c for dim in (1, 2, 3) for c in _axis_cases(dim)]
CONV_CASES += _random_conv_cases(10)
CONV_CASES += [
    # padding="same" with an even kernel and a non-zero padding mode
    conv_case(2, "same_even_circular", kernel_size=(2, 4), padding="same", padding_mode="circular"),
    # norms in Gram form over unfolded patches (few positions, many weights per group)
    Case("conv1d_gram", lambda: nn.Conv1d(8, 8, 3), floats(8, 5)),
    Case(
        "conv1d_gram_s2_reflect",
        lambda: nn.Conv1d(8, 8, 3, stride=2, padding=1, padding_mode="reflect"),
        floats(8, 6),
    ),
    Case(
        "conv1d_gram_same_even_circular",
        lambda: nn.Conv1d(8, 8, 4, padding="same", padding_mode="circular"),
        floats(8, 3),
    ),
    Case("conv2d_gram_groups", lambda: nn.Conv2d(8, 16, 3, groups=2), floats(8, 4, 4)),
    Case(
        "conv2d_gram_s2_pad_dil",
        lambda: nn.Conv2d(8, 8, 3, stride=2, padding=(1, 0), dilation=(1, 2)),
        floats(8, 4, 6),
    ),
    Case(
        "conv2d_gram_same_even_replicate",
        lambda: nn.Conv2d(8, 8, (2, 3), padding="same", padding_mode="replicate", bias=False),
        floats(8, 2, 3),
    ),
    Case("conv2d_gram_depthwise", lambda: nn.Conv2d(2, 16, 3, groups=2), floats(2, 3, 4)),
    Case(
        "conv3d_gram_reflect",
        lambda: nn.Conv3d(8, 8, 2, padding=(1, 0, 0), padding_mode="reflect"),
        floats(8, 3, 2, 2),
    ),
    # one output position: outer-product closed forms
    Case("conv2d_one_position", lambda: nn.Conv2d(3, 4, (4, 3)), floats(3, 4, 3)),
    Case("conv3d_one_position_s2", lambda: nn.Conv3d(2, 3, 2, stride=2), floats(2, 2, 3, 2)),
    # transposed convolutions (vmap fallback)
    Case("convtranspose1d", lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), floats(3, 5)),
    Case(
        "convtranspose1d_pad_outpad_dil",
        lambda: nn.ConvTranspose1d(2, 4, 3, stride=2, padding=1, output_padding=1, dilation=2),
        floats(2, 6),
    ),
    Case("convtranspose2d", lambda: nn.ConvTranspose2d(3, 2, 2), floats(3, 4, 4)),
    Case(
        "convtranspose2d_groups_nobias",
        lambda: nn.ConvTranspose2d(4, 6, (2, 3), stride=(2, 1), groups=2, bias=False),
        floats(4, 3, 4),
    ),
]

# -- linear, embedding -------------------------------------------------------------------------

LINEAR_CASES = [
    Case(f"linear_rank{r}{'' if b else '_nobias'}", lambda b=b: nn.Linear(4, 3, bias=b), x)
    for r, x in ((2, floats(4)), (3, floats(5, 4)), (4, floats(2, 3, 4)))
    for b in (True, False)
] + [
    Case("linear_rank3_gram", lambda: nn.Linear(12, 10), floats(2, 12)),
    Case("linear_rank4_gram", lambda: nn.Linear(12, 10, bias=False), floats(1, 2, 12)),
]

EMBEDDING_CASES = [
    Case("embedding_rank1", lambda: nn.Embedding(5, 3), indices(5)),
    Case("embedding_rank2", lambda: nn.Embedding(6, 3), indices(6, 4)),
    Case("embedding_rank3", lambda: nn.Embedding(7, 2), indices(7, 3, 2)),
    Case("embedding_rank1_pad", lambda: nn.Embedding(5, 3, padding_idx=2), indices(5, pad=2)),
    Case("embedding_rank2_pad", lambda: nn.Embedding(6, 3, padding_idx=0), indices(6, 5, pad=0)),
    Case(
        "embedding_rank3_pad_negative",
        lambda: nn.Embedding(6, 3, padding_idx=-1),
        indices(6, 2, 3, pad=5),
    ),
    Case("embedding_one_row", lambda: nn.Embedding(1, 4), indices(1, 3)),
    # rows are renormalized in place by every forward (before the lookup, under no_grad);
    # the lookup's gradient does not depend on the weight, so the rule stays exact
    Case("embedding_max_norm", lambda: nn.Embedding(6, 4, max_norm=0.5), indices(6, 4)),
]

# -- normalization -----------------------------------------------------------------------------


def _shapes(x_shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Normalized shapes: the last dim, the last two, all non-batch dims."""
    out = [("last", x_shape[-1:]), ("last2", x_shape[-2:]), ("all", x_shape)]
    return [(tag, s) for tag, s in out if len(s) <= len(x_shape)]


def _norm_cases() -> list[Case]:
    cases = []
    for x_shape in ((5,), (3, 4), (2, 3, 4)):
        for tag, shape in _shapes(x_shape):
            if tag == "last2" and len(x_shape) < 2:
                continue
            cases.append(
                Case(
                    f"layernorm_{len(x_shape) + 1}d_{tag}",
                    lambda shape=shape: nn.LayerNorm(shape),
                    floats(*x_shape),
                )
            )
    cases += [
        Case("layernorm_nobias", lambda: nn.LayerNorm((3, 4), bias=False), floats(2, 3, 4)),
        Case("layernorm_all_nobias", lambda: nn.LayerNorm(4, bias=False), floats(4)),
        Case(
            "layernorm_no_affine_after_linear",
            lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5, elementwise_affine=False)),
            floats(3, 4),
        ),
    ]
    if hasattr(nn, "RMSNorm"):
        for x_shape in ((5,), (3, 4), (2, 3, 4)):
            for tag, shape in _shapes(x_shape):
                if tag == "last2" and len(x_shape) < 2:
                    continue
                for eps in (None, 1e-3):
                    cases.append(
                        Case(
                            f"rmsnorm_{len(x_shape) + 1}d_{tag}_eps{eps}",
                            lambda shape=shape, eps=eps: nn.RMSNorm(shape, eps=eps),
                            floats(*x_shape),
                        )
                    )
        cases.append(
            Case(
                "rmsnorm_no_affine_after_linear",
                lambda: nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5, elementwise_affine=False)),
                floats(3, 4),
            )
        )
    for x_shape in ((6,), (6, 4), (6, 3, 2), (6, 2, 2, 3)):
        for groups in (1, 3, 6) if len(x_shape) > 1 else (1, 3):  # a group needs 2 values
            cases.append(
                Case(
                    f"groupnorm_{len(x_shape) + 1}d_g{groups}",
                    lambda groups=groups: nn.GroupNorm(groups, 6),
                    floats(*x_shape),
                )
            )
    cases += [
        Case("instancenorm1d", lambda: nn.InstanceNorm1d(3, affine=True), floats(3, 5)),
        Case("instancenorm2d", lambda: nn.InstanceNorm2d(2, affine=True), floats(2, 3, 4)),
    ]
    return cases


NORM_CASES = _norm_cases()
CASES = CONV_CASES + LINEAR_CASES + EMBEDDING_CASES + NORM_CASES
BATCHES = [(1, [1]), (3, [3]), (3, [2, 1])]

# -- the check ---------------------------------------------------------------------------------


def losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[N]`` per-example losses, asymmetric in the output so odd moments are not trivial."""
    return (out * y + 0.3 * out**3).flatten(1).sum(1)


def data(case: Case, model: nn.Module, n: int, dtype: torch.dtype) -> tuple[Any, Any]:
    """Inputs and targets drawn in float32 (exact in float64 too), cast to ``dtype``."""
    g = torch.Generator(torch.get_default_device()).manual_seed(n)
    x = case.input_fn(n, g)
    x = x.to(dtype) if x.is_floating_point() else x
    with torch.no_grad():  # on a copy: a forward may change the module (max_norm)
        out = copy.deepcopy(model)(x)
    return x, torch.randn(out.shape, generator=g).to(dtype)


def run(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    reduction: str,
    splits: list[int],
    *,
    tracked: bool,
    api: str = "backward",
    **track_kw: Any,
) -> tuple[Any, list[torch.Tensor]]:
    """Forward and backward per micro-batch, in one ``track`` block if ``tracked``. Returns
    the tracker (or None) and the parameters' gradients: ``p.grad`` after ``.backward()``, or
    what ``torch.autograd.grad`` returned, pass after pass."""
    params = list(model.parameters())
    grads: list[torch.Tensor] = []

    def passes() -> None:
        start = 0
        for size in splits:
            ls = losses(model(x[start : start + size]), y[start : start + size])
            loss = ls.mean() if reduction == "mean" else ls.sum()
            if api == "backward":
                loss.backward()
            else:
                grads.extend(torch.autograd.grad(loss, params))
            start += size

    if not tracked:
        passes()
        return None, grads if api != "backward" else [p.grad for p in params]
    with gradkit.per_example.track(
        model, *track_kw.pop("quantities", QUANTITIES), loss_reduction=reduction, **track_kw
    ) as stats:
        passes()
    if api == "backward":
        grads = [p.grad for p in params]
    else:
        assert all(p.grad is None for p in params)
    return stats, grads


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, also of sparse gradients."""
    if a.is_sparse or b.is_sparse:
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
    return torch.equal(a, b)


def check(
    case: Case,
    dtype: torch.dtype,
    reduction: str,
    n: int,
    splits: list[int],
    *,
    rtol: float,
    atol: float,
    scaled: bool = False,
    api: str = "backward",
    batch_grad: bool = True,
    chunk_size: int | None = None,
) -> None:
    """Track ``case`` on ``n`` examples in micro-batches ``splits``; compare every quantity
    with the float64 loop oracle, and the parameters' gradients with an untracked run."""
    torch.manual_seed(0)
    model = case.module_fn().to(dtype)  # initialized in float32, exact in float64
    x, y = data(case, model, n, dtype)
    ref = per_example_grads(model, lambda o, t: losses(o, t).sum(), x, y)
    ref = {k: g.to_dense() if g.is_sparse else g for k, g in ref.items()}  # sparse embeddings
    _, plain = run(copy.deepcopy(model), x, y, reduction, splits, tracked=False, api=api)
    quantities = QUANTITIES if batch_grad else QUANTITIES[:-1]
    stats, grads = run(
        model,
        x,
        y,
        reduction,
        splits,
        tracked=True,
        api=api,
        quantities=quantities,
        moments=(3,),
        chunk_size=chunk_size,
    )

    got, want = {}, {}
    for name, g in ref.items():
        s = stats[name]
        got[name] = {
            "mean": s.mean,
            "variance": s.variance,
            "moment3": s.moment(3),
            "batch_l2": s.batch_l2,
            **({"batch_grad": s.batch_grad} if batch_grad else {}),
        }
        want[name] = {
            "mean": g.mean(0),
            "variance": g.var(0, unbiased=False),
            "moment3": (g**3).mean(0),
            "batch_l2": g.flatten(1).square().sum(1),
            **({"batch_grad": g} if batch_grad else {}),
        }
        assert all(v.dtype == dtype for v in got[name].values()), name
    assert stats.num_examples == n
    if scaled:  # each tensor relative to its largest entry
        scales = {
            k: {q: w.abs().max().clamp_min(1e-30) for q, w in v.items()} for k, v in want.items()
        }
        got = {k: {q: t / scales[k][q] for q, t in v.items()} for k, v in got.items()}
        want = {k: {q: t / scales[k][q] for q, t in v.items()} for k, v in want.items()}
    assert_close(got, want, name=case.id, rtol=rtol, atol=atol)
    names = [k for k, _ in model.named_parameters()]
    names = [f"{i}:{k}" for i in range(len(grads) // len(names)) for k in names]  # per pass
    changed = same_grads(dict(zip(names, grads, strict=True)), dict(zip(names, plain, strict=True)))
    assert not changed, f"gradients changed by tracking ({api}): {changed}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n,splits", BATCHES, ids=["n1", "n3", "n3_split21"])
def test_float64_matches_loop(case: Case, reduction: str, n: int, splits: list[int]) -> None:
    check(case, D, reduction, n, splits, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("api", ["backward", "autograd_grad"])
def test_float64_chunked_without_batch_grad(case: Case, api: str) -> None:
    # without batch_grad, blocks are materialized one example at a time and powered in place;
    # under autograd.grad the mean comes from the rules instead of the parameters' edges
    check(
        case,
        D,
        "mean",
        3,
        [2, 1],
        rtol=1e-10,
        atol=1e-12,
        api=api,
        batch_grad=False,
        chunk_size=1,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_float32_matches_float64_loop(case: Case) -> None:
    # float32 rounding is bounded relative to the size of the terms summed, not of the sum:
    # moment(3), variance and a weight's sum over positions cancel, so an elementwise rtol
    # fails on entries near zero. Each tensor is compared relative to its largest entry.
    rtol, _ = tolerances(torch.float32, long_reduction=True)
    check(case, torch.float32, "mean", 3, [2, 1], rtol=rtol, atol=rtol, scaled=True)


SPARSE = Case("embedding_sparse", lambda: nn.Embedding(6, 3, sparse=True), indices(6, 4))


@pytest.mark.parametrize("api", ["backward", "autograd_grad"])
def test_sparse_embedding(api: str) -> None:
    check(SPARSE, D, "mean", 3, [2, 1], rtol=1e-10, atol=1e-12, api=api)


def test_embedding_scale_grad_by_freq_is_refused() -> None:
    model = nn.Embedding(6, 3, scale_grad_by_freq=True).double()
    idx = indices(6, 4)(3, torch.Generator(torch.get_default_device()).manual_seed(0))
    with (
        pytest.raises(GradkitError, match=r"scale_grad_by_freq: expected False"),
        gradkit.per_example.track(model, "variance"),
    ):
        model(idx).pow(2).sum().backward()

"""Hypergradients through training where some parameters have no gradient at some steps (a
layer unfrozen late, a branch taken every third step, a parameter never used): the engines
skip them exactly as ``torch.optim`` does (no update, state and count untouched), so

* the trajectory the engines differentiate is ``torch.optim``'s (float64, rtol 1e-12);
* reverse == the full unrolled graph == forward == truncated(last=T) == checkpointed reverse
  == RTHO's first hypergradient, and all == central finite differences,

for SGD with dampening (the first buffer of a late parameter is undampened), Adam (bias
corrections count the parameter's own steps), centered RMSprop with momentum and AdamW with
AMSGrad.
"""

from __future__ import annotations

import functools

import pytest
import torch

from gradkit import hyper, optim
from gradkit.testing import assert_close

from ._problems import CLASSES, FEATURES, N_TRAIN, D, cross_entropy, data

STEPS = 10


def _params0() -> dict[str, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(5)
    return {
        "W": 0.3 * torch.randn(FEATURES, CLASSES, generator=gen, dtype=D),
        "late": 0.1 * torch.randn(CLASSES, generator=gen, dtype=D),  # unfrozen at step 4
        "branch": 0.2 * torch.randn(FEATURES, CLASSES, generator=gen, dtype=D),  # t % 3 == 0
        "never": torch.randn(2, generator=gen, dtype=D),  # no gradient ever
    }


def _logits(p: dict[str, torch.Tensor], X: torch.Tensor, t: int | None) -> torch.Tensor:
    z = X @ p["W"]
    if t is None or t >= 4:
        z = z + p["late"]
    if t is None or t % 3 == 0:
        z = z + torch.tanh(X @ p["branch"])
    return z


SETTINGS = {
    "sgd-dampened": (
        lambda h: optim.sgd(lr=h["lr"], momentum=h["mu"], dampening=0.3, weight_decay=0.01),
        {"lr": 0.5, "mu": 0.8},
        ("SGD", {"dampening": 0.3, "weight_decay": 0.01}),
    ),
    "adam": (
        lambda h: optim.adam(lr=h["lr"], betas=(h["mu"], 0.99), eps=1e-3, weight_decay=0.01),
        {"lr": 0.05, "mu": 0.8},
        ("Adam", {"eps": 1e-3, "weight_decay": 0.01}),
    ),
    "rmsprop-centered-momentum": (
        lambda h: optim.rmsprop(lr=h["lr"], alpha=0.9, momentum=h["mu"], eps=1e-3, centered=True),
        {"lr": 0.01, "mu": 0.5},
        ("RMSprop", {"alpha": 0.9, "eps": 1e-3, "centered": True}),
    ),
    "adamw-amsgrad": (
        lambda h: optim.adamw(lr=h["lr"], betas=(h["mu"], 0.99), eps=1e-3, amsgrad=True),
        {"lr": 0.05, "mu": 0.7},
        ("AdamW", {"eps": 1e-3, "amsgrad": True}),
    ),
}


def _hyper(name: str) -> dict[str, torch.Tensor]:
    scalars = SETTINGS[name][1]
    return {
        "lr": torch.tensor(scalars["lr"], dtype=D),
        "mu": torch.tensor(scalars["mu"], dtype=D),
        "l2": torch.full((FEATURES, CLASSES), 0.02, dtype=D),
        "w": torch.linspace(0.5, 1.5, N_TRAIN, dtype=D),
    }


def _build(name: str, h: dict[str, torch.Tensor]):
    X, y, Xv, yv = data()

    def inner(p, t):
        loss = (h["w"] * cross_entropy(_logits(p, X, t), y)).mean()
        return loss + 0.5 * (h["l2"] * p["W"] ** 2).sum()

    def outer(p):
        return cross_entropy(_logits(p, Xv, None), yv).mean()

    return inner, outer, SETTINGS[name][0](h)


def _step_index(t: int) -> int:
    return t


def _engines_args(name: str, h: dict[str, torch.Tensor]):
    inner, outer, opt = _build(name, h)
    return (inner, outer, _params0(), opt), {"steps": STEPS, "batches": _step_index}


def _run(name: str, h: dict[str, torch.Tensor], *, graph: bool) -> torch.Tensor:
    """The outer loss after the training (the whole unrolled graph with ``graph=True``); a
    parameter the loss does not use at a step gets a None gradient, as after backward()."""
    inner, outer, opt = _build(name, h)
    params = _params0()
    state = opt.init(params)
    with torch.enable_grad() if graph else torch.no_grad():
        for t in range(STEPS):
            xs = {
                k: v if v.requires_grad else v.detach().requires_grad_(True)
                for k, v in params.items()
            }
            with torch.enable_grad():
                gs = torch.autograd.grad(
                    inner(xs, t), list(xs.values()), create_graph=graph, allow_unused=True
                )
            params, state = opt.update(
                dict(zip(xs, gs, strict=True)), state, xs if graph else params
            )
        return outer(params)


def _unrolled(name: str, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in h.items()}
    value = _run(name, leaves, graph=True)
    return dict(zip(leaves, torch.autograd.grad(value, list(leaves.values())), strict=True))


@pytest.mark.parametrize("name", SETTINGS)
def test_the_differentiated_trajectory_is_torch_optims(name):
    h = _hyper(name)
    args, kw = _engines_args(name, h)
    res = hyper.reverse(*args, hyper={"l2": h["l2"]}, full_output=True, **kw)
    torch_name, options = SETTINGS[name][2]
    scalars = SETTINGS[name][1]
    extra = {"momentum": scalars["mu"]} if torch_name in ("SGD", "RMSprop") else {}
    if torch_name in ("Adam", "AdamW"):
        extra = {"betas": (scalars["mu"], 0.99)}
    net = {k: torch.nn.Parameter(v.clone()) for k, v in _params0().items()}
    reference = getattr(torch.optim, torch_name)(
        list(net.values()), lr=scalars["lr"], foreach=False, **options, **extra
    )
    inner, _, _ = _build(name, h)
    for t in range(STEPS):
        reference.zero_grad(set_to_none=True)
        inner(net, t).backward()
        reference.step()
    for k, p in net.items():
        torch.testing.assert_close(res.params[k], p.detach(), rtol=1e-12, atol=1e-14)
    assert torch.equal(res.params["never"], _params0()["never"])
    if torch_name != "SGD":
        assert int(reference.state[net["late"]]["step"]) == STEPS - 4


@pytest.mark.parametrize("name", SETTINGS)
def test_reverse_forward_truncated_rtho_and_unrolled_agree(name):
    h = _hyper(name)
    args, kw = _engines_args(name, h)
    rev = hyper.reverse(*args, hyper=h, memory_budget=None, **kw)
    assert_close(rev, _unrolled(name, h), name=f"{name}: reverse vs unrolled graph")
    args, kw = _engines_args(name, h)
    kept = hyper.reverse(*args, hyper=h, **kw)  # within the default budget: the kept graphs
    assert_close(kept, rev, name=f"{name}: kept graphs vs stored states")
    args, kw = _engines_args(name, h)
    ckpt = hyper.reverse(*args, hyper=h, checkpoint_every=3, **kw)
    assert_close(ckpt, rev, rtol=0, atol=0, name=f"{name}: checkpointed vs stored")
    args, kw = _engines_args(name, h)
    trunc = hyper.truncated(*args, hyper=h, last=STEPS, **kw)
    assert_close(trunc, rev, rtol=0, atol=0, name=f"{name}: truncated(last=T) vs reverse")
    scalars = {k: h[k] for k in ("lr", "mu")}
    args, kw = _engines_args(name, h)
    fwd = hyper.forward(*args, hyper=scalars, **kw)
    assert_close(fwd, {k: rev[k] for k in scalars}, name=f"{name}: forward vs reverse")
    inner, outer, opt = _build(name, h)
    rtho = hyper.HyperOptimizer(
        inner,
        outer,
        _params0(),
        opt,
        scalars,
        method="rtho",
        steps=STEPS,
        batches=_step_index,
        outer_opt=functools.partial(torch.optim.SGD, lr=0.0),
    )
    assert_close(rtho.step().grads, fwd, name=f"{name}: RTHO's first vs forward")


@pytest.mark.parametrize("name", SETTINGS)
def test_reverse_matches_central_finite_differences(name):
    h = _hyper(name)
    args, kw = _engines_args(name, h)
    rev = hyper.reverse(*args, hyper=h, **kw)
    gen = torch.Generator(torch.get_default_device()).manual_seed(7)
    problems = []
    for key, value in h.items():
        u = (
            torch.ones_like(value)
            if value.numel() == 1
            else torch.randn(value.shape, generator=gen, dtype=D)
        )
        u = u / u.norm()
        eps = 1e-6 * max(1.0, float(value.abs().max()))

        def at(sign: float, key=key, u=u, eps=eps) -> float:
            moved = {k: (v + sign * eps * u if k == key else v).clone() for k, v in h.items()}
            return float(_run(name, moved, graph=False))

        fd = (at(1.0) - at(-1.0)) / (2 * eps)
        analytic = float((rev[key] * u).sum())
        if abs(fd - analytic) > 1e-6 * max(abs(analytic), 1e-3):
            problems.append(f"{key}: analytic {analytic:.10g}, fd {fd:.10g}")
    assert not problems, f"{name}:\n" + "\n".join(problems)

"""Hyperparameters the outer loss happens not to depend on.

SGD starts its momentum buffer at the first gradient, undampened (as ``torch.optim.SGD``), so
after one step the momentum and the dampening have no effect: their hypergradient is exactly 0,
and every engine must say so (reverse, forward, truncated through all steps, real-time forward)
rather than raise, because they are the optimizer's own tensors. From the second step on they
enter and every engine must match central finite differences in float64. Adam's betas enter the
first step through the bias corrections and cancel (derivative 0 up to round-off), RMSprop's
momentum multiplies a zero buffer: the engines agree there too. A tensor that is not the
optimizer's (a copy of its momentum) still raises, naming the tensor it copies.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch

from gradkit import hyper, optim
from gradkit.testing import assert_close

D = torch.float64


@cache
def _data() -> tuple[torch.Tensor, ...]:
    """The training data (X, Y) and the validation data (XV, YV)."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    X, Y = torch.randn(20, 3, generator=gen, dtype=D), torch.randn(20, generator=gen, dtype=D)
    XV, YV = torch.randn(10, 3, generator=gen, dtype=D), torch.randn(10, generator=gen, dtype=D)
    return X, Y, XV, YV


def _w0() -> torch.Tensor:
    return torch.tensor([0.1, -0.2, 0.3], dtype=D)


def inner(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    X, Y, _, _ = _data()
    return ((X @ p["w"] - Y) ** 2).mean()


def outer(p: dict[str, torch.Tensor]) -> torch.Tensor:
    _, _, XV, YV = _data()
    return ((XV @ p["w"] - YV) ** 2).mean()


# id -> (optimizer from the hyperparameter tensors, their values, those exactly 0 at T=1)
OPTIMIZERS: dict[str, tuple[Callable[[dict], optim.Optimizer], dict[str, float], set[str]]] = {
    "sgd-momentum": (
        lambda h: optim.sgd(lr=h["lr"], momentum=h["momentum"]),
        {"lr": 0.1, "momentum": 0.9},
        {"momentum"},
    ),
    "sgd-momentum-dampening-wd": (
        lambda h: optim.sgd(
            lr=h["lr"],
            momentum=h["momentum"],
            dampening=h["dampening"],
            weight_decay=h["weight_decay"],
        ),
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05},
        {"momentum", "dampening"},
    ),
    "adam-betas": (
        lambda h: optim.adam(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"]),
        {"lr": 0.1, "beta1": 0.8, "beta2": 0.9, "eps": 1e-2},
        set(),
    ),
    "rmsprop-momentum": (
        lambda h: optim.rmsprop(lr=h["lr"], alpha=h["alpha"], momentum=h["momentum"], eps=1e-2),
        {"lr": 0.01, "alpha": 0.9, "momentum": 0.5},
        set(),
    ),
}


def _tensors(values: dict[str, float]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=D) for k, v in values.items()}


def _train(opt: optim.Optimizer, steps: int) -> float:
    params = {"w": _w0()}
    state = opt.init(params)
    for _ in range(steps):
        x = params["w"].detach().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad(inner({"w": x}, None), [x])
        params, state = opt.update({"w": g}, state, params)
    return float(outer(params))


def _finite_differences(make: Callable, values: dict[str, float], steps: int) -> dict[str, float]:
    fd = {}
    for name, v in values.items():
        eps = 1e-6 * max(1.0, abs(v))
        up = _train(make(_tensors({**values, name: v + eps})), steps)
        down = _train(make(_tensors({**values, name: v - eps})), steps)
        fd[name] = (up - down) / (2 * eps)
    return fd


def _engines(opt: optim.Optimizer, h: dict[str, torch.Tensor], steps: int) -> dict[str, dict]:
    """The hypergradient of every trajectory engine, at ``steps`` inner steps."""
    args = (inner, outer, {"w": _w0()}, opt)
    rtho = hyper.HyperOptimizer(
        *args, h, method="rtho", steps=steps, outer_opt=torch.optim.SGD(list(h.values()), lr=0.0)
    )
    return {
        "reverse": hyper.reverse(*args, steps=steps, hyper=h),
        "reverse-checkpointed": hyper.reverse(*args, steps=steps, hyper=h, checkpoint_every=1),
        "forward": hyper.forward(*args, steps=steps, hyper=h),
        "truncated(last=T)": hyper.truncated(*args, steps=steps, last=steps, hyper=h),
        "rtho": rtho.step().grads,
    }


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("setting", list(OPTIMIZERS), ids=list(OPTIMIZERS))
def test_every_engine_matches_finite_differences(setting: str, steps: int) -> None:
    make, values, zero_at_one = OPTIMIZERS[setting]
    h = _tensors(values)
    found = _engines(make(h), h, steps)
    fd = _finite_differences(make, values, steps)
    problems = []
    for engine, grads in found.items():
        assert sorted(grads) == sorted(values), engine
        for name, g in grads.items():
            if abs(float(g) - fd[name]) > 1e-6 * max(abs(fd[name]), 1e-3):
                problems.append(f"{engine} {name}: {float(g):.10g}, fd {fd[name]:.10g}")
            if steps == 1 and name in zero_at_one and float(g) != 0.0:
                problems.append(f"{engine} {name}: {float(g)!r}, expected exactly 0 at T=1")
        assert_close(grads, found["reverse"], name=f"{setting} T={steps}: {engine} vs reverse")
    assert not problems, f"{setting} T={steps}:\n" + "\n".join(problems)
    for name in zero_at_one:  # finite differences agree: the first step does not use them
        assert fd[name] == 0.0 if steps == 1 else fd[name] != 0.0


def test_hyperparameters_of_a_parameter_without_gradient_are_zero() -> None:
    """Per-parameter values of a parameter the inner loss never uses: the optimizer skips it,
    so its weight decay reaches nothing, and its hypergradient is 0, not an error."""
    lr = torch.tensor(0.1, dtype=D)
    wd_w, wd_frozen = torch.tensor(0.05, dtype=D), torch.tensor(0.05, dtype=D)
    opt = optim.sgd(lr=lr, momentum=0.9, weight_decay={"w": wd_w, "frozen": wd_frozen})
    params0 = {"w": _w0(), "frozen": torch.ones(2, dtype=D)}
    h = {"lr": lr, "wd_w": wd_w, "wd_frozen": wd_frozen}
    args = (inner, lambda p: outer(p) + p["frozen"].sum(), params0, opt)
    rev = hyper.reverse(*args, steps=3, hyper=h)
    fwd = hyper.forward(*args, steps=3, hyper=h)
    assert float(rev["wd_frozen"]) == 0.0 and float(fwd["wd_frozen"]) == 0.0
    assert float(rev["wd_w"]) != 0.0
    assert_close(fwd, rev)


COPY = (
    r"hyper\['momentum'\]: expected a tensor the optimizer or the losses use, got a tensor "
    r"nothing depends on \(no path to the outer loss\) that equals "
    r"opt.hyperparams\['momentum'\] but is another tensor \(a copy\); pass the optimizer's own "
    r"tensor, opt.hyperparams\['momentum'\], not a copy of it"
)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("engine", ["reverse", "forward", "truncated", "rtho"])
def test_a_copy_of_the_optimizers_tensor_raises(engine: str, steps: int) -> None:
    lr, mu = torch.tensor(0.1, dtype=D), torch.tensor(0.9, dtype=D)
    opt = optim.sgd(lr=lr, momentum=mu)
    h = {"lr": lr, "momentum": mu.clone()}
    args = (inner, outer, {"w": _w0()}, opt)
    with pytest.raises(ValueError, match=COPY):
        if engine == "rtho":
            hyper.HyperOptimizer(*args, h, method="rtho", steps=steps).step()
        elif engine == "truncated":
            hyper.truncated(*args, steps=steps, last=steps, hyper=h)
        else:
            getattr(hyper, engine)(*args, steps=steps, hyper=h)
    assert not h["momentum"].requires_grad and not mu.requires_grad  # restored after the error


def test_truncation_that_cuts_the_path_gives_zero_not_an_error() -> None:
    """``last < steps``: a path the truncation cuts is not a mistake, even for a copy."""
    lr, mu = torch.tensor(0.1, dtype=D), torch.tensor(0.9, dtype=D)
    args = (inner, outer, {"w": _w0()}, optim.sgd(lr=lr, momentum=mu))
    res = hyper.truncated(*args, steps=2, last=1, hyper={"lr": lr, "momentum": mu.clone()})
    assert float(res["momentum"]) == 0.0 and float(res["lr"]) != 0.0

"""Bad inputs to gradkit.optim: hyperparameters (numbers and tensors), parameters, gradients,
state and masks of the functional optimizers, and the rows where the answer must be
``torch.optim``'s (parameters without a gradient at some steps, groups without momentum).
The optimizers are functional: a failing call must leave parameters and state as they were."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from gradkit.optim import adam, adamw, apply_updates, rmsprop, sgd, state_layout

from ._case import Case

D = torch.float64


# the parameters and their gradients: the same tensors in every call and every row
@cache
def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 3, dtype=D), "b": torch.zeros(3, dtype=D)}


@cache
def _grads() -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), 0.5, dtype=D), "b": torch.ones(3, dtype=D)}


def _state_tensors(state: Any) -> list[torch.Tensor]:
    out = list(_params().values())
    for f in state._fields:
        value = getattr(state, f)
        if isinstance(value, dict):
            out += [v for v in value.values() if isinstance(v, torch.Tensor)]
    return out


def _update_row(
    id: str,
    make: Callable[[], Any],
    act: Callable[[Any, Any], object],
    raises: type[BaseException],
    words: tuple[str, ...],
) -> Case:
    """A row calling ``act(opt, state)`` on an optimizer that has stepped once."""
    box: dict[str, Any] = {}

    def fixture() -> tuple[Any, Any]:
        if not box:
            opt = make()
            _, state = opt.update(_grads(), opt.init(_params()), _params())
            box["opt"], box["state"] = opt, state
        return box["opt"], box["state"]

    return Case(
        id=id,
        run=lambda: act(*fixture()),
        raises=raises,
        words=words,
        unchanged=lambda: _state_tensors(fixture()[1]),
    )


def _torch_trajectory(
    torch_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ours: Any,
    used: Callable[[str, int], bool],
    steps: int = 6,
) -> None:
    """Train ``{"a", "b"}`` with parameter ``name`` given a gradient at step ``t`` only when
    ``used(name, t)``; gradkit must follow torch.optim step for step."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    start = {n: torch.randn(3, generator=gen, dtype=D) for n in ("a", "b")}
    net = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
    reference = torch_opt(list(net.values()))
    params, state = dict(start), ours.init(start)

    def loss(p: dict[str, torch.Tensor], t: int) -> torch.Tensor:
        terms = [torch.sin(p[n] + t).pow(2).sum() for n in ("a", "b") if used(n, t)]
        return torch.stack(terms).sum()

    for t in range(steps):
        reference.zero_grad(set_to_none=True)
        loss(net, t).backward()
        reference.step()
        leaves = {n: v.detach().requires_grad_(True) for n, v in params.items()}
        gs = torch.autograd.grad(loss(leaves, t), list(leaves.values()), allow_unused=True)
        params, state = ours.update(dict(zip(leaves, gs, strict=True)), state, params)
        for n in ("a", "b"):
            torch.testing.assert_close(params[n], net[n].detach(), rtol=1e-12, atol=1e-14)


def _late(name: str, t: int) -> bool:
    return name == "a" or t >= 3


def _requires_grad_lr() -> None:
    lr = torch.tensor(0.1, dtype=D, requires_grad=True)
    opt = sgd(lr=lr, momentum=0.9)
    new, _ = opt.update(_grads(), opt.init(_params()), _params())
    (g,) = torch.autograd.grad(new["w"].sum(), lr)
    assert torch.equal(g, -_grads()["w"].sum())  # d(w - lr g)/d lr = -g on the first step


def _groups_momentum_zero() -> None:
    """gradkit's per-parameter values against torch.optim's parameter groups."""

    def reference(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [
                {"params": [ps[0]], "momentum": 0.9},
                {"params": [ps[1]], "momentum": 0.0},
            ],
            lr=0.1,
            dampening=0.5,
            foreach=False,
        )

    ours = sgd(lr=0.1, momentum={"a": 0.9, "b": 0.0}, dampening=0.5)
    _torch_trajectory(reference, ours, lambda n, t: True)


ROWS = [
    Case(
        id="optim.sgd.tensor_lr_negative",
        run=lambda: sgd(lr=torch.tensor(-0.1)),
        raises=ValueError,
        words=("sgd: lr", "finite values >= 0", "-0.1"),
    ),
    Case(
        id="optim.sgd.tensor_lr_nan",
        run=lambda: sgd(lr=torch.tensor(math.nan)),
        raises=ValueError,
        words=("sgd: lr", "finite values", "nan"),
    ),
    Case(
        id="optim.adam.tensor_lr_inf",
        run=lambda: adam(lr=torch.tensor(math.inf)),
        raises=ValueError,
        words=("adam: lr", "finite values", "inf"),
    ),
    Case(
        id="optim.sgd.requires_grad_lr_negative",
        run=lambda: sgd(lr=torch.tensor(-0.1, requires_grad=True)),
        raises=ValueError,
        words=("sgd: lr", ">= 0", "may require grad"),
    ),
    Case(
        id="optim.sgd.lr_schedule_negative_entry",
        run=lambda: sgd(lr=torch.tensor([0.1, 0.05, -0.01])),
        raises=ValueError,
        words=("sgd: lr", "entry 2", "shape (3,)"),
    ),
    Case(id="optim.sgd.requires_grad_lr_still_differentiable", run=_requires_grad_lr),
    Case(
        id="optim.sgd.lr_not_scalar",
        run=lambda: sgd(lr=torch.ones(2, 2)),
        raises=ValueError,
        words=("sgd: lr", "0-d tensor or a 1-d schedule", "per-parameter"),
    ),
    Case(
        id="optim.adam.eps_zero",
        run=lambda: adam(eps=0.0),
        raises=ValueError,
        words=("adam: eps", "> 0", "got 0.0"),
    ),
    Case(
        id="optim.rmsprop.eps_tensor_zero",
        run=lambda: rmsprop(eps=torch.tensor(0.0)),
        raises=ValueError,
        words=("rmsprop: eps", "> 0"),
    ),
    Case(
        id="optim.adam.betas_string",
        run=lambda: adam(betas="ab"),
        raises=TypeError,
        words=("adam: betas", "a pair (beta1, beta2)", "'ab'"),
    ),
    Case(
        id="optim.adam.betas_three",
        run=lambda: adam(betas=(0.9, 0.99, 0.9)),
        raises=ValueError,
        words=("adam: betas", "a pair", "length 3"),
    ),
    Case(
        id="optim.adamw.beta2_one",
        run=lambda: adamw(betas=(0.9, 1.0)),
        raises=ValueError,
        words=("adamw: beta2", "< 1", "1.0"),
    ),
    Case(
        id="optim.sgd.momentum_string",
        run=lambda: sgd(0.1, momentum="0.9"),
        raises=TypeError,
        words=("sgd: momentum", "a number or a tensor", "'0.9'"),
    ),
    Case(
        id="optim.sgd.nesterov_int",
        run=lambda: sgd(0.1, momentum=0.9, nesterov=1),
        raises=TypeError,
        words=("sgd: nesterov", "a bool", "got 1"),
    ),
    _update_row(
        "optim.sgd.update_grad_dtype",
        lambda: sgd(0.1, momentum=0.9),
        lambda o, s: o.update({"w": _grads()["w"].float(), "b": _grads()["b"]}, s, _params()),
        ValueError,
        ("sgd.update: grads['w']", "dtype torch.float64", "torch.float32"),
    ),
    _update_row(
        "optim.sgd.update_int_params",
        lambda: sgd(0.1),
        lambda o, s: o.update(_grads(), s, {"w": _params()["w"].long(), "b": _params()["b"]}),
        TypeError,
        ("sgd.update: params['w']", "floating-point", "int64"),
    ),
    _update_row(
        "optim.adam.update_state_other_shapes",
        lambda: adam(0.1),
        lambda o, s: o.update(
            _grads(),
            s._replace(exp_avg={"w": torch.zeros(3, dtype=D), "b": _params()["b"]}),
            _params(),
        ),
        ValueError,
        ("adam.update: state.exp_avg['w']", "like its parameter", "shape=(3,)"),
    ),
    _update_row(
        "optim.adam.update_counts_above_step",
        lambda: adam(0.1),
        lambda o, s: o.update(_grads(), s._replace(counts={"w": 5, "b": 1}), _params()),
        ValueError,
        ("adam.update: state.counts['w']", "[0, state.step=1]", "5"),
    ),
    Case(
        id="optim.sgd.update_mask_shape",
        run=lambda: sgd(0.1, mask={"w": torch.ones(3, dtype=torch.bool), "b": None}).update(
            _grads(), sgd(0.1).init(_params()), _params()
        ),
        raises=ValueError,
        words=("sgd.update: mask['w']", "shape (2, 3)", "shape=(3,)"),
        unchanged=lambda: list(_params().values()),
    ),
    _update_row(
        "optim.sgd.update_return_delta_string",
        lambda: sgd(0.1),
        lambda o, s: o.update(_grads(), s, _params(), return_delta="yes"),
        TypeError,
        ("sgd.update: return_delta", "a bool", "'yes'"),
    ),
    _update_row(
        "optim.adam.update_betas_override_string",
        lambda: adam(0.1),
        lambda o, s: o.update(_grads(), s, _params(), betas="ab"),
        TypeError,
        ("adam.update: betas", "a pair", "'ab'"),
    ),
    Case(
        id="optim.apply_updates.delta_shape",
        run=lambda: apply_updates(_params(), {"w": torch.ones(1, dtype=D), "b": _params()["b"]}),
        raises=ValueError,
        words=("apply_updates(params, delta): delta['w']", "shape (2, 3)", "shape=(1,)"),
        unchanged=lambda: list(_params().values()),
    ),
    Case(
        id="optim.state_layout.slot_shape",
        run=lambda: state_layout({"w": torch.ones(3)}, adam().init({"w": torch.ones(2)})),
        raises=ValueError,
        words=("state_layout(params, state): state.exp_avg['w']", "shaped like its parameter"),
    ),
    Case(
        id="optim.StateLayout.unflatten_step_negative",
        run=lambda: state_layout(_params(), sgd(0.1).init(_params())).unflatten(
            torch.zeros(9, dtype=D), step=-1
        ),
        raises=ValueError,
        words=("StateLayout.unflatten: step", ">= 0", "-1"),
    ),
    Case(
        id="optim.adam.late_parameter_bias_correction",
        run=lambda: _torch_trajectory(
            lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False), adam(lr=0.1), _late
        ),
    ),
    Case(
        id="optim.sgd.late_parameter_first_buffer_undampened",
        run=lambda: _torch_trajectory(
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, foreach=False),
            sgd(lr=0.1, momentum=0.9, dampening=0.5),
            _late,
        ),
    ),
    Case(
        id="optim.adamw.sometimes_unused_parameter_skipped",
        run=lambda: _torch_trajectory(
            lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5, foreach=False),
            adamw(lr=0.1, weight_decay=0.5),
            lambda n, t: n == "a" or t % 2 == 0,
        ),
    ),
    Case(id="optim.sgd.group_without_momentum_ignores_dampening", run=_groups_momentum_zero),
]

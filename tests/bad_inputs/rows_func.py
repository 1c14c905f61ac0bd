"""Bad inputs to gradkit.func: gradients/hessians, the function transforms, batch_jacobian's
row-independence precondition, custom_gradient's captured tensors, the HVP operators and the
module helpers. A refused call leaves the weights and the accumulated gradients as they were;
rows that must succeed compare with plain autograd or the full Jacobian."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.func import (
    batch_jacobian,
    custom_gradient,
    grad,
    gradients,
    hessians,
    hvp,
    hvp_operator,
    jacobian,
    jvp,
    module_grad,
    module_hessian,
    module_hvp_operator,
    module_jacobian,
    stop_gradient,
    value_and_grad,
    vjp,
)
from gradkit.testing import assert_close

from ._case import Built, Case

D = torch.float64


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    for p in model.parameters():  # gradients accumulated before the call must survive it
        p.grad = torch.full_like(p, 0.25)
    return model


def _batch(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(n, 3, dtype=D, generator=g), torch.randint(0, 2, (n,), generator=g)


def _state(*modules: Callable[[], nn.Module]) -> Callable[[], Sequence[torch.Tensor]]:
    return lambda: [
        t for m in modules for p in m().parameters() for t in (p, p.grad) if t is not None
    ]


# -- batch_jacobian: output row i must depend on input row i only ------------------------------


def _row_wise_matches_the_full_jacobian() -> None:
    model, (x, _) = _mlp(), _batch()
    full = jacobian(model, x)
    assert_close(batch_jacobian(model, x), torch.stack([full[i, :, i] for i in range(5)]))


@cache
def _bn() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(D)


# -- custom_gradient: captured tensors ---------------------------------------------------------
# The functions below capture the layer _LIN as a global (found among the globals their code
# names, and named so in messages); _lin() builds it on first use.

_LIN: nn.Linear


def _lin() -> nn.Linear:
    global _LIN
    if "_LIN" not in globals():
        _LIN = _mlp()[0]
    return _LIN


def _lin_input() -> torch.Tensor:
    """An input for the functions below, once the layer they capture is built."""
    _lin()
    return _batch()[0]


@custom_gradient
def _no_variables(t: torch.Tensor) -> tuple[torch.Tensor, Callable[..., Any]]:
    return _LIN(t), lambda dy: dy @ _LIN.weight


@custom_gradient
def _with_variables(t: torch.Tensor) -> tuple[torch.Tensor, Callable[..., Any]]:
    y = torch.tanh(_LIN(t))

    def grad_fn(dy: torch.Tensor, variables: list[torch.Tensor]) -> Any:
        dz = dy * (1 - y**2)
        return dz @ _LIN.weight, [dz.T @ t, dz.sum(0)]

    return y, grad_fn


@custom_gradient
def _one_variable_gradient(t: torch.Tensor) -> tuple[torch.Tensor, Callable[..., Any]]:
    return _LIN(t), lambda dy, variables: (dy @ _LIN.weight, [dy.T @ t])


def _captured_weight_gets_its_gradient() -> None:
    x = _lin_input().requires_grad_(True)
    got = gradients(_with_variables(x).sum(), [x, _LIN.weight, _LIN.bias])
    ref = torch.autograd.grad(torch.tanh(_LIN(x)).sum(), [x, _LIN.weight, _LIN.bias])
    assert_close(got, list(ref))


# -- HVP operators after the point changed ------------------------------------------------------


@cache
def _stepped() -> Built:
    """An operator whose model took an optimizer step after it was built."""
    model = _mlp()
    op = module_hvp_operator(model, F.cross_entropy, _batch())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()  # the accumulated gradients of _mlp(): a real in-place step
    return Built(model, op)


@cache
def _edited() -> Built:
    """An operator whose model's bias was edited through ``.data`` after it was built."""
    model = _mlp()
    op = module_hvp_operator(model, F.cross_entropy, _batch())
    model[2].bias.data.add_(1.0)  # no version counter sees this
    return Built(model, op)


def _times_ones(op: Any) -> torch.Tensor:
    return op @ torch.ones(op.shape[0], dtype=D)


@cache
def _frozen() -> nn.Sequential:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    return model


@cache
def _m() -> nn.Sequential:
    return _mlp()


@cache
def _a() -> torch.Tensor:
    return torch.ones(3, requires_grad=True)


@cache
def _no_grad() -> torch.Tensor:
    return torch.ones(3)


def _freed_graph() -> None:
    y = (_a().exp()).sum()
    y.backward()
    gradients(y, [_a()])


ROWS: list[Case] = [
    Case(
        "func.batch_jacobian.rows_mixed_by_the_mean",
        lambda: batch_jacobian(lambda t: t - t.mean(0), _batch()[0]),
        GradkitError,
        ("batch_jacobian(<lambda>)", "row i depends on input row i", "rows [", "jacobian(f, x)"),
    ),
    Case(
        "func.batch_jacobian.softmax_over_the_batch",
        lambda: batch_jacobian(lambda t: torch.softmax(t, 0), _batch()[0], mode="forward"),
        GradkitError,
        ("batch_jacobian(<lambda>)", "depend on other rows", "check_independence=False"),
    ),
    Case(
        "func.batch_jacobian.functional_batch_norm_train",
        lambda: batch_jacobian(lambda t: F.batch_norm(t, None, None, training=True), _batch()[0]),
        GradkitError,
        ("batch norm in training mode", "rows ["),
    ),
    Case(
        "func.batch_jacobian.batch_norm_module_train",
        lambda: batch_jacobian(_bn(), _batch()[0]),
        GradkitError,
        ("batch_jacobian(Sequential)", "in place", "model.eval()"),
        _state(_bn),
    ),
    Case("func.batch_jacobian.row_wise_matches_full", _row_wise_matches_the_full_jacobian),
    Case(
        "func.batch_jacobian.empty_batch",
        lambda: batch_jacobian(torch.sin, torch.ones(0, 3)),
        ValueError,
        ("batch_jacobian(sin)", "x", "at least one row", "shape=(0, 3)"),
    ),
    Case(
        "func.custom_gradient.captured_weight_without_variables",
        lambda: _no_variables(_lin_input()),
        TypeError,
        ("custom_gradient(_no_variables)", "grad_fn", "variables", "_LIN.weight", "_LIN.bias"),
        _state(_lin),
    ),
    Case("func.custom_gradient.captured_weight_gradient", _captured_weight_gets_its_gradient),
    Case(
        "func.custom_gradient.variable_gradient_count",
        lambda: _one_variable_gradient(_lin_input()).sum().backward(),
        ValueError,
        ("custom_gradient(_one_variable_gradient)", "2 variable gradient(s)", "got 1"),
        _state(_lin),
    ),
    Case(
        "func.custom_gradient.not_callable",
        lambda: custom_gradient(3),  # type: ignore[arg-type]
        TypeError,
        ("custom_gradient(f)", "f", "callable", "got 3"),
    ),
    Case(
        "func.gradients.x_without_requires_grad",
        lambda: gradients((_a() * _no_grad()).sum(), [_no_grad()]),
        ValueError,
        ("gradients(ys, xs)", "xs[0]", "requires grad", "requires_grad_()"),
    ),
    Case(
        "func.gradients.grad_ys_dtype",
        lambda: gradients(_a() * 2, [_a()], [torch.ones(3, dtype=D)]),
        TypeError,
        ("grad_ys[0]", "dtype torch.float32", "float64"),
    ),
    Case(
        "func.gradients.grad_ys_on_meta",
        lambda: gradients(_a() * 2, [_a()], [torch.ones(3, device="meta")]),
        ValueError,
        ("grad_ys[0]", "a tensor on {device}", "meta"),
    ),
    Case(
        "func.gradients.freed_graph",
        _freed_graph,
        GradkitError,
        ("gradients(ys, xs)", "freed", "retain_graph=True"),
    ),
    Case(
        "func.gradients.create_graph_string",
        lambda: gradients(_a().sum(), [_a()], create_graph="yes"),  # type: ignore[arg-type]
        TypeError,
        ("create_graph", "a bool", "'yes'"),
    ),
    Case(
        "func.hessians.chunk_size_zero",
        lambda: hessians((_a() ** 3).sum(), _a(), chunk_size=0),
        ValueError,
        ("hessians(ys, xs)", "chunk_size", "got 0"),
    ),
    Case(
        "func.hessians.x_without_requires_grad",
        lambda: hessians((_a() * _no_grad()).sum(), _no_grad()),
        ValueError,
        ("hessians(ys, xs)", "xs[0]", "requires grad"),
    ),
    Case(
        "func.jacobian.f_not_callable",
        lambda: jacobian(3, torch.ones(2)),  # type: ignore[arg-type]
        TypeError,
        ("jacobian(int)", "f", "callable", "got 3"),
    ),
    Case(
        "func.jacobian.vectorize_string",
        lambda: jacobian(torch.sin, torch.ones(2), vectorize="no"),  # type: ignore[arg-type]
        TypeError,
        ("jacobian(sin)", "vectorize", "'no'"),
    ),
    Case(
        "func.jacobian.batch_norm_module_train",
        lambda: jacobian(_bn(), _batch()[0]),
        GradkitError,
        ("jacobian(Sequential)", "captured tensor in place", "model.eval()"),
        _state(_bn),
    ),
    Case(
        "func.jvp.tangent_dtype",
        lambda: jvp(torch.sin, torch.ones(2), torch.ones(2, dtype=D)),
        TypeError,
        ("jvp(sin)", "v[0]", "dtype torch.float32", "float64"),
    ),
    Case(
        "func.jvp.integer_point",
        lambda: jvp(torch.sin, torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long)),
        TypeError,
        ("jvp(sin)", "args[0]", "floating-point", "int64"),
    ),
    Case(
        "func.vjp.cotangent_dtype",
        lambda: vjp(torch.sin, torch.ones(2), torch.ones(2, dtype=D)),
        TypeError,
        ("vjp(sin)", "v[0]", "dtype torch.float32"),
    ),
    Case(
        "func.hvp.integer_point",
        lambda: hvp(lambda t: t.sum(), torch.ones(2, dtype=torch.long), torch.ones(2)),
        TypeError,
        ("hvp(<lambda>)", "args[0]", "floating-point"),
    ),
    Case(
        "func.hvp_operator.chunk_size_zero",
        lambda: hvp_operator(lambda t: (t**3).sum(), torch.ones(2), chunk_size=0),
        ValueError,
        ("hvp_operator(<lambda>)", "chunk_size", "got 0"),
    ),
    Case(
        "func.module_hvp_operator.after_optimizer_step",
        lambda: _times_ones(_stepped().op),
        GradkitError,
        ("module_hvp_operator(Sequential) @ v", "other values", "version", "build a new"),
        _state(lambda: _stepped().model),
    ),
    Case(
        "func.module_hvp_operator.after_p_data_edit",
        lambda: _edited().op.to_dense(),
        GradkitError,
        ("'2.bias'", "other values", "gradkit.curvature.Hessian"),
        _state(lambda: _edited().model),
    ),
    Case(
        "func.module_grad.frozen_parameter_named",
        lambda: module_grad(_frozen(), F.cross_entropy, _batch(), params=["0.weight"]),
        ValueError,
        ("module_value_and_grad(Sequential)", "params", "frozen ['0.weight']"),
        _state(_frozen),
    ),
    Case(
        "func.module_grad.empty_batch",
        lambda: module_grad(_m(), F.cross_entropy, (_batch()[0][:0], _batch()[1][:0])),
        ValueError,
        ("module_value_and_grad(Sequential)", "batch", "at least one example"),
        _state(_m),
    ),
    Case(
        "func.module_grad.loss_fn_string",
        lambda: module_grad(_m(), "cross_entropy", _batch()),  # type: ignore[arg-type]
        TypeError,
        ("loss_fn", "callable", "'cross_entropy'"),
        _state(_m),
    ),
    Case(
        "func.module_hessian.flat_string",
        lambda: module_hessian(_m(), F.cross_entropy, _batch(), flat="yes"),  # type: ignore[call-overload]
        TypeError,
        ("module_hessian(Sequential)", "flat", "'yes'"),
    ),
    Case(
        "func.module_jacobian.mode_unknown",
        lambda: module_jacobian(_m(), _batch()[0], mode="fwd"),
        ValueError,
        ("module_jacobian(Sequential)", "mode", "'fwd'"),
    ),
    Case(
        "func.grad.has_aux_string",
        lambda: grad(lambda t: t.sum(), has_aux="no")(torch.ones(2)),  # type: ignore[arg-type]
        TypeError,
        ("grad(<lambda>)", "has_aux", "a bool", "'no'"),
    ),
    Case(
        "func.value_and_grad.aux_not_a_tensor",
        lambda: value_and_grad(lambda t: (t.sum(), 1), has_aux=True)(torch.ones(2)),
        TypeError,
        ("value_and_grad(<lambda>)", "aux", "tensors", "int"),
    ),
    Case(
        "func.jvp.f_returns_a_float",
        lambda: jvp(lambda t: 1.0, torch.ones(2), torch.ones(2)),
        TypeError,
        ("jvp(<lambda>)", "f", "returning a tensor", "float"),
    ),
    Case(
        "func.stop_gradient.list",
        lambda: stop_gradient([1.0]),  # type: ignore[arg-type]
        TypeError,
        ("stop_gradient(x)", "a torch.Tensor", "list"),
    ),
]

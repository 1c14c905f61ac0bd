"""Second derivatives through an ``autograd.Function`` whose backward is marked
``@once_differentiable`` are refused by every second-order entry point: torch drops them
without an error (its result is a constant where the gradient reaching it does not require
grad, an ``Error`` node a second backward prunes where it does), so ``hvp`` gave ``H v`` without
the function's part (``[2, 4, 6]`` for ``[5, -8, 42]``) and ``module_hvp`` gave zeros. A
function with a differentiable backward stays exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import GGN, Hessian
from gradkit.func import (
    hessians,
    hvp,
    hvp_operator,
    module_ggnvp,
    module_hvp,
    module_hvp_operator,
)

D = torch.float64


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * x**2


class _OnceCube(_Cube):
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * x**2


def _f(cube: type[torch.autograd.Function]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: cube.apply(x).sum() + (x**2).sum()  # H = diag(6 x + 2)


def _point() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0.5, -1.0, 2.0], dtype=D), torch.tensor([1.0, 2.0, 3.0], dtype=D)


def test_a_differentiable_backward_is_exact() -> None:
    x, v = _point()
    want = (6 * x + 2) * v
    torch.testing.assert_close(hvp(_f(_Cube), x, v)[1], want)
    torch.testing.assert_close(hvp_operator(_f(_Cube), x) @ v, want)
    xr = x.clone().requires_grad_(True)
    torch.testing.assert_close(hessians(_f(_Cube)(xr), [xr])[0], torch.diag(6 * x + 2))


FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "hvp": lambda x, v: hvp(_f(_OnceCube), x, v),
    "hvp_operator": lambda x, v: hvp_operator(_f(_OnceCube), x),
    "hessians": lambda x, v: hessians(_f(_OnceCube)(x.requires_grad_(True)), [x]),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_refuse_a_once_differentiable_backward(name: str) -> None:
    x, v = _point()
    with pytest.raises(GradkitError, match=r"cannot be differentiated again.*_OnceCubeBackward"):
        FUNCTIONS[name](x, v)


class _Model(nn.Module):
    def __init__(self, cube: type[torch.autograd.Function], at_the_top: bool) -> None:
        super().__init__()
        self.cube, self.top = cube, at_the_top
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.top:  # its output enters the loss linearly: no Error node, a constant
            return self.cube.apply(self.b(torch.tanh(self.a(x))))
        return self.b(self.cube.apply(self.a(x)))


def _problem(cube: type[torch.autograd.Function], top: bool) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = _Model(cube, top).double()
    batch = (torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D))
    return model, lambda out, y: (out * y).sum() + 0.1 * out.pow(2).sum(), batch


MODULE_CALLS: dict[str, Callable[[nn.Module, Any, Any], Any]] = {
    "module_hvp": lambda m, f, b: module_hvp(
        m, f, b, {n: torch.ones_like(p) for n, p in m.named_parameters()}
    ),
    "module_ggnvp": lambda m, f, b: module_ggnvp(
        m, f, b, {n: torch.ones_like(p) for n, p in m.named_parameters()}
    ),
    "module_hvp_operator": lambda m, f, b: module_hvp_operator(m, f, b),
    "Hessian": lambda m, f, b: Hessian(m, f, b, reduction="sum"),
    "GGN": lambda m, f, b: GGN(m, F.mse_loss, b),
}


@pytest.mark.parametrize("top", [True, False], ids=["at_the_top", "inside"])
@pytest.mark.parametrize("name", sorted(MODULE_CALLS))
def test_module_products_refuse_a_once_differentiable_backward(name: str, top: bool) -> None:
    model, loss_fn, batch = _problem(_OnceCube, top)
    with pytest.raises(GradkitError, match="cannot be differentiated again"):
        MODULE_CALLS[name](model, loss_fn, batch)


@pytest.mark.parametrize("top", [True, False], ids=["at_the_top", "inside"])
def test_module_hvp_with_a_differentiable_backward_is_the_double_backward(top: bool) -> None:
    model, loss_fn, batch = _problem(_Cube, top)
    v = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    params = list(model.parameters())
    gs = torch.autograd.grad(loss_fn(model(batch[0]), batch[1]), params, create_graph=True)
    want = torch.autograd.grad(gs, params, list(v.values()))
    got = module_hvp(model, loss_fn, batch, v)
    for w, g in zip(want, got.values(), strict=True):
        torch.testing.assert_close(g, w)

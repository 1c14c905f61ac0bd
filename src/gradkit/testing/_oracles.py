"""Dumb, trustworthy oracles: one example at a time with autograd, and central finite
differences in float64. Slow on purpose; every fast path in gradkit is tested against them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradkit._precision import without_cudnn_rnn

__all__ = [
    "finite_difference_grad",
    "finite_difference_hvp",
    "finite_difference_jacobian",
    "per_example_grads",
]


def per_example_grads(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: torch.Tensor,
    targets: Any,
    *,
    batch_dim: int = 0,
    dtype: torch.dtype | None = torch.float64,
) -> dict[str, torch.Tensor]:
    """Individual gradients ``g_i = d l_i / d theta`` by a loop over examples with autograd.

    Args:
        model: the model (copied, cast to ``dtype``; the original is untouched).
        loss_fn: ``loss_fn(model(x_i), y_i)`` is the loss of example ``i`` (``x_i`` keeps a
            batch dimension of size 1).
        inputs: the batch, examples along ``batch_dim``.
        targets: targets with examples along dimension 0 (or None).
        dtype: cast model and floating inputs to this dtype (None keeps them).

    Returns:
        ``{name: [N, *param.shape]}`` for every parameter with ``requires_grad``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.testing import per_example_grads
        >>> model = nn.Linear(1, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(2.0)
        >>> x, y = torch.tensor([[1.0], [3.0]]), torch.zeros(2, 1)
        >>> per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)["weight"]
        tensor([[[ 4.]],
        <BLANKLINE>
                [[36.]]], dtype=torch.float64)
    """
    m = copy.deepcopy(model)
    if dtype is not None:
        m = m.to(dtype)
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        if isinstance(targets, torch.Tensor) and targets.is_floating_point():
            targets = targets.to(dtype)
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
    with without_cudnn_rnn(m):  # cuDNN's RNN backward runs in training mode only
        for i in range(inputs.shape[batch_dim]):
            x_i = inputs.narrow(batch_dim, i, 1)
            y_i = None if targets is None else targets[i : i + 1]
            loss = loss_fn(m(x_i), y_i)
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            for (n, p), g in zip(named, grads, strict=True):
                rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(r) for n, r in rows.items()}


def finite_difference_jacobian(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """Central differences in float64: ``J[..., k] = (f(x + eps e_k) - f(x - eps e_k)) / 2eps``.

    Returns a tensor of shape ``f(x).shape + x.shape``.

    Examples:
        >>> import torch
        >>> finite_difference_jacobian(lambda x: x**2, torch.tensor([1.0, 2.0])).round(decimals=6)
        tensor([[2., 0.],
                [0., 4.]], dtype=torch.float64)
    """
    x64 = x.detach().to(torch.float64)
    cols = []
    with torch.no_grad():
        for k in range(x64.numel()):
            e = torch.zeros_like(x64).view(-1)
            e[k] = eps
            e = e.view(x64.shape)
            cols.append((f(x64 + e).to(torch.float64) - f(x64 - e).to(torch.float64)) / (2 * eps))
    jac = torch.stack(cols, dim=-1)
    return jac.reshape((*jac.shape[:-1], *x.shape))


def finite_difference_grad(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """The gradient of a scalar ``f`` by central differences in float64, shaped like ``x``."""
    return finite_difference_jacobian(lambda z: f(z).reshape(()), x, eps=eps)


def finite_difference_hvp(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    v: torch.Tensor,
    *,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``H v`` by central differences of the autograd gradient along ``v`` (float64)."""
    x64, v64 = x.detach().to(torch.float64), v.detach().to(torch.float64)

    def g(z: torch.Tensor) -> torch.Tensor:
        z = z.detach().requires_grad_(True)
        with torch.enable_grad():
            (out,) = torch.autograd.grad(f(z), z)
        return out

    return (g(x64 + eps * v64) - g(x64 - eps * v64)) / (2 * eps)

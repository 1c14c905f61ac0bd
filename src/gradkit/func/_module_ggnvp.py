"""Generalized Gauss-Newton-vector products on ``(model, loss_fn, batch)``, keyed like
``model.named_parameters()`` (the conventions of :mod:`._module`).

``G v = J^T H_out J v`` in three autograd passes over the model as it is, and no state:

1. ``J v`` by the double-backward trick: with ``u`` a dummy output gradient that requires grad,
   ``J v`` is the gradient w.r.t. ``u`` of ``<J^T u, v>``. For layers linear in their chosen
   parameters (Linear, Conv), ``<J^T u, v> = sum_l <dz_l(u), layer_l(x_l; v_l)>``, so the
   first backward stops at the layer outputs ``z_l`` (no weight products);
2. ``H_out (J v)`` by double backward of the loss w.r.t. the detached output;
3. ``J^T`` of that by one backward through the forward graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradkit._autograd import first_grads
from gradkit._errors import describe, message
from gradkit._params import LossFn
from gradkit.func._module import _check_batch, _forward, _scalar
from gradkit.func._module_hvp import (
    _chosen_vectors,
    _layer_directional,
    _layer_owners,
    _only_recorded_uses,
    _recorded,
)

__all__ = ["module_ggnvp"]


def module_ggnvp(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    v: Mapping[str, torch.Tensor],
    *,
    params: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    r"""``G v`` for ``v`` keyed by parameter name (the keys of ``v`` pick the parameters), with
    ``G`` the generalized Gauss-Newton matrix of ``loss_fn(model(inputs), targets)``:

    .. math:: G = J^\top H_{\mathrm{out}} J, \qquad J = \partial f_\theta(x) / \partial\theta,
              \quad H_{\mathrm{out}} = \nabla^2_f \,\ell(f, y)

    One product at the parameters as they are, in about 2.4 gradients (a forward, ``J v`` by
    the double-backward trick, stopped at the layer outputs where the chosen parameters are
    those of Linear and Conv layers, and ``J^T``); nothing is kept. For many products at one
    point use :class:`gradkit.curvature.GGN`, which keeps the graph (about 1.75 gradients per
    further product) and follows the model when it changes. The model must return one
    floating-point tensor, the loss's first argument.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.func import module_ggnvp
        >>> model = nn.Linear(2, 1, bias=False)
        >>> x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0]])
        >>> module_ggnvp(model, nn.functional.mse_loss, (x, y), {"weight": torch.ones(1, 2)})
        {'weight': tensor([[ 6., 12.]])}
    """
    call = f"module_ggnvp({type(model).__name__})"
    chosen, vs = _chosen_vectors(model, v, params, call)
    _check_batch(loss_fn, batch, call)
    xs = list(chosen.values())
    with torch.enable_grad():
        owners = _layer_owners(model, chosen)
        if owners is not None:
            out, calls = _recorded(owners, lambda: _forward(model, batch[0]))
        else:
            out, calls = _forward(model, batch[0]), None
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() == 0:
            raise TypeError(
                message(
                    call,
                    "model",
                    "a model returning one floating-point tensor with a batch dimension",
                    describe(out),
                    "wrap the model so that it returns the tensor the loss takes",
                )
            )
        od = out.detach().requires_grad_(True)
        loss = _scalar(loss_fn(od, batch[1]), call)
        if calls and not _only_recorded_uses(out, calls, owners or {}, chosen):
            calls = None  # a chosen parameter is used outside its layer: the plain trick
        jv = _jvp(out, xs, vs, owners, calls, call) if out.requires_grad else None
        hjv = None
        if jv is not None:
            (r,) = first_grads(loss, [od], call=call)
            if r is not None and r.requires_grad:  # else a loss linear in the output
                (hjv,) = torch.autograd.grad(r, od, jv, allow_unused=True)
        if hjv is None:
            return {n: torch.zeros_like(p) for n, p in chosen.items()}
        res = torch.autograd.grad(out, xs, hjv, allow_unused=True)
    return {
        n: torch.zeros_like(p) if r is None else r.detach()
        for (n, p), r in zip(chosen.items(), res, strict=True)
    }


def _jvp(
    out: torch.Tensor,
    xs: list[torch.Tensor],
    vs: Mapping[str, torch.Tensor],
    owners: Mapping[nn.Module, Mapping[str, str]] | None,
    calls: Any,
    call: str,
) -> torch.Tensor | None:
    """``J v`` (None where the output does not depend on the chosen parameters)."""
    u = torch.zeros_like(out, requires_grad=True)
    if owners is not None and calls:
        zs = [z for _, _, z in calls]
        grads_z = first_grads(out, zs, u, call=call, weight_norm=False)  # J v: linear in u
        total = _layer_directional(calls, grads_z, owners, vs)
        if total is None or not total.requires_grad:
            return None
        (jv,) = torch.autograd.grad(total, u, allow_unused=True)
        return jv
    gs = first_grads(out, xs, u, call=call, weight_norm=False)
    live = [
        (g, v) for g, v in zip(gs, vs.values(), strict=True) if g is not None and g.requires_grad
    ]
    if not live:
        return None
    (jv,) = torch.autograd.grad([g for g, _ in live], u, [v for _, v in live], allow_unused=True)
    return jv

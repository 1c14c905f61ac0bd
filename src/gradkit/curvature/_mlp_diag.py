r"""The exact Hessian diagonal of sequential MLPs in one extra backward sweep.

For ``nn.Sequential`` models of ``Linear`` layers (on ``[N, features]`` inputs, after an
optional ``Flatten``) and elementwise activations, the Hessian of the loss w.r.t. each layer's
output ``z_l`` is block-diagonal over examples; its blocks ``K_{l,n}`` ``[d_l, d_l]`` follow
from the loss Hessian w.r.t. the output by (Dangel, Harmeling and Hennig 2020, "Modular
block-diagonal curvature approximations"; BackPACK's ``DiagHessian``)

.. math:: K_{l-1,n} = D_n W_l^\top K_{l,n} W_l D_n + \operatorname{diag}\big(\sigma''(z_{l-1,n})
          \odot W_l^\top \delta_{l,n}\big), \qquad D_n = \operatorname{diag}(\sigma'(z_{l-1,n}))

with ``delta`` the loss gradient, and the diagonal of the Hessian w.r.t. ``W_l`` and ``b_l`` is

.. math:: \operatorname{diag}(H_{W_l})_{ij} = \sum_n a_{l-1,n,j}^2 (K_{l,n})_{ii}, \qquad
          \operatorname{diag}(H_{b_l})_i = \sum_n (K_{l,n})_{ii}

exactly (the layer's output is linear in its own parameters). Index legend: ``n`` example,
``i``/``o`` output feature, ``j``/``p`` input feature. ``sigma'`` and ``sigma''`` come from
autograd on the activation module itself. Cost: ``N d_l^2 d_{l-1}`` per layer; memory
``N d^2`` per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradkit.curvature._data import Data
from gradkit.curvature._ggn import loss_hessian_blocks
from gradkit.curvature._layout import Layout
from gradkit.func._common import computes_as

__all__ = ["mlp_factor_diagonal", "mlp_hessian_diagonal", "mlp_layers"]

ELEMENTWISE = (
    nn.Tanh,
    nn.Sigmoid,
    nn.ReLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.Softsign,
    nn.Tanhshrink,
    nn.LogSigmoid,
    nn.Identity,
)


def mlp_layers(model: nn.Module) -> list[nn.Module] | None:
    """The layers of a supported sequential MLP (``Flatten`` first at most), or None.

    Every module must compute exactly what its class in torch computes (:func:`computes_as`:
    no subclass overriding ``forward``, no forward hooks, no parametrization), since the
    closed forms are written for those computations; any other model takes the generic path.
    """
    if not computes_as(model, nn.Sequential):
        return None
    layers = list(model)
    start = 1 if layers and isinstance(layers[0], nn.Flatten) else 0
    if start and (
        not computes_as(layers[0], nn.Flatten)
        or layers[0].start_dim != 1
        or layers[0].end_dim != -1
    ):
        return None
    owned = 0
    for layer in layers[start:]:
        if computes_as(layer, nn.Linear):
            owned += sum(1 for _ in layer.parameters())
        elif (
            not any(computes_as(layer, act) for act in ELEMENTWISE)
            or next(layer.parameters(), None) is not None
        ):
            return None
    if owned != sum(1 for _ in model.parameters()):  # shared or foreign parameters
        return None
    return layers


def _own(layer: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``z``, or a copy of it for an activation that writes its output into its input
    (``inplace=True``): the sweep keeps the pre-activations, and autograd refuses an in-place
    change of a leaf that requires grad."""
    return z.clone() if getattr(layer, "inplace", False) else z


def _derivatives(layer: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.detach().requires_grad_(True)
    with torch.enable_grad():
        (d1,) = torch.autograd.grad(layer(_own(layer, z)).sum(), z, create_graph=True)
        d2 = None
        if d1.requires_grad:
            (d2,) = torch.autograd.grad(d1.sum(), z, allow_unused=True)
    return d1.detach(), torch.zeros_like(z) if d2 is None else d2


def mlp_hessian_diagonal(
    data: Data, layout: Layout, layers: list[nn.Module], *, max_memory: int, call: str
) -> torch.Tensor | None:
    """``diag(H)`` ``[P]`` of the loss on ``data`` w.r.t. the parameters of ``layout`` (a
    supported MLP), or None when a batch's inputs do not fit (not a ``[N, features]`` tensor
    after ``Flatten``) or the per-example blocks would take more than ``max_memory`` bytes."""
    diag: dict[int, torch.Tensor] = {}
    widest = max(m.out_features for m in layers if isinstance(m, nn.Linear))
    for index, (inputs, targets, n) in enumerate(data):
        if n * widest * widest * 8 * 3 > max_memory:
            return None
        weight = data.weight(index, n, targets)
        if weight == 0:  # nothing of it counts (its own mean loss is nan)
            continue
        run = _forward(layers, inputs, slopes=False)
        if run is None:
            return None
        h, saved = run
        K, delta = loss_hessian_blocks(data, h, targets, max_memory=max_memory, call=call)
        delta = delta.double()  # the blocks are float64 whatever the model's dtype
        for layer, a, derivs in reversed(saved):
            if derivs is None:
                assert isinstance(layer, nn.Linear)
                kd = K.diagonal(dim1=1, dim2=2)  # [n, o]
                a64 = a.double()
                parts = [(layer.weight, kd.T @ a64.square())]
                if layer.bias is not None:
                    parts.append((layer.bias, kd.sum(0)))
                for p, d in parts:
                    key = id(p)
                    diag[key] = diag.get(key, 0) + weight * d
                W = layer.weight.detach().double()
                K = W.T @ K @ W  # [n, p, p]
                delta = delta @ W
            else:
                d1, d2 = (d.double() for d in derivs)
                K = d1[:, :, None] * K * d1[:, None, :] + torch.diag_embed(d2 * delta)
                delta = delta * d1
    out = [
        diag.get(id(p), torch.zeros(p.shape, dtype=torch.float64, device=p.device)).reshape(-1)
        for p in layout.params
    ]
    return torch.cat(out).to(layout.params[0].dtype)


def _slope(layer: nn.Module, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``sigma'(z)`` of an elementwise activation module (``out = sigma(z)``): in closed form
    for Tanh, Sigmoid, ReLU and LeakyReLU, else by autograd on the module itself."""
    if type(layer) is nn.Tanh:
        return 1 - out.square()
    if type(layer) is nn.Sigmoid:
        return out * (1 - out)
    if type(layer) is nn.ReLU:
        return (z > 0).to(z.dtype)
    if type(layer) is nn.LeakyReLU:
        return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, layer.negative_slope))
    z = z.detach().requires_grad_(True)
    with torch.enable_grad():
        y = layer(_own(layer, z))
        if not y.requires_grad:  # constant in z (e.g. a step function)
            return torch.zeros_like(z)
        (d1,) = torch.autograd.grad(y.sum(), z)
    return d1


def _forward(layers: list[nn.Module], inputs: Any, slopes: bool) -> Any:
    """The MLP on ``inputs`` (``[N, features]`` after ``Flatten``): its output and, per layer,
    ``(layer, input, sigma'(input) or None for a Linear)``; None if the inputs do not fit."""
    if not isinstance(inputs, torch.Tensor):
        return None
    h = inputs.detach()
    if isinstance(layers[0], nn.Flatten):
        h = h.flatten(1)
    if h.dim() != 2:
        return None
    saved: list[tuple[nn.Module, torch.Tensor, Any]] = []
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, nn.Flatten):
                continue
            if isinstance(layer, nn.Linear):
                saved.append((layer, h, None))
                h = layer(h)
                continue
            out = layer(_own(layer, h))
            saved.append((layer, h, _slope(layer, h, out) if slopes else _derivatives(layer, h)))
            h = out
    return h, saved


def mlp_factor_diagonal(
    data: Data,
    layout: Layout,
    layers: list[nn.Module],
    factors: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor | None:
    r"""``diag(sum_b w_b J_b^T M_b J_b)`` ``[P]`` for a supported MLP, given the factors of
    every example's output matrix ``M_n = sum_c s_nc s_nc^T - sum_c t_nc t_nc^T`` (``factors``
    as for :func:`~gradkit.curvature._diag.factor_diagonal`); None when a batch's inputs do not
    fit.

    The columns are backpropagated through the layers together, in float64: ``S_{l-1} =
    (S_l W_l) \odot \sigma'(z_{l-1})`` for all ``C`` columns in one product, and a Linear
    layer's diagonal is ``sum_n (sum_c S_{l,n,c}^2) a_{l-1,n}^2``, the squares summed over the
    columns *before* the product with the inputs (BackPACK's ``DiagGGNExact``): one product
    per layer for all columns, where per-example gradients take one backward per column.
    """
    diag: dict[int, torch.Tensor] = {}
    for index, (inputs, targets, n) in enumerate(data):
        weight = data.weight(index, n, targets)
        if weight == 0:  # nothing of it counts (its own mean loss is nan)
            continue
        run = _forward(layers, inputs, slopes=True)
        if run is None:
            return None
        out, saved = run
        pos, neg = factors(out, targets, index)
        first = next(i for i, (layer, _, _) in enumerate(saved) if isinstance(layer, nn.Linear))
        for sign, cols in ((1.0, pos), (-1.0, neg)):
            if cols.shape[0] == 0:
                continue
            S = cols.reshape(cols.shape[0], n, -1).double()  # [C, n, o]
            for k in range(len(saved) - 1, first - 1, -1):
                layer, a, slope = saved[k]
                if slope is not None:
                    S = S * slope.double()
                    continue
                assert isinstance(layer, nn.Linear)
                sq = S.square().sum(0)  # [n, o]
                parts = [(layer.weight, sq.T @ a.double().square())]
                if layer.bias is not None:
                    parts.append((layer.bias, sq.sum(0)))
                for p, d in parts:
                    diag[id(p)] = diag.get(id(p), 0) + (sign * weight) * d
                if k > first:
                    S = S @ layer.weight.detach().double()
    out_parts = [
        diag.get(id(p), torch.zeros(p.shape, dtype=torch.float64, device=p.device)).reshape(-1)
        for p in layout.params
    ]
    return torch.cat(out_parts).to(layout.params[0].dtype)

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

from typing import Any

import torch
from torch import nn

from gradkit.curvature._data import Data
from gradkit.curvature._ggn import loss_hessian_blocks
from gradkit.curvature._layout import Layout

__all__ = ["mlp_hessian_diagonal", "mlp_layers"]

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
    """The layers of a supported sequential MLP (``Flatten`` first at most), or None."""
    if not isinstance(model, nn.Sequential):
        return None
    layers = list(model)
    start = 1 if layers and isinstance(layers[0], nn.Flatten) else 0
    if start and (layers[0].start_dim != 1 or layers[0].end_dim != -1):
        return None
    owned = 0
    for layer in layers[start:]:
        if isinstance(layer, nn.Linear):
            owned += sum(1 for _ in layer.parameters())
        elif not isinstance(layer, ELEMENTWISE) or next(layer.parameters(), None) is not None:
            return None
    if owned != sum(1 for _ in model.parameters()):  # shared or foreign parameters
        return None
    return layers


def _derivatives(layer: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.detach().requires_grad_(True)
    with torch.enable_grad():
        (d1,) = torch.autograd.grad(layer(z).sum(), z, create_graph=True)
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
    for inputs, targets, n in data:
        if not isinstance(inputs, torch.Tensor) or n * widest * widest * 8 * 3 > max_memory:
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
                else:
                    saved.append((layer, h, _derivatives(layer, h)))
                h = layer(h)
        K, delta = loss_hessian_blocks(data, h, targets, max_memory=max_memory, call=call)
        weight = data.weight(n)
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

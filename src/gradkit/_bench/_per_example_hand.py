"""A hand-written reference for the ``per_example`` suite: each quantity computed for one model
by the code a user would write for exactly that model, with nothing general and no checks.

For an ``nn.Sequential`` of ``Linear`` and ``Conv2d`` layers and parameter-free layers (the
MLP, the sequence model, 3c3d and the demo CNN), the forward runs the layers one by one,
keeping each tracked layer's input and calling ``retain_grad()`` on its output; after
``loss.backward()`` each layer's per-example gradients come from the input ``A`` and the
output gradient ``G`` (scaled to those of ``l_i``), both ``[N, T, features]`` (a convolution's
input unfolded into its ``T`` patches):

* ``T == 1``: second moment ``(G^2)^T (A^2) / N``, squared norms ``|G_i|^2 |A_i|^2``,
  per-example gradients ``G_i A_i^T`` written into a buffer kept across calls;
* ``T > 1``: the per-example gradients ``G_i^T A_i`` (``bmm``), squared and summed, or their
  norms by the Gram form ``sum((A_i A_i^T) * (G_i G_i^T))`` where that takes fewer
  multiply-adds; each bias gradient is ``G`` summed over ``T``;
* the mean is ``p.grad`` (over ``N`` for a sum loss), the variance ``second moment - mean^2``
  clamped at 0, as every method computes it.

It is what the suite's speed goals can be measured against: the products gradkit runs, with
autograd's own weight gradient instead of gradkit's fusion (the weight gradient as the sum of
per-example gradients computed anyway) and none of gradkit's hooks, checks and bookkeeping. It
is not a peer: no target compares gradkit with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._bench._per_example_problems import Problem, _positional

__all__ = ["hand_written"]

_LABEL = "hand-written for this model: retain_grad + the quantity's products, no checks"


def _supported(model: nn.Module) -> bool:
    if not isinstance(model, nn.Sequential):
        return False
    for m in model:
        if isinstance(m, nn.Linear):
            continue
        if isinstance(m, nn.Conv2d):
            if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
                return False
            continue
        if any(True for _ in m.parameters()):
            return False
    return True


def _unfolded(m: Any, x: torch.Tensor) -> torch.Tensor:
    """The patches of ``x`` the convolution ``m`` multiplies: ``[N, L, C * kh * kw]``."""
    cols = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
    return cols.transpose(1, 2)


def hand_written(p: Problem, quantity: str) -> tuple[str, Callable[[], Any]] | None:
    """The label and call of the hand-written ``quantity`` for ``p``, or None for a model it
    does not cover (anything but a plain ``nn.Sequential`` of the layers above)."""
    model = p.model
    if not _supported(model) or p.call is not _positional:  # called as model(x)
        return None
    layers: list[Any] = list(model.children())
    n = p.n
    scale = float(n) if p.reduction == "mean" else 1.0  # from the gradient reaching G to l_i's
    kept: dict[int, torch.Tensor] = {}  # per-example gradients' buffers, kept across calls

    def forward() -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        saved: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        h = p.x
        for m in layers:
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                a = h
                h = m(h)
                h.retain_grad()
                saved.append((m, a, h))
            else:
                h = m(h)
        p.loss_fn(h, p.y).backward()
        return saved

    def factors(m: Any, a: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = out.grad
        assert g is not None
        if isinstance(m, nn.Conv2d):
            a3 = _unfolded(m, a.detach())
            g3 = g.reshape(n, m.out_channels, -1).transpose(1, 2)
        else:
            a3 = a.detach().reshape(n, -1, m.in_features)
            g3 = g.reshape(n, -1, m.out_features)
        return a3, g3 * scale

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        saved = forward()
        results: list[torch.Tensor] = []
        norms = torch.zeros(n, dtype=p.x.dtype, device=p.x.device)
        for m, a, out in saved:
            a3, g3 = factors(m, a, out)
            t = a3.shape[1]
            w_shape = m.weight.shape
            bias = g3.sum(1) if t > 1 else g3[:, 0]  # [N, out]
            if quantity == "batch_l2":
                if t == 1:
                    g2 = bias.square().sum(1)
                    norms += g2 * (a3[:, 0].square().sum(1) + (m.bias is not None))
                    continue
                d_in, d_out = a3.shape[2], g3.shape[2]
                if t * (d_in + d_out) < d_in * d_out:  # the Gram form is cheaper
                    gram = torch.bmm(a3, a3.transpose(1, 2)).mul_(torch.bmm(g3, g3.transpose(1, 2)))
                    norms += gram.sum((1, 2))
                else:
                    norms += torch.bmm(g3.transpose(1, 2), a3).square().sum((1, 2))
                if m.bias is not None:
                    norms += bias.square().sum(1)
                continue
            if quantity == "batch_grad":
                buf = kept.get(id(m))
                if buf is None:
                    buf = kept[id(m)] = a3.new_empty(n, g3.shape[2], a3.shape[2])
                if t == 1:
                    torch.mul(g3[:, 0, :, None], a3[:, 0, None, :], out=buf)
                else:
                    torch.bmm(g3.transpose(1, 2), a3, out=buf)
                results.append(buf.view(n, *w_shape))
                if m.bias is not None:
                    results.append(bias)
                continue
            # second moment (and the variance from it)
            if t == 1:
                w2 = torch.mm(g3[:, 0].square().T, a3[:, 0].square()).div_(n)
            else:
                w2 = torch.bmm(g3.transpose(1, 2), a3).square_().mean(0)
            moments = [(m.weight, w2.view(w_shape))]
            if m.bias is not None:
                moments.append((m.bias, bias.square().mean(0)))
            for param, m2 in moments:
                if quantity == "variance":
                    assert param.grad is not None
                    mean = param.grad if p.reduction == "mean" else param.grad / n
                    m2 = m2.sub_(mean.square()).clamp_min_(0)
                results.append(m2)
        return norms if quantity == "batch_l2" else results

    return _LABEL, step

"""``nn.Conv1d/2d/3d`` with stride, padding (numbers, ``"same"``, ``"valid"``, any padding
mode), dilation, groups and bias: exact, by patches.

The input is unfolded into patches ``A[n, t, g, i]`` (``t`` output position, ``i`` = input
channels of group ``g`` times kernel positions) and the output gradient reshaped to
``G[n, t, g, o]``; then ``g_n(W) = sum_t G[n, t]^T A[n, t]`` per group (an
:class:`OuterProduct`) and ``g_n(b) = sum_t G[n, t]``. The sum over positions is taken before any
power: TensorFlow's ``gradient_moment.py`` takes ``sum_t (.)^p`` instead and is 31-47 % off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradkit.per_example._grads import Materialized, OuterProduct, PerExampleGrad, cat_positions
from gradkit.per_example._registry import RuleContext, Use, register_rule
from gradkit.per_example._stats import acc_dtype


def _pads(module: nn.modules.conv._ConvNd, spatial: int) -> list[int]:
    """``F.pad`` amounts (last dimension first) that reproduce the module's padding."""
    k, d = module.kernel_size, module.dilation
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return [0] * (2 * spatial)
        pads: list[int] = []
        for i in reversed(range(spatial)):
            total = d[i] * (k[i] - 1)
            pads += [total // 2, total - total // 2]
        return pads
    return [p for i in reversed(range(spatial)) for p in (module.padding[i],) * 2]


def unfold_patches(x: torch.Tensor, module: nn.modules.conv._ConvNd) -> torch.Tensor:
    """``[N, C_in * prod(kernel), L]`` patches of ``x`` as the convolution sees them."""
    spatial = x.dim() - 2
    pads = _pads(module, spatial)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    if spatial == 2 and mode == "constant" and pads[0] == pads[1] and pads[2] == pads[3]:
        return F.unfold(x, module.kernel_size, module.dilation, (pads[2], pads[0]), module.stride)
    if any(pads):
        x = F.pad(x, pads, mode=mode)
    for i in range(spatial):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    # [N, C, L1..Ls, k1..ks] -> [N, C, k1..ks, L1..Ls]
    n, c = x.shape[:2]
    perm = [0, 1, *range(2 + spatial, 2 + 2 * spatial), *range(2, 2 + spatial)]
    x = x.permute(perm)
    return x.reshape(n, c * x.shape[2 : 2 + spatial].numel(), -1)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.ConvNd`` (see the module docstring)."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    n = uses[0].grad_output.shape[0]
    groups, c_out = module.groups, module.out_channels
    dtype = acc_dtype(uses[0].grad_output.dtype)
    a_parts, g_parts = [], []
    for u in uses:
        x = u.inputs[0]
        grad = u.grad_output.reshape(n, c_out, -1)  # [N, C_out, L]
        g_parts.append(grad.reshape(n, groups, c_out // groups, -1).permute(0, 3, 1, 2))
        if "weight" in ctx.params:
            p = unfold_patches(x, module)  # [N, C_in*K, L]
            a_parts.append(p.reshape(n, groups, -1, p.shape[-1]).permute(0, 3, 1, 2))
    g = cat_positions(g_parts).to(dtype)  # [N, T, groups, o]
    out: dict[str, PerExampleGrad] = {}
    if "weight" in ctx.params:
        a = cat_positions(a_parts).to(dtype)
        out["weight"] = OuterProduct(a, g, ctx.params["weight"].shape)
    if "bias" in ctx.params:
        out["bias"] = Materialized(g.sum(1).reshape(n, c_out))
    return out

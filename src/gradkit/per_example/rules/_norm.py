"""Affine parameters of ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` and BatchNorm in
eval mode.

With ``xhat`` the normalized input (recomputed without the affine part),
``y = weight * xhat + bias`` gives ``g_n(weight) = sum_{positions} G_n * xhat_n`` and
``g_n(bias) = sum_{positions} G_n``, summed over the positions that share a parameter entry.
When the parameter covers every non-batch dimension (``LayerNorm((C, H, W))`` on
``[N, C, H, W]``, ``LayerNorm(d)`` on ``[N, d]``, ``GroupNorm`` on ``[N, C]``) there are no such
positions and nothing is summed: ``Tensor.sum(())`` would reduce over *all* dimensions. The
bias's per-example gradient is then a copy of the output gradient, never the tensor itself:
statistics are accumulated in place on the blocks of a :class:`Materialized`, which would
otherwise rescale the gradient autograd goes on to propagate (and ``p.grad``).
BatchNorm (``nn.BatchNorm1d/2d/3d``) normalizes with its running statistics in eval mode, the
same for every example: ``xhat`` is recomputed from them, per channel. A call that normalizes
with the batch's statistics (training mode, or no running statistics) mixes the examples and
is refused before it runs (:func:`._capture.refuse_batchnorm`). InstanceNorm goes through the
vmap fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradkit.per_example._grads import Materialized, PerExampleGrad
from gradkit.per_example._registry import RuleContext, Use, register_rule
from gradkit.per_example._stats import as_dtype, statistics_dtype


def _sum_positions(
    t: torch.Tensor, reduce_dims: tuple[int, ...], *, owned: bool = False
) -> torch.Tensor:
    """``t`` summed over ``reduce_dims`` (``t.sum(())`` would sum everything), always a fresh
    tensor (``owned``: ``t`` already is one): statistics are accumulated in place on the blocks
    of a :class:`Materialized`, so returning the output gradient itself (the bias with no
    positions) would scale the gradient that autograd goes on to propagate, and ``p.grad``."""
    if reduce_dims:
        return t.sum(reduce_dims)
    return t if owned else t.clone()


def _affine(
    xhats: list[torch.Tensor],
    grads: list[torch.Tensor],
    ctx: RuleContext,
    reduce_dims: list[tuple[int, ...]],
    shape: torch.Size,
) -> dict[str, PerExampleGrad]:
    """``g_n(weight)`` and ``g_n(bias)`` ``[N, *shape]``, summed over uses and over the
    positions of each (``reduce_dims``, per use: a shared layer may be called on inputs of
    different ranks)."""
    n = grads[0].shape[0]
    out: dict[str, PerExampleGrad] = {}
    if "weight" in ctx.params:
        ws = [
            _sum_positions(g * x, dims, owned=True)
            for g, x, dims in zip(grads, xhats, reduce_dims, strict=True)
        ]
        w = ws[0] if len(ws) == 1 else torch.stack(ws).sum(0)
        out["weight"] = Materialized(w.reshape(n, *shape))
    if "bias" in ctx.params:
        bs = [_sum_positions(g, dims) for g, dims in zip(grads, reduce_dims, strict=True)]
        b = bs[0] if len(bs) == 1 else torch.stack(bs).sum(0)
        out["bias"] = Materialized(b.reshape(n, *shape))
    return out


def _prep(uses: list[Use]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    dtype = statistics_dtype(uses[0].grad_output.dtype)
    xs = [as_dtype(u.inputs[0], dtype) for u in uses]
    gs = [as_dtype(u.grad_output, dtype) for u in uses]
    return xs, gs


@register_rule(nn.LayerNorm)
def layer_norm_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.LayerNorm``'s affine parameters."""
    assert isinstance(module, nn.LayerNorm)
    xs, gs = _prep(uses)
    shape = torch.Size(module.normalized_shape)
    xhats = [F.layer_norm(x, shape, None, None, module.eps) for x in xs]
    return _affine(xhats, gs, ctx, _leading(xs, shape), shape)


def _leading(xs: list[torch.Tensor], shape: torch.Size) -> list[tuple[int, ...]]:
    """Per use, the dimensions between the examples and the normalized ones."""
    return [tuple(range(1, x.dim() - len(shape))) for x in xs]


layer_norm_rule.leading_dims = True  # type: ignore[attr-defined]  # any leading dimensions

if hasattr(nn, "RMSNorm"):

    @register_rule(nn.RMSNorm)
    def rms_norm_rule(
        module: nn.Module, uses: list[Use], ctx: RuleContext
    ) -> dict[str, PerExampleGrad]:
        """Per-example gradients of ``nn.RMSNorm``'s weight."""
        xs, gs = _prep(uses)
        assert isinstance(module, nn.RMSNorm)
        shape = torch.Size(module.normalized_shape)
        xhats = [F.rms_norm(x, shape, None, module.eps) for x in xs]
        return _affine(xhats, gs, ctx, _leading(xs, shape), shape)

    rms_norm_rule.leading_dims = True  # type: ignore[attr-defined]


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def batch_norm_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of BatchNorm's affine parameters ``[C]`` in eval mode (its
    running statistics: a call with the batch's is refused before it runs)."""
    assert isinstance(module, nn.modules.batchnorm._BatchNorm)
    assert module.running_mean is not None and module.running_var is not None
    xs, gs = _prep(uses)
    xhats = [
        F.batch_norm(
            x,
            module.running_mean.to(x.dtype),
            module.running_var.to(x.dtype),
            None,
            None,
            False,
            0.0,
            module.eps,
        )
        for x in xs
    ]
    spatial = [tuple(range(2, x.dim())) for x in xs]
    return _affine(xhats, gs, ctx, spatial, torch.Size((module.num_features,)))


@register_rule(nn.GroupNorm)
def group_norm_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.GroupNorm``'s affine parameters ``[C]``."""
    assert isinstance(module, nn.GroupNorm)
    xs, gs = _prep(uses)
    xhats = [F.group_norm(x, module.num_groups, None, None, module.eps) for x in xs]
    spatial = [tuple(range(2, x.dim())) for x in xs]
    return _affine(xhats, gs, ctx, spatial, torch.Size((module.num_channels,)))

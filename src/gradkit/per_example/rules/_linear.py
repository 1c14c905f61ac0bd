"""``nn.Linear`` on any number of leading dimensions.

``z[n, ..., o] = sum_i W[o, i] a[n, ..., i] + b[o]``. Positions (the ``...`` dims, and the uses
of a shared layer) are flattened into ``t``: ``g_n(W) = sum_t G[n, t]^T a[n, t]`` (an
:class:`OuterProduct`, closed forms when ``T == 1``), ``g_n(b) = sum_t G[n, t]``.
"""

from __future__ import annotations

import torch
from torch import nn

from gradkit.per_example._grads import (
    BiasOf,
    Materialized,
    OuterProduct,
    PerExampleGrad,
    cat_positions,
)
from gradkit.per_example._registry import RuleContext, Use, register_rule
from gradkit.per_example._stats import as_dtype, statistics_dtype


def affine_rule(
    uses: list[Use], ctx: RuleContext, *, transposed: bool
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``z = a W^T + b`` (``W [o, i]``), or of ``z = a W + b`` with
    ``transposed`` (``W [i, o]``: Hugging Face's ``Conv1D``, the outer product's factors
    exchanged so that its ``[o', i']`` layout is the weight's own)."""
    n = uses[0].grad_output.shape[0]
    d_in = uses[0].inputs[0].shape[-1]
    d_out = uses[0].grad_output.shape[-1]
    dtype = statistics_dtype(uses[0].grad_output.dtype)
    a = as_dtype(cat_positions([u.inputs[0].reshape(n, -1, d_in) for u in uses]), dtype)
    g = as_dtype(cat_positions([u.grad_output.reshape(n, -1, d_out) for u in uses]), dtype)
    out: dict[str, PerExampleGrad] = {}
    shape = torch.Size((d_in, d_out) if transposed else (d_out, d_in))
    left, right = (g, a) if transposed else (a, g)
    weight = OuterProduct(left[:, :, None], right[:, :, None], shape)
    if "weight" in ctx.params:
        out["weight"] = weight
    if "bias" in ctx.params:
        # g_n(b) = sum_t G[n, t], which shares G and its square with the weight's closed
        # forms; in the transposed layout G is the weight's first factor: summed here
        out["bias"] = Materialized(g.sum(1), owned=True) if transposed else BiasOf(weight)
    return out


@register_rule(nn.Linear)
def linear_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.Linear`` (see the module docstring)."""
    return affine_rule(uses, ctx, transposed=False)


linear_rule.weight_sums = "linear"  # type: ignore[attr-defined]  # see _fused
linear_rule.leading_dims = True  # type: ignore[attr-defined]  # any leading dimensions

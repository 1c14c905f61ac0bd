"""The weight gradient of a Linear on sequences, summed from the per-example gradients the
statistics materialize anyway.

For ``z[n, t] = W a[n, t] + b`` with ``T > 1`` positions, every statistic beyond the mean and
the norms needs the per-example gradients ``g_n = sum_t G[n, t]^T a[n, t]`` (one batched
product, ``N T o i`` multiply-adds). Autograd computes ``sum_n g_n`` by another product of the
same cost. While tracking, the layer's output is handed to :class:`LinearWithSums` (no
recomputation: the forward's own output is reused in place), whose backward takes the weight
gradient as the sum of the per-example gradients the statistics just computed, instead of
multiplying again. The input's and the bias's gradients are computed as autograd computes them.

``p.grad`` of such a weight then equals autograd's up to float rounding (a sum over examples of
per-example products instead of one product over all positions: about 1e-7 relative in
float32, 1e-16 in float64; under bf16/fp16 autocast the sum is taken in float32, where autograd
multiplies in the low precision); every other gradient is unchanged. Where the per-example gradients
were not materialized in this backward (closed forms sufficed, the layer was called several
times, a double backward builds a graph through the gradient), the backward multiplies as
autograd does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LinearWithSums", "WeightSum"]


class WeightSum:
    """The sum over examples of the per-example weight gradients of one layer call, filled
    block by block by the statistics and taken once by the layer's backward."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def add(self, block: torch.Tensor) -> None:
        """Add ``block.sum(0)`` (``block``: ``[n, *weight.shape]`` per-example gradients)."""
        part = block.sum(0)
        self.total = part if self.total is None else self.total.add_(part)

    def take(self) -> torch.Tensor | None:
        total, self.total = self.total, None
        return total


class LinearWithSums(torch.autograd.Function):
    """``z = a W^T + b`` (or ``a W + b`` for a transposed weight, Hugging Face's ``Conv1D``)
    whose value is the layer's own output and whose weight gradient comes from a
    :class:`WeightSum` when it was filled (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        sums: WeightSum,
        transposed: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sums, ctx.transposed = sums, transposed
        ctx.bias_dtype = bias.dtype if bias is not None else out.dtype
        ctx.mark_dirty(out)  # the output is reused as it is, not copied
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        # under autocast the layer ran in g's dtype: products in it, gradients in each input's
        wg = w.to(g.dtype)
        if ctx.needs_input_grad[0]:
            gx = (g @ (wg.T if ctx.transposed else wg)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            total = ctx.sums.take()
            if total is not None and not torch.is_grad_enabled():
                gw = total.to(w.dtype)
            else:  # not materialized, or a graph of the gradient is wanted: multiply
                g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).to(g.dtype)
                gw = (x2.T @ g2 if ctx.transposed else g2.T @ x2).to(w.dtype)
        if ctx.needs_input_grad[2]:
            gb = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None, None

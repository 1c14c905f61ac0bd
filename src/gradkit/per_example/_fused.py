"""The weight gradient of a Linear on sequences or of a convolution, summed from the
per-example gradients the statistics materialize anyway.

For ``z[n, t] = W a[n, t] + b`` with ``T > 1`` positions (a convolution: its output positions
and unfolded patches), every statistic beyond the mean and the norms needs the per-example
gradients ``g_n = sum_t G[n, t]^T a[n, t]`` (one batched product, ``N T o i`` multiply-adds).
Autograd computes ``sum_n g_n`` by another product of the same cost. While tracking, the
layer's output is handed to :class:`LinearWithSums` or :class:`ConvWithSums` (no
recomputation: the forward's own output is reused in place), whose backward takes the weight
gradient as the sum of the per-example gradients the statistics just computed, instead of
multiplying again. The input's gradient is computed as autograd computes it. The bias's is the
sum over examples of the per-example bias gradients the rule already summed over the positions
(``N`` rows added instead of ``N T``: one pass over the output gradient saved); a convolution's
would otherwise also need the weight's product, which the CPU's convolution backward computes
whenever the bias's is asked for.

``p.grad`` of such a weight and bias then equals autograd's up to float rounding (a sum over
examples of per-example sums instead of one sum over all positions: about 1e-7 of the terms'
magnitude in float32, 1e-16 in float64; a gradient that cancels to about 0, such as an
attention key projection's bias under softmax, gets another value of that tiny size); every
other gradient is unchanged. A call in bf16/fp16 (autocast) is not fused (see the tracker's
``_fusable``): summed in float32, its weight gradient would differ from autograd's
low-precision product by that precision's rounding. Where the per-example gradients were not
materialized in this backward (closed forms sufficed, the layer was called several times, a
double backward builds a graph through the gradient), the backward computes every gradient as
autograd does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ConvWithSums", "LinearWithSums", "WeightSum", "fusable_call", "fused_output"]


class WeightSum:
    """The sum over examples of the per-example weight gradients of one layer call, filled
    block by block by the statistics and taken once by the layer's backward; and the bias's,
    summed from the rule's per-example bias gradients (``bias``)."""

    __slots__ = ("bias", "total")

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def add(self, block: torch.Tensor, factor: float = 1.0) -> None:
        """Add ``factor * block.sum(0)`` (``block``: ``[n, *weight.shape]`` per-example
        gradients, ``factor`` undoing a scale the statistics folded into them)."""
        part = block.sum(0)
        if factor != 1.0:
            part.mul_(factor)
        self.total = part if self.total is None else self.total.add_(part)

    def take(self) -> torch.Tensor | None:
        total, self.total = self.total, None
        return total

    def take_bias(self) -> torch.Tensor | None:
        bias, self.bias = self.bias, None
        return bias


class _WithSums(torch.autograd.Function):
    """The forward of :class:`LinearWithSums` and :class:`ConvWithSums`: the layer's own
    output ``out``, reused as it is (not copied), with what their backward needs; ``layout``:
    whether a Linear's weight is transposed, or a convolution's configuration."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        sums: WeightSum,
        layout: Any,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sums, ctx.layout = sums, layout
        ctx.bias_dtype = bias.dtype if bias is not None else out.dtype
        ctx.mark_dirty(out)
        return out


class LinearWithSums(_WithSums):
    """``z = a W^T + b`` (or ``a W + b`` for a transposed weight, Hugging Face's ``Conv1D``)
    whose value is the layer's own output and whose weight gradient comes from a
    :class:`WeightSum` when it was filled (see the module docstring)."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        # under autocast the layer ran in g's dtype: products in it, gradients in each input's
        wg = w.to(g.dtype)
        if ctx.needs_input_grad[0]:
            gx = (g @ (wg.T if ctx.layout else wg)).to(x.dtype)
        # the sums serve unless a graph of the gradient is wanted (create_graph)
        summed = not torch.is_grad_enabled()
        if ctx.needs_input_grad[1]:
            total = ctx.sums.take()
            if total is not None and summed:
                gw = total.to(w.dtype)
            else:  # not materialized, or a graph of the gradient is wanted: multiply
                g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).to(g.dtype)
                gw = (x2.T @ g2 if ctx.layout else g2.T @ x2).to(w.dtype)
        bias = ctx.sums.take_bias()
        if ctx.needs_input_grad[2]:
            if bias is None or not summed:
                bias = g.reshape(-1, g.shape[-1]).sum(0)
            gb = bias.to(ctx.bias_dtype)
        return gx, gw, gb, None, None, None


class ConvWithSums(_WithSums):
    """A convolution ``z = conv(x, W) + b`` (zero padding, symmetric) whose value is the layer's
    own output and whose weight and bias gradients come from a :class:`WeightSum` when it was
    filled (see the module docstring)."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.layout
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        total = ctx.sums.take() if need_w else None
        bias = ctx.sums.take_bias()
        summed = total is not None and not torch.is_grad_enabled()
        # not summed: every gradient as autograd computes it (bit-for-bit)
        mask = [need_x, need_w and not summed, need_b and not summed]
        gx = gw = gb = None
        if any(mask):
            # under autocast the layer ran in g's dtype: products in it, gradients in each input's
            gx, gw, gb = torch.ops.aten.convolution_backward(
                g,
                x.to(g.dtype),
                w.to(g.dtype),
                [w.shape[0]] if need_b and not summed else None,
                stride,
                padding,
                dilation,
                False,
                [0] * len(stride),
                groups,
                mask,
            )
        if summed:
            assert total is not None
            gw = total
            if need_b:
                gb = bias if bias is not None else g.reshape(*g.shape[:2], -1).sum(-1).sum(0)
        return (
            gx.to(x.dtype) if gx is not None else None,
            gw.to(w.dtype) if gw is not None else None,
            gb.to(ctx.bias_dtype) if gb is not None else None,
            None,
            None,
            None,
        )


def _conv_config(module: nn.Module) -> tuple[list[int], list[int], list[int], int] | None:
    """``(stride, padding, dilation, groups)`` of a convolution :class:`ConvWithSums` can
    differentiate: zero padding, the same amount on both sides of each dimension."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    if module.padding_mode != "zeros":
        return None
    spatial = module.weight.dim() - 2
    if isinstance(module.padding, str):
        if module.padding != "valid":  # "same": symmetric where dilation * (kernel - 1) is even
            k, d = module.kernel_size, module.dilation
            totals = [d[i] * (k[i] - 1) for i in range(spatial)]
            if any(t % 2 for t in totals):
                return None
            padding = [t // 2 for t in totals]
        else:
            padding = [0] * spatial
    else:
        padding = list(module.padding)
    return list(module.stride), padding, list(module.dilation), module.groups


MIN_PRODUCT = 2**21
"""Multiply-adds of autograd's weight product below which a layer call is not fused. Fusing
costs a custom function's Python on both passes (10 us in the forward alone, measured) and, for
``batch_grad``, writing the blocks during the backward instead of after it; measured on the
demo CNN, fusing its convolutions (0.08 and 0.6 million multiply-adds) made the step 5 %
slower, while on DeepOBS 3c3d (0.2 to 1 billion) it saves 8 % of a tracked step."""


def fusable_call(kind: str, x: torch.Tensor, weight: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether a call of a layer fused as ``kind`` has ``T > 1`` positions per example and a
    weight product of at least :data:`MIN_PRODUCT` multiply-adds."""
    if kind == "conv":  # [N, C, *spatial], batched when the input has the weight's dimensions
        if output.dim() < 3 or x.dim() != output.dim():
            return False
        spread, features = output.shape[2:].numel(), output.shape[1]
    else:
        if x.dim() < 2:
            return False
        spread, features = x.numel() // max(1, x.shape[0] * x.shape[-1]), output.shape[-1]
    product = output.numel() // max(1, features) * weight.numel()  # N T o i
    return spread > 1 and product >= MIN_PRODUCT


def fused_output(
    kind: str, module: nn.Module, x: torch.Tensor, output: torch.Tensor, sums: WeightSum
) -> torch.Tensor | None:
    """``output`` handed to the function of ``kind`` (``"linear"``, ``"linear_t"`` for a
    transposed weight, ``"conv"``), or None where that layer call cannot be fused."""
    weight, bias = module.weight, module.bias
    if kind == "conv":
        config = _conv_config(module)
        if config is None:
            return None
        return ConvWithSums.apply(x, weight, bias, output.detach(), sums, config)
    return LinearWithSums.apply(x, weight, bias, output.detach(), sums, kind == "linear_t")

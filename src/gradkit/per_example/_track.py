"""``track``: statistics of individual gradients inside the usual backward pass.

The machinery is in :mod:`._tracker` (hooks and processing), :mod:`._capture` (what the
forward records), :mod:`._edge_mean` (the mean read at the parameters' edges) and
:mod:`._results` (what users read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from gradkit.per_example._tracker import Tracker

__all__ = ["Tracker", "track"]

_DEFAULT_MAX_MEMORY = 256 * 2**20


def track(
    model: nn.Module,
    *quantities: str,
    moments: Sequence[int] = (),
    loss_reduction: str = "mean",
    loss_scale: Any = None,
    batch_dim: int | Mapping[str, int] = 0,
    fallback: str = "vmap",
    unbiased: bool = False,
    max_memory: int = _DEFAULT_MAX_MEMORY,
    chunk_size: int | None = None,
    fuse: bool = True,
) -> Tracker:
    r"""Track statistics of the individual gradients of ``model``'s parameters.

    Use it as a context manager around forward and backward passes. For per-example losses
    ``l_i`` and individual gradients ``g_i = d l_i / d theta`` (whatever the loss reduction):

    .. math:: \text{mean} = \tfrac1N \sum_i g_i,\quad
              \text{moment}(p) = \tfrac1N \sum_i g_i^p,\quad
              \text{variance} = \tfrac1N \sum_i g_i^2 - \text{mean}^2,\quad
              \text{batch\_l2}_i = \lVert g_i \rVert^2

    Args:
        model: the model; every module with parameters of its own that require grad is
            tracked (frozen parameters are skipped).
        *quantities: any of ``"mean"``, ``"second_moment"``, ``"variance"``, ``"batch_l2"``,
            ``"batch_grad"``. Only what is asked is computed.
        moments: further powers ``p`` for ``stats[name].moment(p)``.
        loss_reduction: how the loss of each backward combined the ``l_i``: ``"mean"`` over the
            examples of that backward, or ``"sum"``. Where the loss says it (a ``reduction``
            of a torch loss at the top of the graph, alone or plus other terms) a
            contradiction raises; a custom loss cannot be checked.
        loss_scale: a factor the backpropagated loss carries on top of that, divided out of
            the statistics: a ``torch.amp.GradScaler`` (``scaler.scale(loss).backward()``;
            its ``get_scale()`` is read here, once: one block per optimizer step) or a
            positive number (``1 / k`` for ``(loss / k).backward()``). None: the statistics
            are those of the loss as backpropagated, scaled or not (a scaling cannot be
            detected: the engine has run the scaling node before any tracked layer). Every
            backward pass of the block must carry the same factor: a micro-batch's mean times
            its share ``n_b / N`` does not (the statistics would mix differently scaled
            gradients); sum each micro-batch's losses, divide by the total ``N`` and pass
            ``loss_reduction="sum", loss_scale=1 / N`` (``docs/per_example.md``).
        batch_dim: the batch dimension of the model's inputs and of its layers' inputs and
            outputs, or a mapping from submodule names to it (``{"": 1, "head": 0}``: ``""``
            for the model's inputs, a name for that submodule and those inside it). Layers
            with a documented layout use theirs instead (``batch_first`` of RNNs and
            attention, the RNN state ``[layers * directions, N, H]``, the layers of a
            ``nn.TransformerEncoderLayer``, ``[N, C, ...]`` of convolutions); the number of
            examples ``N`` is that of the model's first input (read by that layout where the
            first layer takes the input itself), and a layer whose output broadcasts over the
            batch (position ids ``[1, T]``) is split by it. A ``batch_dim`` on a Linear's or
            LayerNorm's features is refused. See ``docs/per_example.md``.
        fallback: for modules without a rule: ``"vmap"`` (exact, per-module vmap of a
            vector-Jacobian product), ``"warn"`` (the same, with a warning), ``"error"``.
        unbiased: ``variance`` scaled by ``N/(N-1)``.
        max_memory: bytes a materialized block of per-example gradients may take (> 0).
        chunk_size: examples per materialized block (> 0; overrides ``max_memory``).
        fuse: where a quantity needs the per-example gradients of a Linear (or Hugging Face
            ``Conv1D``) on sequences or of a convolution anyway (variance, second moment,
            moments, batch_grad), take that weight's gradient as their sum instead of
            multiplying again (one product per such layer saved; layers whose product is
            under two million multiply-adds keep autograd's, cheaper there). ``p.grad`` of
            those weights (and of those convolutions' biases) then equals an untracked
            backward's up to float rounding (a sum over examples instead of one product);
            ``fuse=False`` keeps every ``p.grad`` bit-for-bit.

    Returns:
        A :class:`Tracker`; ``stats[name]`` gives :class:`ParamStats`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> model = nn.Linear(3, 2)
        >>> x, y = torch.randn(8, 3), torch.randn(8, 2)
        >>> with gradkit.per_example.track(model, "variance", "batch_l2") as stats:
        ...     nn.functional.mse_loss(model(x), y).backward()
        >>> stats["weight"].variance.shape, stats.batch_l2().shape, stats.num_examples
        (torch.Size([2, 3]), torch.Size([8]), 8)

    Warning:
        ``loss_reduction`` must say what the loss did: a ``"mean"`` loss declared as ``"sum"``
        gives statistics of ``g_i / N``, a ``"sum"`` declared as ``"mean"`` of ``N g_i``.
        Refused where the loss says its reduction; not checkable for a custom loss or a loss
        divided or scaled by hand. All forward calls of a module between two backward passes
        are taken as uses on the same examples (weight tying): run backward after each
        micro-batch's forward (reading statistics while a forward awaits its backward
        raises). A layer that cannot be split by example (one that sees the examples reshaped
        untraceably, ``[T * N, d]``; T5's relative attention bias) raises a
        :class:`GradkitError` rather than return statistics of another number of examples;
        a ``[T, N, d]`` tensor read with ``batch_dim=0`` when ``T == N`` is told from an
        ``[N, T, d]`` one only where the graph shows it (a transpose of a batched layer's
        output: refused, naming the dimension).
    """
    return Tracker(
        model,
        quantities,
        moments=moments,
        loss_reduction=loss_reduction,
        loss_scale=loss_scale,
        batch_dim=batch_dim,
        fallback=fallback,
        unbiased=unbiased,
        max_memory=max_memory,
        chunk_size=chunk_size,
        fuse=fuse,
    )

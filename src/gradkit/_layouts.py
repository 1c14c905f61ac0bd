"""Where a model's layers take their examples: read by the pillars that split a batch into
examples or weigh batches by their examples (:mod:`gradkit.accumulate`,
:mod:`gradkit.curvature`)."""

from __future__ import annotations

from torch import nn

__all__ = ["sequence_first_layer"]


def sequence_first_layer(model: nn.Module) -> str | None:
    """``"name (Class)"`` of the first layer of ``model`` that takes its examples along
    dimension 1 by default: an ``nn.RNN``/``LSTM``/``GRU`` or an ``nn.MultiheadAttention``
    (inside ``nn.Transformer*`` layers too) with ``batch_first=False``; None if there is none."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.RNNBase, nn.MultiheadAttention)) and not m.batch_first:
            return f"{name or 'model'} ({type(m).__name__})"
    return None

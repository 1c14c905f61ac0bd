"""TensorFlow's ConditionalAccumulator semantics on PyTorch, with the traps fixed.

* :class:`ConditionalAccumulator`: dense gradients from many threads; ``take_grad`` waits
  (FIFO) for ``num_required`` and returns the mean (or sum) of all accumulated;
* :class:`SparseConditionalAccumulator`: row-sparse gradients (``(indices, values)`` or sparse
  COO), coalesced on apply; ``"mean"``, TensorFlow's per-row ``"row_mean"`` or ``"sum"``;
  results as :class:`IndexedSlices`;
* :class:`DistributedConditionalAccumulator`: collective takes over a torch.distributed group;
* errors: :class:`TakeTimeout`, :class:`TakeCancelled`, :class:`AccumulatorClosed`.

The modules ``_conditional_*.py`` hold the implementation; this one lists the public names.
"""

from __future__ import annotations

from gradkit.accumulate._conditional_base import AccumulatorClosed, TakeCancelled, TakeTimeout
from gradkit.accumulate._conditional_dense import ConditionalAccumulator
from gradkit.accumulate._conditional_dist import DistributedConditionalAccumulator
from gradkit.accumulate._conditional_sparse import IndexedSlices, SparseConditionalAccumulator

__all__ = [
    "AccumulatorClosed",
    "ConditionalAccumulator",
    "DistributedConditionalAccumulator",
    "IndexedSlices",
    "SparseConditionalAccumulator",
    "TakeCancelled",
    "TakeTimeout",
]

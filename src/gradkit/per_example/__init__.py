"""gradkit.per_example: statistics of individual gradients inside one batched backward pass.

* :func:`track` (context manager) -> :class:`Tracker` -> :class:`ParamStats` per parameter:
  mean, second moment, variance, p-th moments, per-example squared norms and gradients;
* per-layer rules (:func:`register_rule`, looked up along the MRO) for Linear (any leading
  dims), Conv1d/2d/3d, Embedding, EmbeddingBag, LayerNorm, GroupNorm, RMSNorm, and, once
  ``transformers`` is imported, its Conv1D and BART's embeddings; a vmap fallback for the rest
  that re-runs each example in the module's own layout (RNNs, attention, packed sequences);
* :func:`replace_batchnorm`: BatchNorm -> GroupNorm, for models whose BatchNorm mixes examples;
* :func:`release_buffers`: free the CPU storage of ``batch_grad`` kept for the next block;
* derived quantities: :func:`noise_scale`, :func:`gradient_snr`, :func:`cabs_batch_size`.
"""

from gradkit._validate import expose
from gradkit.per_example._batchnorm import replace_batchnorm
from gradkit.per_example._buffers import release_buffers
from gradkit.per_example._derived import cabs_batch_size, gradient_snr, noise_scale
from gradkit.per_example._grads import Materialized, OuterProduct, PerExampleGrad
from gradkit.per_example._registry import RuleContext, Use, find_rule, register_rule
from gradkit.per_example._stats import ParamStats
from gradkit.per_example._track import Tracker, track

__all__ = [
    "Materialized",
    "OuterProduct",
    "ParamStats",
    "PerExampleGrad",
    "RuleContext",
    "Tracker",
    "Use",
    "cabs_batch_size",
    "find_rule",
    "gradient_snr",
    "noise_scale",
    "register_rule",
    "release_buffers",
    "replace_batchnorm",
    "track",
]

expose(globals(), __all__, __name__)

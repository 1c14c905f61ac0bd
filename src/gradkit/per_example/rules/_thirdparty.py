"""Rules for layers of third-party libraries, registered only once their library is loaded.

gradkit never imports these libraries itself (``import gradkit`` must stay light):
:func:`register_available` looks at ``sys.modules`` and registers the rules of the libraries the
user already imported, once.

Index legend: ``n`` example, ``t`` position (every leading dimension after the batch, and the
uses of a shared layer), ``i`` input feature, ``o`` output feature.

``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, ...) is a Linear with a transposed weight
``W[i, o]``:

.. math:: z[n, t, o] = \\sum_i a[n, t, i] W[i, o] + b[o],\\qquad
          g_n(W) = \\sum_t a[n, t]^T G[n, t] \\;\\; [i, o],\\qquad g_n(b) = \\sum_t G[n, t].

:class:`~gradkit.per_example.OuterProduct` gives ``sum_t G'[n, t]^T A'[n, t]`` laid out
``[o', i']``; with the roles exchanged (``A' = G``, ``G' = a``, so ``o' = i`` and ``i' = o``)
that is exactly ``g_n(W)`` in the parameter's ``[i, o]`` layout. Every closed form carries over
unchanged: for one position ``sum_n g_n^p = (a^p)^T (G^p)`` and
``||g_n||^2 = ||a_n||^2 ||G_n||^2``, the Gram form ``<G_n G_n^T, a_n a_n^T>`` is symmetric in the
two factors, and a weight tied between a Linear and a Conv1D concatenates along ``t`` into one
sum of terms that are each in the parameter's layout.

BART's ``BartScaledWordEmbedding`` (``y = c * E[idx]``) and ``BartLearnedPositionalEmbedding``
(rows ``offset + position``, whatever ids it is given) subclass ``nn.Embedding`` but change what
its forward computes: the ``nn.Embedding`` rule would be wrong for them (the gradient misses
``c``; the looked-up rows are not the first argument), so they inherit none and would take the
exact but slow fallback, which materializes ``[N, V, d]``. Their rules rebuild the scale and the
indices and then use the embedding rule (sparse rows).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit.per_example._grads import PerExampleGrad
from gradkit.per_example._registry import Rule, RuleContext, Use, register_rule, registered_rules
from gradkit.per_example.rules._embedding import embedding_rule
from gradkit.per_example.rules._linear import affine_rule

__all__ = [
    "conv1d_rule",
    "learned_positions_rule",
    "register_available",
    "scaled_embedding_rule",
]

logger = logging.getLogger(__name__)

_DONE: set[str] = set()  # libraries whose rules were registered


def conv1d_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``transformers``' ``Conv1D`` (``y = x @ W + b``, ``W[i, o]``).

    ``g_n(W) = sum_t a[n, t]^T G[n, t]`` as an :class:`OuterProduct` with the factors exchanged
    (see the module docstring), ``g_n(b) = sum_t G[n, t]``.

    Args:
        module: the ``Conv1D`` (``weight`` ``[i, o]``, ``bias`` ``[o]``).
        uses: one :class:`Use` per call: input ``[N, *, i]``, output gradient ``[N, *, o]``.
        ctx: the parameters to differentiate.

    Returns:
        ``{"weight": OuterProduct, "bias": Materialized [N, o]}`` (those that require grad).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.per_example import Use, RuleContext
        >>> class T(nn.Module):  # the same computation as transformers' Conv1D
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.randn(3, 2))
        ...         self.bias = nn.Parameter(torch.zeros(2))
        >>> m, x, g = T(), torch.randn(4, 5, 3), torch.randn(4, 5, 2)
        >>> pe = conv1d_rule(m, [Use((x,), g)], RuleContext(dict(m.named_parameters())))
        >>> w = next(pe["weight"].chunks(4))
        >>> w.shape, torch.allclose(w, torch.einsum("nti,nto->nio", x, g))
        (torch.Size([4, 3, 2]), True)
    """
    return affine_rule(uses, ctx, transposed=True)


conv1d_rule.weight_sums = "linear_t"  # type: ignore[attr-defined]  # see _fused
conv1d_rule.leading_dims = True  # type: ignore[attr-defined]  # any leading dimensions


def _scaled(module: nn.Module) -> float:
    scale = getattr(module, "embed_scale", 1.0)
    return float(scale if scale is not None else 1.0)


def scaled_embedding_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of BART's ``BartScaledWordEmbedding``: ``y = c * E[idx]``.

    ``g_n[v] = c * sum_{t: idx[n, t] = v} G[n, t]``: the embedding rule on ``c * G``, with
    ``c = embed_scale``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.per_example import Use, RuleContext
        >>> class Scaled(nn.Embedding):
        ...     embed_scale = 4.0
        >>> m, idx, g = Scaled(5, 2), torch.tensor([[1, 1, 3]]), torch.ones(1, 3, 2)
        >>> ctx = RuleContext(dict(m.named_parameters()))
        >>> pe = scaled_embedding_rule(m, [Use((idx,), g)], ctx)
        >>> next(pe["weight"].chunks(1))[0, :, 0]
        tensor([0., 8., 0., 4., 0.])
    """
    scale = _scaled(module)
    return embedding_rule(
        module, [Use(u.inputs, u.grad_output * scale, u.kwargs) for u in uses], ctx
    )


def _argument(use: Use, position: int, name: str, default: Any) -> Any:
    if len(use.inputs) > position:
        return use.inputs[position]
    return use.kwargs.get(name, default)


def learned_positions_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of BART's ``BartLearnedPositionalEmbedding``.

    Its forward looks up rows ``offset + position_ids`` (``position_ids`` given, or
    ``past .. past + T - 1`` for an input ``[N, T, ...]``), not its first argument, so the indices
    are rebuilt here as the forward builds them, broadcast to the output gradient ``[N, T, d]``,
    and the embedding rule is applied to them.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.per_example import Use, RuleContext
        >>> class Positions(nn.Embedding):
        ...     offset = 2
        >>> m, ids, g = Positions(6, 1), torch.zeros(2, 3), torch.ones(2, 3, 1)
        >>> ctx = RuleContext(dict(m.named_parameters()))
        >>> pe = learned_positions_rule(m, [Use((ids,), g)], ctx)
        >>> next(pe["weight"].chunks(2))[:, :, 0]
        tensor([[0., 0., 1., 1., 1., 0.],
                [0., 0., 1., 1., 1., 0.]])
    """
    offset = int(getattr(module, "offset", 0))
    rebuilt = []
    for u in uses:
        first = _argument(u, 0, "input_ids", None)
        past = _argument(u, 1, "past_key_values_length", 0)
        positions = _argument(u, 2, "position_ids", None)
        if positions is None:
            if not isinstance(first, torch.Tensor) or first.dim() < 2:
                raise GradkitError(
                    message(
                        f"per_example.track: {type(module).__name__}",
                        "input_ids",
                        "a tensor [N, T, ...] (the positions are 0..T-1)",
                        describe(first),
                        "call it as the model does, or register a rule for it",
                    )
                )
            length = first.shape[1]
            positions = torch.arange(past, past + length, device=u.grad_output.device)[None]
        else:
            positions = positions.unsqueeze(0)
        wanted = u.grad_output.shape[:-1]
        try:
            idx = (positions + offset).expand(wanted)
        except RuntimeError as err:
            raise GradkitError(
                message(
                    f"per_example.track: {type(module).__name__}",
                    "position_ids",
                    f"positions that broadcast to the output's {tuple(wanted)}",
                    describe(positions),
                    "register a rule for this use with @gradkit.per_example.register_rule",
                )
            ) from err
        rebuilt.append(Use((idx,), u.grad_output, u.kwargs))
    return embedding_rule(module, rebuilt, ctx)


def _register(cls: type, rule: Rule) -> None:
    """Register ``rule`` for ``cls`` unless a rule (the user's, say) is already there."""
    if cls not in registered_rules():
        register_rule(cls)(rule)


def _register_transformers() -> None:
    from transformers.pytorch_utils import Conv1D

    _register(Conv1D, conv1d_rule)


def _register_bart() -> None:
    from transformers.models.bart import modeling_bart

    _register(modeling_bart.BartScaledWordEmbedding, scaled_embedding_rule)
    _register(modeling_bart.BartLearnedPositionalEmbedding, learned_positions_rule)


# module that must already be imported -> what registers its rules
_LIBRARIES: dict[str, Callable[[], None]] = {
    "transformers": _register_transformers,
    "transformers.models.bart.modeling_bart": _register_bart,
}


def register_available() -> None:
    """Register the rules of every supported third-party module that is already imported.

    Idempotent and cheap: each module is handled once, and one that is not in ``sys.modules`` is
    never imported (a later call picks it up once the user imported it). A class that already
    has a rule keeps it. Supported: ``transformers`` (``pytorch_utils.Conv1D``) and BART
    (``BartScaledWordEmbedding``, ``BartLearnedPositionalEmbedding``: subclasses of
    ``nn.Embedding`` whose forward is not a plain lookup).

    Examples:
        >>> register_available()  # before track(model, ...), once the model is built
        >>> register_available()  # again: nothing new happens
    """
    for name, register in _LIBRARIES.items():
        if name in _DONE or name not in sys.modules:
            continue
        try:
            register()
        except (ImportError, AttributeError) as err:  # an unusual installation: no rule
            logger.debug("per_example: no rules for %s (%s)", name, err)
            continue
        _DONE.add(name)


def unsplittable(parent: nn.Module | None, module: nn.Module) -> str | None:
    """Why the gradient of ``module`` (a child of ``parent``) cannot be split by example, for
    known architectures whose layer looks batched by its shapes but is not; None otherwise.

    T5 and its relatives (``has_relative_attention_bias``) look the relative position bias up on
    ``[q, k]`` buckets shared by all examples, permute it to ``[1, heads, q, k]`` and add it to
    every example's scores: its output has no batch dimension, and when ``q`` equals the number
    of examples its shape would pass for a batch.
    """
    if (
        parent is not None
        and getattr(parent, "has_relative_attention_bias", False)
        and getattr(parent, "relative_attention_bias", None) is module
    ):
        return (
            f"{type(parent).__name__}.relative_attention_bias is looked up on [q, k] relative "
            "position buckets shared by every example and broadcast over the batch after a "
            "permutation, so its gradient arrives summed over the examples and cannot be split"
        )
    return None

r"""``nn.EmbeddingBag``: per-example gradients of bags, without a ``[N, V, d]`` tensor.

Index legend: ``n`` example (= bag), ``j`` entry of the flat input, ``v`` row of the weight,
``k`` feature (``d = embedding_dim``).

Every bag is one example. Bag ``n`` holds the entries ``j`` of the flat input between
``offsets[n]`` and ``offsets[n + 1]`` (the last bag runs to the end of the input; with
``include_last_offset`` the offsets end with the input's length; a 2-D input ``[N, L]`` is
``N`` bags of ``L``; a jagged nested input is one bag per row), except those equal to
``padding_idx``. With ``G = dL / d out`` (``[N, d]``), entry rows
``idx[j]`` and weights ``w[j]`` (``per_sample_weights``, else 1):

.. math::

    \text{sum:}\quad  g_n[v] = \sum_{j \in n,\ idx_j = v} w_j\, G[n]
    \qquad
    \text{mean:}\quad g_n[v] = \frac{1}{c_n} \sum_{j \in n,\ idx_j = v} G[n]
    \qquad
    \text{max:}\quad  g_n[v, k] = G[n, k]\,[v = m_{nk}]

where ``c_n`` is the number of entries of bag ``n`` (padding excluded; an empty bag gives 0)
and ``m_{nk}`` the row whose ``W[v, k]`` is the largest in bag ``n``. ``m`` is taken from
torch's own forward recomputed on the bags (``max_indices`` of ``torch.embedding_bag``), so
ties go where torch sends the gradient. The ``(example, row)`` pairs of all uses are summed
once into sparse rows (:class:`~gradkit.per_example.rules._embedding.EmbeddingGrad`); powers
and norms cost ``O(#pairs * d)``.

Not supported (a :class:`~gradkit.GradkitError` says why): ``max_norm`` (the forward rescales
the weight rows it looks up in place), ``scale_grad_by_freq`` (the batch gradient divides
each row by its count in the whole batch, so it is no sum of per-example gradients), and
entries past the last offset with ``include_last_offset`` (torch's forward ignores them, its
backward does not).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradkit._errors import GradkitError, message
from gradkit.per_example._grads import PerExampleGrad
from gradkit.per_example._registry import RuleContext, Use, register_rule
from gradkit.per_example._stats import statistics_dtype
from gradkit.per_example.rules._embedding import EmbeddingGrad, sum_by_key

_CALL = "per_example.track(model, ...)"
_ARGS = ("input", "offsets", "per_sample_weights")  # EmbeddingBag.forward
_MODE_MAX = 2  # torch.embedding_bag: 0 sum, 1 mean, 2 max


class BagGrad(EmbeddingGrad):
    """Per-example embedding gradients from flat triples ``(example[j], row[j], value[j])``;
    repeated ``(example, row)`` pairs are summed. Same closed forms as :class:`EmbeddingGrad`.

    Args:
        example: ``[J]`` example of each triple.
        row: ``[J]`` row of the weight.
        value: ``[J, d]`` gradient added to that row.
        num_examples: ``N``.
        num_rows: ``V``.
    """

    def __init__(
        self,
        example: torch.Tensor,
        row: torch.Tensor,
        value: torch.Tensor,
        num_examples: int,
        num_rows: int,
    ) -> None:
        d = value.shape[-1]
        self.num_examples, self.shape = num_examples, torch.Size((num_rows, d))
        key, self.rows = sum_by_key(example * num_rows + row, value)
        self.example = key // num_rows
        self.row = key % num_rows


def _who(module: nn.EmbeddingBag) -> str:
    return f"{type(module).__name__}({module.num_embeddings}, {module.embedding_dim})"


def _check_module(module: nn.EmbeddingBag) -> None:
    if module.max_norm is not None:
        raise GradkitError(
            message(
                _CALL,
                f"{_who(module)}.max_norm",
                "None (its forward renormalizes the weight rows it looks up in place, so the "
                "weight the gradients are taken at is not the weight before the forward)",
                repr(module.max_norm),
                "construct the EmbeddingBag with max_norm=None, and renormalize the weight "
                "under torch.no_grad() outside the tracked forward if needed",
            )
        )
    if module.scale_grad_by_freq:
        raise GradkitError(
            message(
                _CALL,
                f"{_who(module)}.scale_grad_by_freq",
                "False (it divides each row's gradient by the row's count in the whole batch, "
                "so the batch gradient is no sum of per-example gradients)",
                "True",
                "construct the EmbeddingBag with scale_grad_by_freq=False",
            )
        )


def _arguments(use: Use) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(input, offsets, per_sample_weights)`` of one call, positional or keyword."""
    bound: dict[str, Any] = dict(zip(_ARGS, use.inputs, strict=False))
    bound.update(use.kwargs)
    psw = bound.get("per_sample_weights")
    return bound["input"], bound.get("offsets"), None if psw is None else psw.detach()


def _flat(
    module: nn.EmbeddingBag, use: Use, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One call as flat entries: ``(idx [J], bag [J], weights [J] or None)``; ``bag`` is
    non-decreasing (``bag[j] = N`` would mark an entry in no bag)."""
    inp, offsets, psw = _arguments(use)
    last = module.include_last_offset
    if inp.is_nested:
        offsets = inp.offsets()  # type: ignore[attr-defined]
        inp, last = inp.values().reshape(-1), True
        psw = None if psw is None else psw.values().reshape(-1)
    elif inp.dim() == 2:
        b, length = inp.shape
        offsets = torch.arange(0, b * length, length, device=inp.device)
        inp, last = inp.reshape(-1), False
        psw = None if psw is None else psw.reshape(-1)
    if offsets is None:  # pragma: no cover - torch's forward refuses it first
        raise GradkitError(f"{_CALL}: {_who(module)} was called on a 1-D input without offsets")
    offsets = offsets.long()
    bags = offsets.numel() - 1 if last else offsets.numel()
    if last and bags >= 0 and int(offsets[-1]) != inp.numel():
        raise GradkitError(
            message(
                _CALL,
                f"offsets of {_who(module)} (include_last_offset=True)",
                f"offsets[-1] == {inp.numel()} (the input's length, as torch requires: its "
                "backward does not ignore entries past the last offset the way its forward does)",
                f"offsets[-1] == {int(offsets[-1])}",
                "end the offsets with the input's length, or drop the trailing entries",
            )
        )
    if bags != n:
        raise GradkitError(
            message(
                _CALL,
                "batch_dim",
                f"0 for {_who(module)} (its output is [bags, embedding_dim])",
                f"an output gradient with {n} examples for {bags} bags",
                "track EmbeddingBag models with batch_dim=0",
            )
        )
    j = torch.arange(inp.numel(), device=inp.device)
    bag = torch.searchsorted(offsets, j, right=True) - 1
    return inp.long(), bag.clamp_(min=0, max=n), psw


@register_rule(nn.EmbeddingBag)
def embedding_bag_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.EmbeddingBag``, one example per bag.

    ``g_n = sum_{j in bag n} w_j G[n]`` on row ``idx_j`` (``1 / c_n`` for mean, the arg-max row
    per feature for max; see the module docstring), summed over the module's uses.

    Args:
        module: the ``nn.EmbeddingBag``.
        uses: its calls, ``forward(input, offsets=None, per_sample_weights=None)`` with
            arguments positional or keyword; ``grad_output`` is ``[N, d]``.
        ctx: the parameters to differentiate (``weight``).

    Returns:
        ``{"weight": BagGrad}`` with ``N`` examples of shape ``[num_embeddings, d]``.

    Raises:
        GradkitError: ``max_norm`` or ``scale_grad_by_freq`` set; with
            ``include_last_offset``, offsets that do not end with the input's length; a number
            of bags or an output gradient that is not ``[N, d]`` (``batch_dim != 0``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> bag = nn.EmbeddingBag(6, 2, mode="mean")
        >>> idx, offsets = torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2])
        >>> with gradkit.per_example.track(bag, "batch_grad", loss_reduction="sum") as stats:
        ...     bag(idx, offsets).sum().backward()
        >>> stats["weight"].batch_grad[1]  # bag 1 = rows 4, 5, 4: weights 2/3, 1/3
        tensor([[0.0000, 0.0000],
                [0.0000, 0.0000],
                [0.0000, 0.0000],
                [0.0000, 0.0000],
                [0.6667, 0.6667],
                [0.3333, 0.3333]])
    """
    if not isinstance(module, nn.EmbeddingBag):  # pragma: no cover - the registry's promise
        raise GradkitError(f"embedding_bag_rule: expected nn.EmbeddingBag, got {module!r}")
    _check_module(module)
    n = uses[0].grad_output.shape[0]
    v, pad = module.num_embeddings, module.padding_idx
    weight = ctx.params["weight"].detach()
    examples, rows, values = [], [], []
    for use in uses:
        idx, bag, psw = _flat(module, use, n)
        g = use.grad_output
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (n, module.embedding_dim):
            raise GradkitError(
                message(
                    f"{_CALL}: the rule for {_who(module)}",
                    "grad_output",
                    f"the gradient of its output [bags, embedding_dim] = [{n}, "
                    f"{module.embedding_dim}]",
                    g,
                    "track the EmbeddingBag with its own output (batch_dim=0, one bag per "
                    "example); report this if the tracker reshaped it",
                )
            )
        g = g.to(statistics_dtype(g.dtype))
        keep = bag < n
        if pad is not None:
            keep &= idx != pad
        idx, bag = idx[keep], bag[keep]
        if module.mode == "max":
            # torch's forward again on the kept entries (bag order, so ties fall as in the
            # user's call): max_indices [N, d] is the row each bag's feature came from
            starts = torch.searchsorted(bag, torch.arange(n, device=bag.device))
            picked = torch.embedding_bag(weight, idx, starts, False, _MODE_MAX)[3]
            pair = torch.unique(bag * v + idx)
            pbag, prow = pair // v, pair % v
            examples.append(pbag)
            rows.append(prow)
            values.append(g[pbag] * (picked[pbag] == prow[:, None]))
            continue
        value = g[bag]
        if psw is not None:
            value = value * psw[keep].to(value.dtype)[:, None]
        if module.mode == "mean":
            count = torch.zeros(n, dtype=value.dtype, device=value.device)
            count.index_add_(0, bag, torch.ones_like(bag, dtype=value.dtype))
            value = value / count[bag][:, None]
        examples.append(bag)
        rows.append(idx)
        values.append(value)
    return {"weight": BagGrad(torch.cat(examples), torch.cat(rows), torch.cat(values), n, v)}

r"""What the mean of torch's classification losses divides by, so that batches can be weighed.

A mean loss on batch ``b`` is ``L_b = S_b / Z_b``: a sum ``S_b`` of per-target terms over a
divisor ``Z_b``. Over several batches the loss of one big batch is

.. math:: L = \frac{\sum_b S_b}{\sum_b Z_b} = \sum_b \frac{Z_b}{Z}\, L_b,

so weighing batch ``b`` by ``Z_b / Z`` gives exactly the big batch's Hessian, GGN and Fisher,
whatever ``Z_b`` is. ``Z_b = n_b`` for a mean over the examples, but ``nn.CrossEntropyLoss`` and
``nn.NLLLoss`` divide by what their targets say (torch's ``nll_loss`` and
``cross_entropy``; checked numerically by the tests):

* class-index targets ``[N, *]``: the sum of the class weights of the targets not equal to
  ``ignore_index`` (their number without ``weight``), for every target dimension; label
  smoothing's term divides by the same sum and is 0 at ignored targets;
* class probabilities (floating targets shaped like the input ``[N, C, *]``): the number of
  targets, ``numel / C``, whatever the weights and the smoothing.

Only losses that compute what torch's classes or functions compute are read (a subclass that
overrides ``forward``, a lambda or any other function is opaque: its mean is taken to be over
the examples of the batch).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TargetLoss", "divisor", "ignored", "target_loss"]

_FUNCTIONS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
_KEYWORDS = {"weight", "ignore_index", "label_smoothing", "reduction"}


class TargetLoss(NamedTuple):
    """How a torch classification loss reads its targets.

    Attributes:
        weight: the class weights ``[C]``, or None.
        ignore_index: the target value that does not count.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    weight: torch.Tensor | None
    ignore_index: int
    reduction: str


def target_loss(loss_fn: Any) -> TargetLoss | None:
    """The target options of ``nn.CrossEntropyLoss``/``nn.NLLLoss`` (not a subclass overriding
    ``forward``), ``F.cross_entropy``/``F.nll_loss`` or a ``functools.partial`` of those with
    keywords only; None for any other loss."""
    for cls in (nn.CrossEntropyLoss, nn.NLLLoss):
        if isinstance(loss_fn, cls) and type(loss_fn).forward is cls.forward:
            return TargetLoss(loss_fn.weight, int(loss_fn.ignore_index), str(loss_fn.reduction))
    func, keywords = loss_fn, {}
    if isinstance(loss_fn, functools.partial):
        if loss_fn.args or not set(loss_fn.keywords) <= _KEYWORDS:
            return None
        func, keywords = loss_fn.func, loss_fn.keywords
    if not any(func is f for f in _FUNCTIONS):
        return None
    weight = keywords.get("weight")
    return TargetLoss(
        weight if isinstance(weight, torch.Tensor) else None,
        int(keywords.get("ignore_index", -100)),
        str(keywords.get("reduction", "mean")),
    )


def ignored(spec: TargetLoss, targets: torch.Tensor) -> torch.Tensor | None:
    """``targets == ignore_index`` (bool, shaped like ``targets``) for class-index targets, None
    for class probabilities (nothing is ignored). No host sync."""
    if targets.is_floating_point():
        return None
    return targets == spec.ignore_index


def divisor(spec: TargetLoss, targets: torch.Tensor) -> torch.Tensor:
    """``Z_b``, what the mean of the loss divides by on a batch with ``targets`` (a 0-dim
    float64 tensor on the targets' device; no host sync). 0 when every target is ignored or of
    class weight 0 (the loss is then nan)."""
    if targets.is_floating_point():  # class probabilities [N, C, *]
        classes = targets.shape[1] if targets.dim() > 1 else 1
        count = targets.numel() / max(classes, 1)
        return torch.tensor(count, dtype=torch.float64, device=targets.device)
    keep = targets != spec.ignore_index
    if spec.weight is None:
        return keep.sum().to(torch.float64)
    w = spec.weight.detach().to(device=targets.device, dtype=torch.float64)
    index = targets.masked_fill(~keep, 0).clamp(0, w.numel() - 1)  # out of range: torch raises
    return torch.where(keep, w[index], 0.0).sum()

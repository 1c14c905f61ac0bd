"""How a torch loss reduced over its rows, read from the nodes it leaves at the top of the
backward graph.

A loss says its reduction in one of two ways:

* a node that saves it: ``_saved_reduction`` of ``NllLossBackward0`` (``cross_entropy`` with
  class indices), ``MseLossBackward0``, ``SmoothL1LossBackward0``, ...; a full ``mean()`` or
  ``sum()`` of such a loss with ``reduction='none'``;
* the exact chain of nodes a loss written out in torch builds (``F.l1_loss``, ``F.kl_div``,
  ``F.cross_entropy`` with class probabilities or label smoothing, ...), matched node by node
  from its reduction down to its per-element terms.

Only what a node keeps after it has run is read (its integer and scalar attributes, the
sizes it saved, which inputs need a gradient): the check runs inside the backward pass, once
the loss's nodes have freed their saved tensors, so a tensor (a target, a class weight, the
divisor of a ``/ k``) is never compared. Hence what stays unmatched:

* a division by a number written in Python (``sum / k``, and ``F.kl_div(...,
  reduction='batchmean')``, which is ``sum / input.size(0)``): ``k`` equal to the number of
  examples by chance (gradient accumulation over as many micro-batches) is a sum declared with
  ``loss_scale``, which must not be refused. The mean of ``F.cross_entropy`` with class
  probabilities divides inside torch (``DivBackward1``, a C++ scalar), which Python cannot
  build;
* the ``sum`` of a chain whose per-element terms a user's constant could have divided by the
  batch size (``(losses / batch_size).sum()`` makes a mean): only chains with no room for
  one are matched as sums (the ``/ C`` of ``multilabel_soft_margin_loss`` has that room, so
  only its mean is matched).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from gradkit._autograd import signed

__all__ = ["LossMatch", "match_loss"]

_REDUCTIONS = {1: "mean", 2: "sum"}  # at::Reduction: 0 none, 1 mean, 2 sum
_NLL = ("NllLossBackward0", "NllLoss2DBackward0")


class LossMatch(NamedTuple):
    """A loss found at a node: its ``label`` for messages, its ``reduction`` (``"mean"`` or
    ``"sum"``) over ``rows`` (its input's first dimension: the examples, or tokens; an NLL
    loss's targets, ``N d1 ...`` of a ``[N, C, d1, ...]`` input), and whether
    the mean is ``weighted`` by class weights (each example's share is ``w[y_i] / sum(w[y])``,
    not ``1 / N``)."""

    label: str
    reduction: str
    rows: int | None
    weighted: bool = False


def _name(node: Any) -> str:
    return type(node).__name__ if node is not None else "None"


def _kids(node: Any) -> list[Any]:
    """The nodes below ``node`` in order, ``None`` for an input that needs no gradient."""
    return [n for n, _ in node.next_functions]


def _is(node: Any, name: str, *kids: str) -> bool:
    """``node`` is a ``name`` node whose inputs are ``kids`` (``"*"``: any node, ``"None"``: an
    input without gradient), or any inputs where ``kids`` is empty."""
    if _name(node) != name:
        return False
    if not kids:
        return True
    below = _kids(node)
    return len(below) == len(kids) and all(
        (k == "*" and n is not None) or _name(n) == k for n, k in zip(below, kids, strict=True)
    )


def _plain(node: Any) -> bool:
    """``node`` adds or subtracts its inputs unscaled (``alpha=1``)."""
    return getattr(node, "_saved_alpha", 1) == 1


def _sizes(node: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(node, "_saved_self_sym_sizes", ()))


def _input_rows(node: Any, *, classes_in_dim1: bool = False) -> int | None:
    """The first dimension of the tensor ``node``'s first input had in the forward; with
    ``classes_in_dim1`` (an NLL loss on ``[N, C, d1, ...]``, whose mean is over its ``N d1 ...``
    targets), the number of its targets."""
    try:
        nxt, k = node.next_functions[0]
        shape = list(nxt._input_metadata[k].shape)
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None
    if len(shape) < 2:
        return None
    if classes_in_dim1:
        return int(shape[0]) * math.prod(int(s) for s in shape[2:])
    return int(shape[0])


def _class_weighted(node: Any) -> bool:
    """An NLL node was given class weights: a freed weight raises, an absent one reads None."""
    try:
        return node._saved_weight is not None
    except RuntimeError:
        return True


def _saved(node: Any) -> LossMatch | None:
    """A torch loss node that saved its reduction; an NLL mean says if it was class-weighted."""
    saved = getattr(node, "_saved_reduction", None)
    if not isinstance(saved, int) or saved not in _REDUCTIONS:
        return None
    name, reduction = _name(node), _REDUCTIONS[saved]
    weighted = name in _NLL and reduction == "mean" and _class_weighted(node)
    label = f"{name} (reduction='{reduction}'{', weight=...' if weighted else ''})"
    return LossMatch(label, reduction, _input_rows(node, classes_in_dim1=name in _NLL), weighted)


# -- per-element chains under a full mean()/sum(): (torch function, also matched as a sum) ------


def _l1(b: Any) -> bool:  # |input - target|
    return _is(b, "AbsBackward0", "SubBackward0") and _plain(_kids(b)[0])


def _kl(b: Any) -> bool:
    # xlogy(target, target) - target * input; log_target: exp(target) * (target - input)
    if _is(b, "SubBackward0", "None", "MulBackward0") and _plain(b):
        return _is(_kids(b)[1], "MulBackward0", "None", "*")
    if _is(b, "MulBackward0", "None", "SubBackward0"):
        sub = _kids(b)[1]
        return _is(sub, "SubBackward0", "None", "*") and _plain(sub)
    return False


def _gaussian_nll(b: Any) -> bool:
    # 0.5 * (log(var) + (input - target)**2 / var), then + 0.5 * log(2 pi) if full
    if _is(b, "AddBackward0", "MulBackward0", "None") and _plain(b):
        b = _kids(b)[0]
    if not _is(b, "MulBackward0", "AddBackward0", "None"):
        return False
    add = _kids(b)[0]
    if not (_plain(add) and len(_kids(add)) == 2):
        return False
    log, div = _kids(add)
    if not (log is None or _name(log) == "LogBackward0") or _name(div) != "DivBackward0":
        return False
    pow_ = _kids(div)[0]
    return (
        _is(pow_, "PowBackward0", "SubBackward0")
        and getattr(pow_, "_saved_exponent", None) == 2
        and _plain(_kids(pow_)[0])
    )


def _poisson_nll(b: Any) -> bool:
    # log_input: exp(input) - target * input; else input - target * log(input + eps); full:
    # + a Stirling term of the target
    if _is(b, "AddBackward0", "SubBackward0", "None") and _plain(b):
        b = _kids(b)[0]
    if not (_is(b, "SubBackward0", "*", "MulBackward0") and _plain(b)):
        return False
    first, mul = _kids(b)
    if not _is(mul, "MulBackward0", "None", "*"):
        return False
    x = _kids(mul)[1]
    if _is(first, "ExpBackward0", "*") and _kids(first)[0] is x:  # exp(input), input
        return True
    # input, log(input + eps)
    if not (_is(x, "LogBackward0", "AddBackward1") and _is(_kids(x)[0], "AddBackward1", "*")):
        return False
    return _kids(_kids(x)[0])[0] is first


def _multilabel_soft_margin(b: Any) -> bool:
    # -(target * logsigmoid(input) + (1 - target) * logsigmoid(-input)) [* weight], summed over
    # the classes (the last dimension) / C
    if not _is(b, "DivBackward0", "SumBackward1", "None"):
        return False
    total = _kids(b)[0]
    last = len(_sizes(total)) - 1
    if tuple(getattr(total, "_saved_dim", ())) != (last,) or total._saved_keepdim:
        return False
    neg = _kids(total)[0]
    if _is(neg, "MulBackward0", "NegBackward0", "None"):
        neg = _kids(neg)[0]
    if not _is(neg, "NegBackward0", "AddBackward0"):
        return False
    add = _kids(neg)[0]
    return _is(add, "AddBackward0", "MulBackward0", "MulBackward0") and all(
        _is(m, "MulBackward0", "None", "LogSigmoidBackward0") for m in _kids(add)
    )


def _cosine_embedding(b: Any) -> bool:
    # where(target == 1, 1 - cos, 0) + where(target == -1, clamp_min(cos - margin, 0), 0)
    if not (_is(b, "AddBackward0", "WhereBackward0", "WhereBackward0") and _plain(b)):
        return False
    pos, neg = _kids(b)
    return (
        _is(pos, "WhereBackward0", "SubBackward0", "None")
        and _is(neg, "WhereBackward0", "ClampMinBackward0", "None")
        and _is(_kids(neg)[0], "ClampMinBackward0", "SubBackward1")
    )


_CHAINS: list[tuple[str, Callable[[Any], bool], bool]] = [
    ("l1_loss", _l1, True),
    ("kl_div", _kl, True),
    ("gaussian_nll_loss", _gaussian_nll, True),
    ("poisson_nll_loss", _poisson_nll, True),
    ("cosine_embedding_loss", _cosine_embedding, True),
    ("multilabel_soft_margin_loss", _multilabel_soft_margin, False),
]


def _per_row(node: Any) -> Any:
    """Below sums and means over dimensions other than 0 (``.sum(1)``, ``.mean((1, 2))``: a
    loss's terms reduced within each row), the node they reduce; None where there are none, or
    one reduces dimension 0 too."""
    start = node
    while _name(node) in ("SumBackward1", "MeanBackward1"):
        rank, dims = len(_sizes(node)), getattr(node, "_saved_dim", None)
        if not rank or not dims or len(_kids(node)) != 1:
            return None
        if any(signed(d) % rank == 0 for d in dims):
            return None  # a reduction over the rows too
        (node,) = _kids(node)
    return None if node is start else node


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def _unviewed(node: Any) -> Any:
    """Below views and reshapes, the node whose output they show: a loss's per-element terms
    (``reduction='none'``) are the same terms however they are shaped (``cross_entropy`` on
    ``[N, C, T]`` views its ``[N, 1, T]`` terms as ``[N, T]``; a loss over flattened tokens
    ``[N * T]`` is viewed back as ``[N, T]``), and the reductions above them decide."""
    while _name(node) in _VIEWS and len(_kids(node)) == 1:
        (node,) = _kids(node)
    return node


def _chain(node: Any, kind: str) -> LossMatch | None:
    """A full ``mean()``/``sum()`` (``node``) of the per-element terms of a torch loss."""
    sizes = _sizes(node)
    rows = sizes[0] if sizes else None
    (body,) = _kids(node)
    terms = _unviewed(body)
    if terms is not None and getattr(terms, "_saved_reduction", None) == 0:
        return LossMatch(f"{_name(terms)} (reduction='none') then {_name(node)}", kind, rows)
    terms = _unviewed(_per_row(body))  # None stays None
    if terms is not None and getattr(terms, "_saved_reduction", None) == 0:
        # .sum(1).mean(): the terms reduced within each row first; the rows' reduction decides
        return LossMatch(
            f"{_name(terms)} (reduction='none'), reduced within each row, then {_name(node)}",
            kind,
            rows,
        )
    for fn, matches, as_sum in _CHAINS:
        if (kind == "mean" or as_sum) and matches(body):
            label = f"{_name(node)} of {_name(body)} (F.{fn}(..., reduction='{kind}'))"
            return LossMatch(label, kind, rows)
    return None


# -- cross entropy: class probabilities, label smoothing ----------------------------------------


def _soft_targets(neg: Any, weighted: bool) -> tuple[int, ...] | None:
    """The sizes ``[N, C, *]`` of ``-(log_softmax(input, 1) * target [* weight]).sum()``
    (``cross_entropy`` with class probabilities) ending in ``neg``; None if it is not one."""
    if not _is(neg, "NegBackward0", "SumBackward0"):
        return None
    total = _kids(neg)[0]
    sizes = _sizes(total)
    mul = _kids(total)[0]
    if weighted and _is(mul, "MulBackward0", "MulBackward0", "None"):
        mul = _kids(mul)[0]
    if len(sizes) < 2 or not _is(mul, "MulBackward0", "LogSoftmaxBackward0", "None"):
        return None
    return sizes if getattr(_kids(mul)[0], "_saved_dim", None) == 1 else None


def _cross_entropy_probs(node: Any) -> LossMatch | None:
    name = _name(node)
    if name == "NegBackward0":  # reduction='sum' (unweighted: a weight could hold a 1/N)
        sizes = _soft_targets(node, weighted=False)
        kind = "sum"
    elif _is(node, "DivBackward1", "NegBackward0"):  # mean: / (numel / C), a C++ scalar
        sizes = _soft_targets(_kids(node)[0], weighted=True)
        if sizes is None or getattr(node, "_saved_other", None) != math.prod(sizes) // sizes[1]:
            return None
        kind = "mean"
    else:
        return None
    if sizes is None:
        return None
    label = f"{name} of LogSoftmaxBackward0 (F.cross_entropy with class probabilities, "
    return LossMatch(label + f"reduction='{kind}')", kind, sizes[0])


def _label_smoothing(node: Any) -> LossMatch | None:
    """``(1 - eps) * nll + eps / C * smoothing`` of ``cross_entropy(label_smoothing=eps)`` with
    class indices: the NLL's reduction, which the smoothing term shares."""
    if not (_is(node, "AddBackward0", "MulBackward1", "MulBackward1") and _plain(node)):
        return None
    scaled_nll, scaled_smooth = _kids(node)
    nll = _kids(scaled_nll)[0]
    found = _saved(nll) if _name(nll) in _NLL else None
    if found is None:
        return None
    smooth = _kids(scaled_smooth)[0]
    divided = _is(smooth, "DivBackward0", "SumBackward0", "None")  # mean: / the total weight
    if divided:
        smooth = _kids(smooth)[0]
    if divided != (found.reduction == "mean") or not _is(
        smooth, "SumBackward0", "MaskedFillBackward0"
    ):
        return None
    neg = _kids(_kids(smooth)[0])[0]
    if not _is(neg, "NegBackward0", "SumBackward1"):
        return None
    sizes = _sizes(_kids(neg)[0])
    keep, share = scaled_nll._saved_other, scaled_smooth._saved_other
    if len(sizes) < 2 or not math.isclose(keep + share * sizes[1], 1.0, rel_tol=1e-6):
        return None
    label = found.label.replace(")", f", label_smoothing={1 - keep:.3g})", 1)
    return found._replace(label=label)


def match_loss(node: Any) -> LossMatch | None:
    """The torch loss ``node`` (a graph node at the top of a backward pass) ends, if any; a
    node whose attributes differ from what torch 2.x saves (another torch) matches nothing."""
    try:
        return _match(node)
    except (AttributeError, IndexError, RuntimeError, TypeError, ValueError):
        return None


def _match(node: Any) -> LossMatch | None:
    found = _saved(node)
    if found is not None:
        return found
    name = _name(node)
    if name in ("MeanBackward0", "SumBackward0") and len(_kids(node)) == 1:
        return _chain(node, "mean" if name.startswith("Mean") else "sum")
    if name == "AddBackward0":
        return _label_smoothing(node)
    return _cross_entropy_probs(node)

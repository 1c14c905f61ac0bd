"""Where the examples are in each tensor of a module call.

The batch dimension of every argument and output comes from the module's documented layout,
never from a size that happens to match the number of examples (an LSTM's state
``[layers * directions, N, H]`` has ``N`` in dimension 1 whatever ``batch_first`` says, and a
layer count of 2 over a micro-batch of 2 examples is no batch dimension):

* ``nn.RNN``/``nn.GRU``/``nn.LSTM``: input and output ``0`` if ``batch_first`` else ``1``; the
  states ``h``/``c`` in ``1``; a ``PackedSequence`` has no batch dimension (its examples are
  found through its ``batch_sizes``);
* ``nn.MultiheadAttention``: query, key, value and the output ``0`` if ``batch_first`` else
  ``1``; ``key_padding_mask`` and the attention weights ``0``; a 2-D ``attn_mask`` is shared by
  all examples;
* ``nn.EmbeddingBag``: the output ``0``; a 2-D input and its ``per_sample_weights`` ``0``; a flat
  input with ``offsets`` (or a nested one) has no batch dimension (the bags are the examples);
* ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose*`` and ``nn.GroupNorm`` on a batched input
  ``[N, C, *spatial]``: ``0`` (the only place these layers accept a batch);
* a module inside a ``torch.nn`` transformer block (``TransformerEncoderLayer``,
  ``TransformerDecoderLayer``, their stacks, ``Transformer``): ``0`` if the block is
  ``batch_first`` else ``1`` (its Linear and LayerNorm layers see ``[T, N, E]``);
* every other module: ``batch_dim`` (``track``'s argument; a mapping gives it per submodule)
  for every tensor with more dimensions than that.

A ``batch_dim`` that names a dimension a layer reads as features (the last dimension of a
Linear's input, the normalized dimensions of a LayerNorm) is refused at the forward call
(:func:`check_feature_dims`): split there, the statistics would be those of another quantity.
Sizes alone cannot tell a ``[T, N, d]`` tensor from an ``[N, T, d]`` one when ``T == N``; the
graph sometimes can (:func:`._batch.moved_batch`).
"""

from __future__ import annotations

import numbers
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from gradkit._autograd import signed
from gradkit._errors import GradkitError, message
from gradkit._validate import check_int
from gradkit.per_example._flat import leaves as flat_leaves
from gradkit.per_example._loss_graph import match_loss

__all__ = [
    "CallLayout",
    "LossReduction",
    "backward_roots",
    "call_layout",
    "check_feature_dims",
    "check_loss_reduction",
    "inner_batch_dims",
    "loss_reductions",
    "parse_batch_dim",
    "reaches",
]


@dataclass
class CallLayout:
    """The batch dimension of each leaf of one module call, as flat lists aligned with
    ``flatten((args, kwargs))`` and ``flatten(output)``: an ``int``, or ``None`` for
    a leaf shared by every example (or not a tensor)."""

    inputs: list[int | None]
    output: list[int | None]


def _dims(value: Any, dim: int | None) -> list[int | None]:
    """``dim`` for every tensor leaf of ``value`` with more dimensions than ``dim``."""
    if isinstance(value, PackedSequence):  # no batch dimension: see batch_sizes
        return [None] * 4
    if isinstance(value, (tuple, list)) and any(isinstance(v, PackedSequence) for v in value):
        return [d for v in value for d in _dims(v, dim)]
    return [
        dim if dim is not None and isinstance(t, torch.Tensor) and t.dim() > dim else None
        for t in flat_leaves(value)
    ]


def _call(
    args: tuple[Any, ...], kwargs: dict[str, Any], dim_of: Callable[[int | str, Any], Any]
) -> list[int | None]:
    dims = [d for k, a in enumerate(args) for d in dim_of(k, a)]
    return dims + [d for k, v in kwargs.items() for d in dim_of(k, v)]


def _rnn(
    module: nn.RNNBase, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> CallLayout:
    x = args[0] if args else kwargs.get("input")
    batched = isinstance(x, PackedSequence) or (isinstance(x, torch.Tensor) and x.dim() == 3)
    seq = (0 if module.batch_first else 1) if batched else None  # unbatched: one example
    state = 1 if batched else None
    inputs = _call(args, kwargs, lambda k, v: _dims(v, seq if k in (0, "input") else state))
    out, hidden = output
    return CallLayout(inputs, _dims(out, seq) + _dims(hidden, state))


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _attention(
    module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> CallLayout:
    query = args[0] if args else kwargs.get("query")
    batched = isinstance(query, torch.Tensor) and query.dim() == 3
    seq = (0 if module.batch_first else 1) if batched else None

    def dim_of(key: int | str, value: Any) -> list[int | None]:
        name = _MHA_ARGS[key] if isinstance(key, int) and key < len(_MHA_ARGS) else key
        if name in ("query", "key", "value"):
            return _dims(value, seq)
        if name == "key_padding_mask":
            return _dims(value, 0 if batched else None)
        if name == "attn_mask" and isinstance(value, torch.Tensor) and value.dim() == 3:
            raise GradkitError(
                "per_example.track: nn.MultiheadAttention called with a 3-D attn_mask "
                f"{tuple(value.shape)} ([N * num_heads, L, S]); per-example gradients need the "
                "examples separable: pass a 2-D attn_mask shared by all examples and the "
                "per-example padding as key_padding_mask [N, S]"
            )
        return _dims(value, None)  # shared (a 2-D attn_mask) or not a tensor

    out, weights = output
    return CallLayout(
        _call(args, kwargs, dim_of), _dims(out, seq) + _dims(weights, 0 if batched else None)
    )


_BAG_ARGS = ("input", "offsets", "per_sample_weights")


def _bag(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> CallLayout:
    x = args[0] if args else kwargs.get("input")
    rows = 0 if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_nested else None

    def dim_of(key: int | str, value: Any) -> list[int | None]:
        name = _BAG_ARGS[key] if isinstance(key, int) and key < len(_BAG_ARGS) else key
        return _dims(value, rows if name in ("input", "per_sample_weights") else None)

    return CallLayout(_call(args, kwargs, dim_of), _dims(output, 0))


def _channels_first(module: nn.Module, args: tuple[Any, ...]) -> bool:
    """A convolution or GroupNorm called on a batched ``[N, C, *spatial]`` input."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return False
    if isinstance(module, nn.modules.conv._ConvNd):
        return x.dim() == module.weight.dim()  # unbatched: [C, *spatial]
    return isinstance(module, nn.GroupNorm) and x.dim() >= 2


def call_layout(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, batch_dim: int
) -> CallLayout:
    """The batch dimension of every argument and output of ``module(*args, **kwargs)``."""
    if isinstance(module, nn.RNNBase):
        return _rnn(module, args, kwargs, output)
    if isinstance(module, nn.MultiheadAttention):
        return _attention(module, args, kwargs, output)
    if isinstance(module, nn.EmbeddingBag):
        return _bag(args, kwargs, output)
    if batch_dim != 0 and _channels_first(module, args):
        batch_dim = 0
    if len(args) == 1 and not kwargs and type(output) is torch.Tensor:  # the usual call
        x = args[0]
        if type(x) is torch.Tensor:
            return CallLayout(
                [batch_dim if x.dim() > batch_dim else None],
                [batch_dim if output.dim() > batch_dim else None],
            )
    return CallLayout(_dims((args, kwargs), batch_dim), _dims(output, batch_dim))


_RMS_NORM: tuple[type, ...] = (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()


def _feature_dims(module: nn.Module) -> int | None:
    """How many trailing dimensions of the module's first input are features."""
    if isinstance(module, nn.Linear):
        return 1
    if isinstance(module, (nn.LayerNorm, *_RMS_NORM)):
        return len(tuple(module.normalized_shape))  # type: ignore[arg-type]
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' Conv1D
        return 1
    if isinstance(module, nn.modules.conv._ConvNd):  # channels and positions
        return len(module.kernel_size) + 1
    return None


def check_feature_dims(
    name: str, module: nn.Module, args: tuple[Any, ...], layout: CallLayout, batch_dim: int
) -> None:
    """Refuse a batch dimension that falls on the features of a Linear (or ``Conv1D``),
    LayerNorm or RMSNorm input: ``batch_dim=1`` on a batch-first ``[N, d]`` input would split
    the examples along the ``d`` input features (and, when ``d == N``, silently so)."""
    features = _feature_dims(module)
    x = args[0] if args else None
    if features is None or not isinstance(x, torch.Tensor) or not layout.inputs:
        return
    dim = layout.inputs[0]
    if dim is None or dim < x.dim() - features:
        return
    label = f"{name or 'model'} ({type(module).__name__})"
    first = x.dim() - features
    where = f"one of its dimensions 0..{first - 1}" if first > 0 else "a batch dimension"
    fix = (
        "pass the dimension where the examples are (batch_dim=0 for batch-first data; "
        "RNNs, attention, convolutions and torch.nn transformer blocks are read by their "
        "own layout whatever batch_dim says); where layers see the examples in different "
        "dimensions, give it per submodule, e.g. batch_dim={'': 1, "
        f"'{name or 'head'}': 0}}"
    )
    if first == 0:  # features alone: one input shared by every example, not a batch
        fix = (
            "give the input a batch dimension of 1 where the model calls the layer "
            "(z.unsqueeze(0): a [1, ...] output is broadcast over the examples, exactly), or "
            f"freeze the layer ({name or 'model'}.requires_grad_(False)) to track the rest"
        )
    raise GradkitError(
        message(
            "per_example.track(model, ...)",
            "batch_dim",
            f"the examples of {label}'s input {tuple(x.shape)} in {where} (its last {features} "
            "dimension(s) are features)",
            f"batch_dim={batch_dim}, its dimension {dim}: {x.shape[dim]} features taken for "
            "examples",
            fix,
        )
    )


def _block_batch_first(module: nn.Module) -> bool | None:
    """``batch_first`` of a torch.nn transformer block, None for any other module."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return bool(module.self_attn.batch_first)
    if isinstance(module, nn.Transformer):
        return bool(module.batch_first)
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(module.layers):
        return _block_batch_first(module.layers[0])
    return None


def parse_batch_dim(
    batch_dim: Any, modules: Mapping[str, nn.Module], call: str
) -> tuple[int, dict[str, int]]:
    """Check ``track``'s ``batch_dim`` (an int, or a mapping from submodule names to ints,
    ``""`` for the model's inputs): ``(the model's, per named submodule)``."""
    fix = "pass the index of the batch dimension, e.g. batch_dim=1 for [T, N, ...] inputs"
    items = dict(batch_dim) if isinstance(batch_dim, Mapping) else {"": batch_dim}
    for name, dim in items.items():
        argument = "batch_dim" if not isinstance(batch_dim, Mapping) else f"batch_dim[{name!r}]"
        check_int(dim, call, argument, low=0, fix=fix)
        if name not in modules:
            known = [k for k in modules if k][:8]
            raise ValueError(
                message(
                    call,
                    "batch_dim",
                    f"keys naming submodules of the model ('' for the model's inputs), such as "
                    f"{known}",
                    repr(name),
                    "use the names of model.named_modules()",
                )
            )
    return items.get("", 0), {k: v for k, v in items.items() if k}


def inner_batch_dims(
    modules: dict[str, nn.Module], batch_dim: int, given: Mapping[str, int] | None = None
) -> dict[str, int]:
    """The batch dimension of the tensors each module (by name, as ``named_modules()``) sees:
    ``given[name]`` if the caller named it, else that of the nearest enclosing torch.nn
    transformer block or named module, else ``batch_dim``."""
    given = given or {}
    dims: dict[str, int] = {}
    for name, module in modules.items():  # parents come before their children
        first = _block_batch_first(module)
        if name in given:
            dims[name] = given[name]
        elif first is not None:
            dims[name] = 0 if first else 1
        elif name:
            dims[name] = dims.get(name.rpartition(".")[0], batch_dim)
        else:
            dims[name] = batch_dim
    return dims


# -- the loss of a backward pass ------------------------------------------------------------------


@dataclass
class LossReduction:
    """A reduction found at the top of a backward pass's graph: ``node`` (e.g.
    ``NllLossBackward0``) reduced its ``rows`` (its input's first dimension: the examples, or
    tokens) by ``reduction``."""

    node: Any
    label: str
    reduction: str
    rows: int | None
    root: bool = False  # the node is the grad_fn of a root itself
    weighted: bool = False  # a mean over class weights: example i's share is w[y_i] / sum(w[y])


def _roots_of(frame: FrameType) -> list[torch.Tensor]:
    outputs = frame.f_locals.get("t_outputs")
    if isinstance(outputs, (tuple, list)):
        return [t for t in outputs if isinstance(t, torch.Tensor)]
    return []


def _is_engine_call(frame: FrameType) -> bool:
    code = frame.f_code
    return code.co_name == "_engine_run_backward" and "autograd" in code.co_filename


def backward_roots(depth: int = 32) -> list[torch.Tensor]:
    """The tensors the backward pass under way started from (``loss`` in ``loss.backward()``,
    the outputs given to ``torch.autograd.grad``), read from torch's ``_engine_run_backward``
    frame: on this thread's stack (a CPU backward runs its hooks on the calling thread), else
    on the one thread that is inside one (device threads run a GPU backward's hooks); empty
    where there is none, or several backward passes run at once."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        if _is_engine_call(frame):
            return _roots_of(frame)
        frame = frame.f_back
    found = []
    for top in sys._current_frames().values():
        cur: FrameType | None = top
        while cur is not None:
            if _is_engine_call(cur):
                found.append(cur)
                break
            cur = cur.f_back
    return _roots_of(found[0]) if len(found) == 1 else []


def loss_reductions(
    roots: list[torch.Tensor], limit: int = 64, *, through_scaling: bool = False
) -> list[LossReduction]:
    """The reductions a loss certainly applied (see :mod:`._loss_graph`): loss nodes whose
    saved ``reduction`` is ``mean`` or ``sum`` (``NllLossBackward0`` of ``cross_entropy``,
    ``MseLossBackward0``, ...), a full ``mean()``/``sum()`` taken directly of a loss with
    ``reduction='none'``, and the node chains of the torch losses written out in torch
    (``l1_loss``, ``kl_div``, ``cross_entropy`` with class probabilities or label smoothing,
    ...), found at a root or below root-level additions (a loss plus a regularizer). Anything
    else (a division by a count, a scale, a custom loss) is not inspected: a constant may have
    turned a sum into a mean. ``through_scaling``: also below root-level multiplications and
    divisions by a constant, and scaled additions (the reductions, whatever their weight)."""
    found: list[LossReduction] = []
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    tops = set(stack)
    for _ in range(limit):
        if not stack:
            break
        node = stack.pop()
        m = match_loss(node)
        if m is not None:
            found.append(
                LossReduction(node, m.label, m.reduction, m.rows, node in tops, m.weighted)
            )
            continue
        name = type(node).__name__
        kids = [n for n, _ in node.next_functions if n is not None]
        if name in ("AddBackward0", "AddBackward1"):
            if through_scaling or getattr(node, "_saved_alpha", 1) == 1:
                stack.extend(kids)
        elif through_scaling and name in _SCALINGS and len(kids) == 1:
            stack.extend(kids)
    return found


_SCALINGS = ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1")
"""Nodes that scale the loss when one of their inputs is a constant (no graph)."""


def _constant(value: Any) -> float | None:
    """A saved operand's value where it is a CPU number (reading it waits for no device),
    else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu" or value.is_complex():
            return None
        return float(value)
    return float(value) if isinstance(value, numbers.Real) else None


def root_factor(loss: torch.Tensor) -> tuple[float, Any]:
    """``(c, node)``: ``loss`` is ``c`` times the output of ``node``, through the root-level
    multiplications and divisions by CPU numbers (``mean / k``, ``mean * count``);
    ``c = 1`` and the loss's own node where there are none."""
    node, factor = loss.grad_fn, 1.0
    while node is not None and type(node).__name__ in ("MulBackward0", "DivBackward0"):
        (left, _), (right, _) = node.next_functions
        divide = type(node).__name__ == "DivBackward0"
        try:  # (a graph already run frees its saved values)
            if left is not None and right is None:  # loss * c, loss / c
                c = _constant(getattr(node, "_saved_other", None))
                child = left
            elif left is None and right is not None and not divide:  # c * loss
                c = _constant(getattr(node, "_saved_self", None))
                child = right
            else:
                break
        except RuntimeError:
            break
        if c is None or c == 0:
            break
        factor, node = (factor / c if divide else factor * c), child
    return factor, node


def scaled_mean(roots: list[torch.Tensor]) -> bool | None:
    """Whether the loss of ``roots`` is, below root-level additions and multiplications or
    divisions by a constant, a mean over more than one row that its graph records (a
    micro-batch's mean divided by the number of micro-batches): its examples' shares depend on
    the micro-batch's size. None where every reduction it records is over one row, whose mean
    is its sum (a micro-batch of one example, an epoch's remainder): either reading."""
    found = loss_reductions(roots, through_scaling=True)
    if any(f.reduction == "mean" and f.rows != 1 for f in found):
        return True
    if found and all(f.rows == 1 for f in found):
        return None
    return False


def reaches(node: Any, targets: set[Any], limit: int = 200_000) -> bool:
    """Whether the graph below ``node`` contains one of ``targets`` (nodes)."""
    stack, seen = [node], set[Any]()
    while stack and len(seen) < limit:
        cur = stack.pop()
        if cur is None or cur in seen:
            continue
        if cur in targets:
            return True
        seen.add(cur)
        stack.extend(n for n, _ in cur.next_functions)
    return False


def _weighted_mean_message(label: str) -> str:
    return message(
        "per_example.track(model, ...)",
        "loss_reduction",
        f"a loss whose mean gives each example the share 1/N; it ends in {label}, a mean over "
        "class weights that gives example i the share w[y_i] / sum(w[y])",
        "loss_reduction='mean', which would give statistics of N * w[y_i] / sum(w[y]) * g_i, "
        "which depend on the rest of the batch",
        "pass loss_reduction='sum' (l_i = w[y_i] * loss_i / sum(w[y])), or build the loss with "
        "reduction='sum' (dividing it by the weights' sum yourself if needed) and pass "
        "loss_reduction='sum'",
    )


_DIM0_REDUCTIONS = ("Sum", "Mean", "Amax", "Amin", "Max", "Min", "Select", "Logsumexp")


def _reduced_dim0(node: Any, depth: int = 8) -> bool:
    """Whether the loss ``node``'s input comes, through one-input operations, from a
    reduction or a selection along dimension 0 (``h.sum(0)``, ``h[-1]`` of a ``[T, N, d]``
    output): the loss's rows are then not a subset of the examples the layers split (a masked
    or indexed loss over fewer rows is, and is not warned about)."""
    nexts = [n for n, _ in node.next_functions if n is not None]
    cur = nexts[0] if nexts else None
    for _ in range(depth):
        if cur is None:
            return False
        name = type(cur).__name__.rstrip("0123456789").removesuffix("Backward")
        if name in _DIM0_REDUCTIONS:
            dims = getattr(cur, "_saved_dim", None)
            if dims is None:
                return False
            shape = getattr(cur, "_saved_self_sym_sizes", None)
            rank = len(shape) if shape is not None else None
            wanted = dims if isinstance(dims, tuple) else (dims,)
            return any(signed(d) % rank == 0 if rank else signed(d) == 0 for d in wanted)
        kids = [n for n, _ in cur.next_functions if n is not None]
        if len(kids) != 1:
            return False
        cur = kids[0]
    return False


def _warn_fewer_rows(found: LossReduction, n: int) -> None:
    """A loss over fewer rows than the examples the tracked layers split: a sequence-first
    model read with ``batch_dim=0`` (the time steps taken for the examples: ``[T, N, d]``
    reduced over ``T`` before the loss), or a head that combines examples. Not refused: the
    docs allow the second (the statistics are then those of a loss that is not a sum of
    per-example terms)."""
    warnings.warn(
        f"per_example.track(model, ...): the loss ends in {found.label}, a {found.reduction} "
        f"over {found.rows} rows, fewer than the {n} examples the tracked layers were split "
        "into: if the model holds its examples in another dimension than batch_dim (a "
        "sequence-first [T, N, ...] input), pass batch_dim=1 to track(); if it combines "
        "examples after its last tracked layer, the statistics are not those of per-example "
        "losses",
        stacklevel=2,
    )


def check_loss_reduction(
    declared: str, n: int | None, targets: set[Any], roots: list[torch.Tensor] | None = None
) -> None:
    """Refuse a loss whose reduction certainly contradicts ``declared`` (``track``'s
    ``loss_reduction``) in the backward pass under way (from ``roots``, default
    :func:`backward_roots`), ``n`` examples reaching the graph nodes ``targets`` (see
    :func:`loss_reductions`). A mean over other rows than the examples (tokens) read as a sum
    is a valid choice (``l_i`` = the example's token losses over their count) and goes
    through; so does a class-weighted mean read as a sum (``l_i = w[y_i] loss_i /
    sum(w[y])``), which is refused as a mean: its shares are not ``1/N``."""
    roots = backward_roots() if roots is None else roots
    if n == 1:  # a mean over one example is its sum: either reading gives its gradient
        return
    for found in loss_reductions(roots):
        fewer = n is not None and found.rows is not None and found.rows < n
        if fewer and _reduced_dim0(found.node) and reaches(found.node, targets):
            assert n is not None
            _warn_fewer_rows(found, n)
        if found.weighted:  # read as a sum, l_i = w[y_i] * loss_i / sum(w[y])
            passes = declared == "sum"
        else:  # a mean over other rows than the examples (tokens) read as a sum passes
            passes = found.reduction == declared or (
                found.reduction == "mean" and (n is None or found.rows != n)
            )
        if passes:
            continue
        only_root = found.root and len(roots) == 1  # the backward reached the model through it
        if not only_root and not reaches(found.node, targets):
            continue
        if found.weighted:
            raise GradkitError(_weighted_mean_message(found.label))
        over = f"{found.rows} rows" if found.rows is not None else "its rows"
        off = (
            "N * g_i (the variance N**2 too large)"
            if declared == "mean"
            else ("g_i / N (the variance N**2 too small)")
        )
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                "loss_reduction",
                f"the reduction of the loss being backpropagated: it ends in {found.label}, "
                f"a {found.reduction} over {over}",
                f"loss_reduction={declared!r}, which would give statistics of {off}",
                f"pass loss_reduction={found.reduction!r} to track(...), or build the loss "
                f"with reduction={declared!r}",
            )
        )

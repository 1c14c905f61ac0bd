"""How one call of a tracked module is split into examples, broadcast inputs included.

The number of examples ``N`` of a model call is the batch size of its first input. Where that
input is a flat list (1-D) and the first tracked module the model calls has another batch size
(a flat list of indices for an ``EmbeddingBag``: the bags are the examples), ``N`` is not
trusted for that call and no call is reshaped. Given where the examples are in each tensor of a call
(:mod:`._layout`) and a confirmed ``N``, a call is one of:

* **batched**: its outputs have ``N`` (or, without a confirmed ``N``, any number of) examples
  along their batch dimension: the usual case;
* **broadcast**: its outputs have batch size 1 while the model runs on ``N > 1`` examples (Hugging
  Face's GPT-2 and BERT look up learned positions with ``position_ids`` of shape ``[1, T]`` and
  let broadcasting add them to every example). The outputs are replaced by views expanded to
  ``N`` along the batch dimension (stride 0, no copy, identical values wherever the model
  broadcasts them), so the gradient w.r.t. them arrives per example, before broadcasting would
  sum it over the batch;
* **unbatched**: a module with one output and ``batch_dim`` 0 whose tensor inputs carry no
  gradient and are shaped like *one example* of the model's first input (nanoGPT's
  ``wpe(torch.arange(T))`` on ``idx`` of shape ``[N, T]`` gives ``[T, d]``, added to
  ``[N, T, d]``): its output gets a leading batch dimension of ``N``, as broadcasting would give
  it;
* **merged**: a layer that accepts any leading dimensions (Linear, ``Conv1D``, LayerNorm,
  RMSNorm) called on the examples' positions merged into rows, ``[N * T, d]`` (OPT's MLP
  flattens its input), where the rows provably come from an ``[N, T, ...]`` tensor: its input
  is a reshape of one whose first dimension is ``N``, or follows from such layers' outputs
  through single-input operations (an activation) and elementwise products and sums of them
  (a gated MLP). Rules see ``[N, T, d]``;
* **mismatch**: anything else whose batch size is not ``N`` (a layer on ``[T * N, d]``, T5's
  relative position table ``[T, T]``): per-example gradients cannot be split from its output,
  and a gradient reaching it raises.

Rules receive tensors with the examples in dimension 0 (shared tensors as they are); the vmap
fallback receives them as the module saw them, with the dims of each leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from gradkit._autograd import signed
from gradkit._errors import GradkitError, message
from gradkit._precision import Autocast, autocast_state
from gradkit.per_example._flat import flatten, unflatten
from gradkit.per_example._flat import leaves as flat_leaves
from gradkit.per_example._layout import CallLayout

__all__ = [
    "Call",
    "Dims",
    "ModelCall",
    "counted_again_error",
    "disagree_error",
    "mismatch_error",
    "split_call",
]


@dataclass
class ModelCall:
    """The model call under way: its candidate number of examples and the shape of one example
    of its first input; ``trusted`` is None until the first tracked module call decides."""

    n: int | None
    example_shape: tuple[int, ...] | None
    trusted: bool | None = None
    merged: dict[Any, int] = field(default_factory=dict)  # graph node -> positions per example
    # expanded outputs: (call, graph node, batch dimension, "name (Class)" of the module)
    expanded: list[tuple[Any, Any, int, str]] = field(default_factory=list)
    first: Any = None  # the input n was read from, until the first tracked call looked at it
    dim: int | None = None  # where n was read in it
    uses: int = 0  # tracked module calls made during this model call
    # graph node of a batched call's output -> where the examples are in it, and the call's
    # "name (Class)" (see moved_batch)
    dims: dict[Any, tuple[int, str]] = field(default_factory=dict)
    source: Any = None  # the input n was read from, for the whole model call (moved_batch)
    # output node of a tracked call whose input rows were reordered -> their order (row_order)
    row_orders: dict[Any, Any] = field(default_factory=dict)
    # calls batched by coincidence of sizes (Call.made_inside): (call, output node, its batch
    # dimension, label)
    coincident: list[tuple[Any, Any, int, str]] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)  # the model call's tensors
    # output node of a tracked call made after something was expanded -> its inputs' nodes: the
    # consumer walk steps over the call (a fallback module's own transposes are its business)
    call_inputs: dict[Any, list[Any]] = field(default_factory=dict)
    # (data pointer, length) of the unsorted_indices of packed sequences given to tracked calls:
    # pad_packed_sequence's index_select by them puts rows of the packed (sorted) order back in
    # the examples' order (see row_order)
    unsorts: set[tuple[int, int]] = field(default_factory=set)
    # operations found mixing the examples between tracked calls (see row_order): (what it is,
    # the tracked calls whose outputs it mixes)
    mixed: list[tuple[str, list[str]]] = field(default_factory=list)
    # flags (False, True or a 0-dim tensor, read with the statistics) of rows combined from the
    # outputs of tracked calls in different orders (see row_order)
    mixed_rows: list[Any] = field(default_factory=list)
    # (node, dimension) where row_order began a walk -> the orders of its ends and sources: a
    # later call's walk that reaches it stops there (a residual stream is walked once, not
    # once per layer after it)
    walks: dict[tuple[Any, int], tuple[list[Any], list[Any]]] = field(default_factory=dict)
    # tracked calls whose output a walk reached with the examples in another dimension than
    # the call holds them in: (its label, the dimension found, the call's)
    apart: list[tuple[str, int, int]] = field(default_factory=list)

    def arrive(self, node: Any, dim: int) -> None:
        """A walk reached ``node`` (a tracked call's output) with the examples in ``dim``."""
        held, label = self.dims[node]
        if held != dim:
            self.apart.append((label, dim, held))

    def adopt(self, leaves: list[Any], dims: list[int | None]) -> None:
        """At the first tracked call: if it takes the model's input itself and its documented
        layout puts the examples elsewhere than ``batch_dim`` (a sequence-first RNN or
        attention, or a layer of a sequence-first transformer block, called on the model's
        ``[T, N, ...]`` input), ``n`` is read there instead."""
        first, self.first = self.first, None
        if self.trusted is not None or first is None:
            return
        for t, d in zip(leaves, dims, strict=True):
            if t is first and d is not None and d != self.dim:
                self.n, self.dim = int(t.shape[d]), d
                self.example_shape = tuple(t.shape[:d] + t.shape[d + 1 :])
                return

    def confirm(self, n_first: int | None) -> None:
        """The first tracked module call had ``n_first`` examples: ``n`` is trusted if it
        agrees, or if the first input is more than a flat list (a flat list of indices for an
        ``EmbeddingBag`` is not the batch; anything else is, and the module is the odd one)."""
        if self.trusted is None:
            self.trusted = self.n is not None and (n_first == self.n or self.example_shape != ())


@dataclass
class Dims:
    """Where the examples are in the leaves of a call as the module saw it: ``inputs`` per leaf
    of ``flatten((args, kwargs))``, ``outputs`` per leaf of the output's gradient (None:
    shared by every example, or no gradient); ``added[k]``: output ``k`` had no batch dimension
    and was given one (its per-example gradient has the output's own shape)."""

    inputs: list[int | None]
    outputs: list[int | None]
    added: list[bool]
    values: list[torch.Tensor | None] | None = None
    """The output's leaves as the module returned them (detached; expanded where ``added``),
    for the fallback to check that each example's re-run gives its row; None: not checked."""
    versions: list[int] | None = None
    """Their version counters then: a leaf modified in place since cannot be checked."""
    autocast: Autocast = ()
    """The autocast regions the call ran in, re-entered for the fallback's re-runs."""


@dataclass
class Call:
    """One call of a tracked module, split into examples."""

    n: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    in_dims: list[int | None]  # per leaf of (args, kwargs); empty when batch-first
    out_dims: list[int | None]  # per leaf of the output, where the examples are in its gradient
    added: list[bool] = field(default_factory=list)  # per output leaf: batch dimension added here
    output: Any = None  # the replacement output (broadcast or unbatched), or None
    mode: str = "batched"
    problem: str = ""  # for mode "mismatch": what is wrong
    out_spec: Any = None  # the output's tree structure
    positions: int = 1  # mode "merged": rows per example ([N * positions, ...] -> [N, positions])
    values: list[torch.Tensor | None] | None = None  # the fallback's output leaves (see Dims)
    versions: list[int] | None = None
    # batched by its sizes only: its inputs were made inside the model, with as many rows as it
    # has examples by coincidence (positions arange(T) with T == N); see check_broadcast_consumers
    made_inside: bool = False
    autocast: Autocast = ()  # the fallback's: the autocast regions the call ran in (see Dims)


def _merged(
    tensors: list[torch.Tensor], rows: int | None, n: int, allowed: bool, model: Any
) -> int | None:
    """Positions per example if a call on ``rows`` rows is the merged ``[n, T]`` case."""
    if not allowed or rows is None or n == 0 or rows % n or rows == n:
        return None
    grads = [t for t in tensors if t.requires_grad and t.dim() >= 2 and t.shape[0] == rows]
    if not grads:
        return None
    positions = merged_positions(grads[0].grad_fn, model)
    return positions if positions == rows // n else None


def _merged_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out_leaves: list[Any],
    out_spec: Any,
    n: int,
    positions: int,
) -> Call:
    """A merged call: every tensor with ``n * positions`` rows is seen as ``[n, positions]``."""
    in_leaves, in_spec = flatten((args, kwargs))
    rows = n * positions

    def split(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == rows:
            return t.detach().reshape(n, positions, *t.shape[1:])
        return t.detach() if isinstance(t, torch.Tensor) else t

    cargs, ckwargs = unflatten([split(t) for t in in_leaves], in_spec)
    dims: list[int | None] = [0 if isinstance(t, torch.Tensor) else None for t in out_leaves]
    return Call(
        n,
        cargs,
        ckwargs,
        [],
        dims,
        [False] * len(out_leaves),
        mode="merged",
        out_spec=out_spec,
        positions=positions,
    )


def _dims_text(dims: list[int | None], batch_dim: int) -> str:
    found = sorted({d for d in dims if d is not None})
    if not found:
        return (
            f"none: batch_dim={batch_dim} is beyond their dimensions, or the layer took its "
            "input as one example without a batch dimension (an RNN given [T, F], attention "
            "[L, E], a convolution [C, H, W]): give the model's input a batch dimension"
        )
    if found == [batch_dim]:
        return f"batch_dim={batch_dim}"
    return "dimension " + ", ".join(map(str, found)) + " by the layer's own layout"


def _size(t: Any, d: int | None) -> int | None:
    return t.shape[d] if isinstance(t, torch.Tensor) and d is not None else None


def _expand(t: torch.Tensor, d: int, n: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[d] = n
    return t.expand(shape)


_RESHAPES = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def check_broadcast_consumers(output: Any, model: ModelCall) -> None:
    """Turn into mismatches the expanded calls of ``model`` whose expanded output reaches the
    model's output through an operation that does not treat its examples apart, as
    broadcasting does (:func:`_keeps_examples`): indexing or reducing along the batch
    (``pe[0]``, ``pe.sum(0)``), a transpose into a product (``h @ q.T``), a softmax over the
    batch. Split by example, such a call would not be what the model computes untracked (and
    the expansion itself changes the model's output where a product contracts the batch). One
    walk over the graph the model call built, only when something was expanded."""
    if not model.expanded and not model.coincident:
        return
    targets = {node: (call, dim) for call, node, dim, _ in model.expanded}
    targets.update({node: (call, dim) for call, node, dim, _ in model.coincident})
    tops = [t.grad_fn for t in flat_leaves(output) if isinstance(t, torch.Tensor)]
    # per node: the expanded calls it depends on (through the nodes that keep examples apart)
    reach: dict[Any, frozenset[Any]] = {}
    stack: list[tuple[Any, bool]] = [(node, False) for node in tops if node is not None]
    while stack:  # depth first, each node settled after its children
        node, children_done = stack.pop()
        if node in reach:
            continue
        if node in model.call_inputs:
            nexts = list(enumerate(model.call_inputs[node]))
        else:
            nexts = [(k, nxt) for k, (nxt, _) in enumerate(node.next_functions) if nxt is not None]
        if not children_done:
            stack.append((node, True))
            stack.extend((nxt, False) for _, nxt in nexts if nxt not in reach)
            continue
        found: set[Any] = set()
        for k, nxt in nexts:
            below = {nxt} if nxt in targets else set(reach.get(nxt, ()))
            if not below:
                continue
            if node in model.dims:  # a tracked call on the expanded rows: split by example
                continue
            for target in below:
                call, dim = targets[target]
                shape = _output_shape(nxt)
                rank = len(shape) if shape is not None else None
                if call.mode != "mismatch" and not _keeps_examples(node, k, dim, call.n, rank):
                    call.mode = "mismatch"
                    call.problem = (
                        _coincident_problem(call, node)
                        if call.made_inside
                        else "has an output that broadcasts over the batch (batch size 1, "
                        f"expanded to the {call.n} examples of the model call), but the model "
                        f"takes it through {type(node).__name__}, which does not keep the "
                        "examples apart as broadcasting does (it indexes, reduces, transposes "
                        "or multiplies along the batch dimension)"
                    )
            found |= below
        reach[node] = frozenset(found)


def _coincident_problem(call: Any, node: Any) -> str:
    return (
        f"was called on tensors made inside the model (no gradient, no view of its inputs) "
        f"with {call.n} rows, as many as the model call has examples, but the model does not "
        f"treat those rows as its examples: it takes the output through {type(node).__name__}, "
        "which moves or broadcasts them along another dimension (positions looked up with "
        "torch.arange(T) when T equals the batch size, a table of [T, T] buckets). Give such "
        "an input a batch dimension of 1 (torch.arange(T)[None]), which is split exactly"
    )


# operations that act on each entry, or broadcast elementwise: the examples stay apart
_PER_ENTRY = frozenset(
    [
        "Abs",
        "Add",
        "Addcdiv",
        "Addcmul",
        "Alias",  # an identity view (a full slice, HF's hidden_states[:, -0:])
        "Atan",
        "Clamp",
        "ClampMax",
        "ClampMin",
        "Clone",
        "Cos",
        "Cosh",
        "Div",
        "Elu",
        "Erf",
        "Exp",
        "Expm1",
        "Gelu",
        "Hardsigmoid",
        "Hardswish",
        "Hardtanh",
        "LeakyRelu",
        "Lerp",
        "Log",
        "Log1p",
        "LogSigmoid",
        "Maximum",
        "Minimum",
        "Mish",
        "Mul",
        "NativeDropout",
        "Neg",
        "Pow",
        "Reciprocal",
        "Relu",
        "Rsqrt",
        "Rsub",
        "Sigmoid",
        "Sign",
        "Silu",
        "Sin",
        "Sinh",
        "Softplus",
        "Sqrt",
        "Sub",
        "Tanh",
        "Threshold",
        "ToCopy",
        "Where",
    ]
)
# products whose first operand's rows stay rows of the result (input index of that operand)
_ROWS_OF = {"Mm": 0, "Addmm": 1, "Mv": 0, "Addmv": 1}
# products over a leading batch dimension shared by both operands
_BATCHED = frozenset({"Bmm", "Baddbmm"})


def _op(node: Any) -> str:
    """``"Add"`` for ``AddBackward0`` (by type, computed once)."""
    kind = type(node)
    name = _OPS.get(kind)
    if name is None:
        name = _OPS[kind] = kind.__name__.rstrip("0123456789").removesuffix("Backward")
    return name


_OPS: dict[type, str] = {}


def _saved_dims(node: Any, rank: int | None) -> tuple[int, ...] | None:
    """The dimensions ``node`` acts along (its ``_saved_dim``), non-negative where the input's
    ``rank`` is known; None where it acts on the whole tensor. Torch keeps a negative dimension
    as an unsigned 64-bit integer (``-1`` as ``2**64 - 1``)."""
    return _saved_dims_named(node, "_saved_dim", rank)


def _keeps_examples(node: Any, k: int, dim: int, n: int, rank: int | None) -> bool:
    """Whether ``node``'s forward treats the examples of its ``k``-th input apart, leaving them
    where they were: ``n`` of them in dimension ``dim`` of that input, of ``rank`` dimensions
    (None: unknown). Unknown operations do not: the caller refuses rather than guesses."""
    op = _op(node)
    if op in _PER_ENTRY:  # unless broadcast to more dimensions: the examples move right
        if rank is None:
            return True
        shape = _output_shape(node)
        return shape is None or len(shape) <= rank
    if op in _ALONG_DIMS:
        dims = _saved_dims(node, rank)
        return dims is not None and dim not in dims
    if op == "Unsqueeze":
        dims = _saved_dims(node, rank + 1 if rank else None)
        return dims is not None and all(d >= 0 and d > dim for d in dims)
    if op == "Unbind":  # the dimensions after the examples' lose one: theirs stays
        dims = _saved_dims(node, rank)
        return dims is not None and all(d > dim for d in dims)
    if op == "Transpose":  # of two other dimensions (features, positions)
        swapped = (
            *(_saved_dims_named(node, "_saved_dim0", rank) or (dim,)),
            *(_saved_dims_named(node, "_saved_dim1", rank) or (dim,)),
        )
        return dim not in swapped
    if op == "Permute":
        order = _saved_dims_named(node, "_saved_dims", rank)
        return order is not None and len(order) > dim and order[dim] == dim
    if op == "Repeat":  # tiled along other dimensions only, none added in front
        repeats = getattr(node, "_saved_repeats", None)
        return (
            rank is not None and repeats is not None and len(repeats) == rank and repeats[dim] == 1
        )
    if op in _RESHAPE_OPS:
        shape = _output_shape(node)
        if shape is None:  # a torch that does not record it: as before, trusted
            return True
        # the examples in place, or merged with the positions after them into rows
        return len(shape) > dim and (shape[dim] == n or (dim == 0 and shape[0] % n == 0))
    if op == "NativeLayerNorm":  # normalizes trailing dimensions
        normalized = len(getattr(node, "_saved_normalized_shape", ()) or ())
        return rank is None or dim < rank - normalized
    if op in _ROWS_OF:
        return dim == 0 and k == _ROWS_OF[op]
    if op in _BATCHED:
        return dim == 0
    return False


# operations along the dimensions they were given: the examples stay apart unless one of them
_ALONG_DIMS = frozenset(
    [
        "Amax",
        "Amin",
        "Cat",
        "Cumprod",
        "Cumsum",
        "LinalgVectorNorm",
        "LogSoftmax",
        "Logsumexp",
        "Max",
        "Mean",
        "Min",
        "Narrow",
        "Norm",
        "Prod",
        "Select",
        "Slice",
        "Softmax",
        "Split",  # .chunk, .split: pieces along another dimension keep the examples' rows
        "SplitWithSizes",
        "Squeeze",
        "Sum",
    ]
)
_RESHAPE_OPS = frozenset({"View", "UnsafeView", "ReshapeAlias", "Expand"})
# operations that keep their input's shape and combine its entries along the dimensions they
# were given (all of them where none is saved): along the examples', every row of the result
# depends on every example (in words, for messages)
_MIX_WORDS = {
    "Cumprod": "a cumulative product",
    "Cumsum": "a cumulative sum",
    "Logcumsumexp": "a cumulative logsumexp",
    "LogSoftmax": "a log-softmax",
    "Softmax": "a softmax",
}
_MIXES_ALONG = frozenset(_MIX_WORDS)
_BATCH_NORMS = frozenset(["NativeBatchNorm", "CudnnBatchNorm", "MiopenBatchNorm"])
_MIX_CHECKED = _MIXES_ALONG | _BATCH_NORMS | frozenset(_ROWS_OF) | {"Expand", "Repeat"}
_REACH_LIMIT = 256
"""Nodes :func:`_reaches_examples` visits at most (the graph of a value broadcast onto the
rows: a few nodes back to the tracked calls, or a weight's own)."""


def _reaches_examples(node: Any, model: ModelCall) -> list[str]:
    """The tracked calls of ``model`` (their "name (Class)") whose outputs the graph of
    ``node`` reaches, up to :data:`_REACH_LIMIT` nodes: empty for a weight, a constant or a
    value computed from the model's inputs alone."""
    found: dict[str, None] = {}
    seen: set[Any] = set()
    stack = [node]
    while stack and len(seen) < _REACH_LIMIT:
        nd = stack.pop()
        if nd is None or nd in seen:
            continue
        seen.add(nd)
        hit = model.dims.get(nd)
        if hit is not None:
            found[hit[1]] = None
            continue
        stack.extend(nxt for nxt, _ in nd.next_functions)
    return list(found)


def _mixing(node: Any, op: str, d: int, rank: int | None, model: ModelCall) -> None:
    """Record in ``model.mixed`` an operation on the rows of a tracked call's input that
    combines the examples (held in dimension ``d`` of its output, of ``rank`` dimensions):

    * one that keeps the shape and acts along the examples' dimension (a softmax or a
      cumulative sum over the batch, a batch normalization in training mode);
    * a product whose other operands are computed from the examples (``h @ h.T @ h``: row
      ``i`` sums over every example);
    * an ``expand`` along the examples' dimension of a value computed from them
      (``F.normalize(h, dim=0)`` expands the batch's norms), or a ``repeat`` of one.

    Their per-example gradients are not the examples' own: an example's loss depends on the
    others' activations, which the layers before it see in their rows."""
    if op in _BATCH_NORMS:
        if d == 0 and getattr(node, "_saved_training", False):
            what = "a batch normalization in training mode (F.batch_norm)"
            _record_mix(what, [node], model)
    elif op in _MIXES_ALONG:
        dims = _saved_dims(node, rank)
        if dims is not None and (rank is not None or all(s >= 0 for s in dims)) and d in dims:
            _record_mix(f"{_MIX_WORDS[op]} over the examples", [node], model)
    elif op in ("Expand", "Repeat"):
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        if sizes is not None and rank is not None:
            k = d - (rank - len(sizes))  # the input's dimension under the examples'
            if k < 0 or sizes[k] == 1:  # one row for every example
                _broadcast_mix(node.next_functions[0][0], model)
    elif op in _ROWS_OF and d == 0:
        others = [nxt for k, (nxt, _) in enumerate(node.next_functions) if k != _ROWS_OF[op]]
        _record_mix("a matrix product that sums over the examples (h @ h.T)", others, model)


def _broadcast_mix(node: Any, model: ModelCall) -> None:
    """Record in ``model.mixed`` a value broadcast onto a tracked call's input rows (fewer
    rows than examples: a ``mean(0)``, a norm of the whole batch, one example's row
    ``h[:1]``) that is computed from the examples."""
    what = (
        "a value computed across the examples and broadcast onto each example's row "
        "(h - h.mean(0), h / h.norm(), h + h[:1])"
    )
    _record_mix(what, [node], model)


def _record_mix(what: str, nodes: list[Any], model: ModelCall) -> None:
    """Record ``what`` in ``model.mixed`` where the graphs of ``nodes`` reach the outputs of
    tracked calls (the examples it would mix); nothing for weights and constants."""
    reached = [label for node in nodes for label in _reaches_examples(node, model)]
    if reached:
        model.mixed.append((what, reached))


Order = Any
"""How the rows of a layer's input map to the model's examples: ``None`` in order, an ``[N]``
index (row ``i`` is example ``order[i]``), or ``True``: not a reordering of whole rows (a sort
or a gather along the batch), or several that disagree."""


def row_order(
    start: Any, dim: int, model: ModelCall, device: torch.device, order: Order = None
) -> Order:
    """The order in which the rows of the tensor whose ``grad_fn`` is ``start`` (its examples
    along ``dim``) hold the model's examples, from the graph: the reorderings along the batch
    on the way back (a flip, a roll, an index or ``index_select``) are composed, through the
    operations that keep each row whole and the dimensions that move the batch's place (a
    ``select``, an ``unsqueeze``), up to the outputs of earlier tracked calls (whose own
    order is composed in), tensors without a gradient, and operations that may move the
    examples (a transpose, a reshape: trusted beyond, as before). ``order`` is where the walk
    starts (a packed sequence's ``unsorted_indices``). No host sync: the caller turns the
    result into a 0-dim flag. Each walk ends at the previous tracked calls: a few nodes."""
    n = model.n
    if not n or n < 2:
        return None
    while order is None:  # a chain of one-input operations that keep rows: no walk to set up
        if start is None:
            return None
        if start in model.dims:
            model.arrive(start, dim)
            return model.row_orders.get(start)
        op = _op(start)
        nexts = start.next_functions
        shape = _output_shape(start) if op in _MIX_CHECKED or op in _THROUGH else None
        rank = len(shape) if shape is not None else None
        if op in _MIX_CHECKED:  # read where it acts; the walk goes on as before
            _mixing(start, op, dim, rank, model)
        if (op in _PER_ENTRY and len(nexts) == 1) or (op in _KEEP_ROWS and dim == 0):
            start = nexts[0][0]
        elif op in _ROWS_OF and dim == 0:
            start = nexts[_ROWS_OF[op]][0]
        elif op in _THROUGH and len(nexts) == 1:  # a pooling, a flatten, a transpose
            child = _through_dim(start, op, dim, rank, shape)
            if child is None:
                return None  # the examples may have moved: trusted beyond
            start, dim = nexts[0][0], child
        elif op in _PER_ENTRY or op in _NEEDS_RANK or op == "PackPaddedSequence":
            break  # several inputs, or one that reorders or moves the rows: walked below
        else:
            return None  # the examples may have moved: trusted beyond, as the walk would
    ends: list[Order] = []
    sources: list[Order] = []  # the orders of the tracked calls' outputs reached
    first = (start, dim) if order is None else None  # a walk later walks may reuse
    # (node, order, dimension, whether its rows must be checked: reached from an operation of
    # several inputs, one of which may be a broadcast operand or a weight)
    stack: list[tuple[Any, Order, int, bool]] = [(start, order, dim, False)]
    walked: set[tuple[Any, int, int]] = set()  # (node, id(order), dim)
    while stack:
        node, order, d, check = stack.pop()
        if node is None or node in model.dims:
            prior = model.row_orders.get(node) if node is not None else None
            ends.append(_compose(prior, order))
            if node is not None:
                model.arrive(node, d)
                sources.append(ends[-1])
            continue
        done = model.walks.get((node, d))
        if done is not None:  # an earlier call's input, walked from there: its ends, reordered
            ends.extend(_compose(e, order) for e in done[0])
            sources.extend(_compose(s, order) for s in done[1])
            continue
        if (node, id(order), d) in walked:
            continue
        walked.add((node, id(order), d))
        op = _op(node)
        nexts = [nxt for nxt, _ in node.next_functions]
        if op in _PER_ENTRY and not check:  # the common case: an activation, a residual sum
            several = len(nexts) > 1
            stack.extend((nxt, order, d, several) for nxt in nexts)
            continue
        if op == "PackPaddedSequence":  # [N, T, ...] (or [T, N, ...]) packed into rows
            batch_first = getattr(node, "_saved_batch_first", True)
            stack.append((nexts[0], order, 0 if batch_first else 1, False))
            continue
        read = check or op in _NEEDS_RANK or op in _MIX_CHECKED or op in _THROUGH
        shape = _output_shape(node) if read else None
        rank = len(shape) if shape is not None else None
        if shape is not None and (len(shape) <= d or shape[d] != n):
            # not the examples' rows (a broadcast operand, a weight), unless computed from them;
            # rows of several examples each (merged positions, [N * T, ...]) are trusted
            if len(shape) <= d or shape[d] < n or shape[d] % n:
                _broadcast_mix(node, model)
            ends.append(order)
            continue
        if op in _MIX_CHECKED:
            _mixing(node, op, d, rank, model)
        if op == "IndexSelect" and _unsorts(node, d, rank, model):
            ends.append(order)  # rows of the packed (sorted) order, unsorted: the examples
            continue
        if op in ("Cat", "Stack"):  # rows of one tensor spliced back together (or not)
            spliced = _spliced_rows(node, op, d, n, rank, device)
            if spliced is not None:
                source, rows = spliced
                stack.append((source, _compose(rows, order), d, False))
                continue
        rows = _reordered_rows(node, op, d, n, rank, order, device)
        if rows is not None:
            if rows is not True:
                stack.append((nexts[0], rows, d, False))
            else:
                ends.append(True)
            continue
        child = _child_dim(node, op, d, rank, shape)
        if child is None:
            ends.append(order)  # the examples may have moved: trusted beyond
            continue
        if op in _ROWS_OF:
            nexts = [nexts[_ROWS_OF[op]]]  # the rows; the other operand is a weight
        elif op in _KEEP_ROWS or op in _MOVES_DIM:
            nexts = nexts[:1]  # the input; the others are weights and statistics
        several = len(nexts) > 1
        stack.extend((nxt, order, child, several) for nxt in nexts)
    if len(sources) > 1:
        flag = _orders_differ(sources, n, device)
        if flag is not False:
            model.mixed_rows.append(flag)
    if first is not None:  # each order once (a residual stream's Nones would pile up by layer)
        model.walks[first] = (_distinct(ends), _distinct(sources))
    # one order reached along several paths (both directions of a GRU's final state, each
    # selected and concatenated) is that order
    moved = _distinct([e for e in ends if e is not None])
    if not moved:
        return None
    return moved[0] if len(moved) == 1 else True


def _distinct(orders: list[Order]) -> list[Order]:
    """``orders`` with each object once (None, True or an index tensor), in order."""
    return list({id(o): o for o in orders}.values())


def _orders_differ(orders: list[Order], n: int, device: torch.device) -> Any:
    """A flag (as :func:`out_of_order`'s) that the rows of the tracked calls' outputs a call's
    input combines are not in one order: each row then holds several examples' activations
    (``0.7 * h + 0.3 * h[perm]``, manifold mixup). Rows that are not a reordering of whole
    rows (``True``: a sort, a gather) are left out: a token dispatch across the batch may
    scatter each row back whole, which the walk cannot tell from a mix."""
    orders = [o for o in orders if o is not True]
    tensors = [o for o in orders if o is not None]
    if not tensors or (len(tensors) == len(orders) and all(t is tensors[0] for t in tensors)):
        return False
    base = tensors[0] if len(tensors) == len(orders) else torch.arange(n, device=device)
    return torch.stack([(t != base).any() for t in tensors]).any()


def _spliced_rows(
    node: Any, op: str, dim: int, n: int, rank: int | None, device: torch.device
) -> tuple[Any, torch.Tensor] | None:
    """For a ``cat`` along ``dim`` of slices of one tensor along it (``torch.cat([h[k:],
    h[:k]])``), or a ``stack`` along it of one tensor's ``unbind`` along it: that tensor's node
    and the order of its ``n`` rows that the output holds; None for any other (the walk trusts
    what lies beyond, as before)."""
    if _saved_dims(node, rank) != (dim,):
        return None
    edges = list(node.next_functions)
    if op == "Stack":  # the outputs of one unbind, by output index
        source = edges[0][0] if edges else None
        if source is None or _op(source) != "Unbind" or len(edges) != n:
            return None
        if any(e[0] is not source for e in edges) or _saved_dims(source, rank) != (dim,):
            return None
        return source.next_functions[0][0], torch.tensor([k for _, k in edges], device=device)
    parts = []
    first = None
    for part, _ in edges:
        if part is None or _op(part) != "Slice":
            return None
        sizes = tuple(int(s) for s in getattr(part, "_saved_self_sym_sizes", ()))
        if len(sizes) <= dim or sizes[dim] != n or _saved_dims(part, len(sizes)) != (dim,):
            return None
        below = part.next_functions[0]
        if first is None:
            first = below
        elif below != first:
            return None
        start, stop, step = map(signed, (part._saved_start, part._saved_end, part._saved_step))
        start = max(start + n, 0) if start < 0 else start
        stop = max(stop + n, 0) if stop < 0 else stop
        parts.append(torch.arange(min(start, n), min(stop, n), step, device=device))
    if first is None or sum(len(p) for p in parts) != n:
        return None
    return first[0], torch.cat(parts)


def _unsorts(node: Any, dim: int, rank: int | None, model: ModelCall) -> bool:
    """Whether ``node`` (an ``index_select``) selects along ``dim`` by the ``unsorted_indices``
    of a packed sequence given to a tracked call: ``pad_packed_sequence`` restoring the
    examples' order of rows it unpacked in the packed sequence's sorted order. (Such indices
    applied by hand to rows already in the examples' order would be taken the same way: only
    torch's unpacking and its RNNs' final states select by them.)"""
    index = getattr(node, "_saved_index", None)
    if not model.unsorts or index is None or _saved_dims(node, rank) != (dim,):
        return False
    return (index.data_ptr(), index.numel()) in model.unsorts


def _compose(prior: Order, order: Order) -> Order:
    """Rows ``order`` of rows that are the examples ``prior``."""
    if prior is None or order is None:
        return order if prior is None else prior
    if prior is True or order is True:
        return True
    return prior[order]


def _child_dim(node: Any, op: str, d: int, rank: int | None, shape: Any = None) -> int | None:
    """Where the examples are in ``node``'s first input, given they are in dimension ``d`` of
    its output (``shape``, where read); None where the walk cannot tell."""
    if op in _PER_ENTRY:
        return d
    if op in _THROUGH:
        return _through_dim(node, op, d, rank, shape)
    if op in _BATCHED:  # a product per example: both operands hold them in dimension 0
        return d if d == 0 else None
    if op == "Cat" and rank is not None:  # along another dimension: every input holds them
        return d if signed(node._saved_dim) % rank != d else None
    if op in _ROWS_OF or op in _KEEP_ROWS:
        return d if d == 0 else None
    if op in ("Select", "Squeeze", "Unsqueeze", "Slice"):
        if op == "Slice":
            dims = _saved_dims(node, rank)
            return d if dims is not None and d not in dims else None
        if op == "Unsqueeze":
            dims = _saved_dims(node, rank)
            if dims is None or d in dims:
                return None
            return d - sum(1 for u in dims if u < d)
        dims = _saved_dims(node, rank + 1 if rank is not None else None)
        if dims is None or any(s < 0 for s in dims):
            return None
        for s in sorted(dims):  # the input had these dimensions too
            if s <= d:
                d += 1
        return d
    return None


# reductions along the dimensions they were given (all of them where none is saved)
_REDUCES = frozenset(
    [
        "Amax",
        "Amin",
        "LinalgVectorNorm",
        "Logsumexp",
        "Max",
        "Mean",
        "Median",
        "Min",
        "Nanmedian",
        "Norm",
        "Prod",
        "Std",
        "Sum",
        "Var",
    ]
)
# operations the walk follows the examples through, where it can tell their dimension (pooling
# over the positions, a flatten, a transpose): an operation that mixes the examples beyond
# them is found as before them
_THROUGH = _REDUCES | _MIXES_ALONG | {"View", "UnsafeView", "Transpose", "Permute"}


def _through_dim(node: Any, op: str, d: int, rank: int | None, shape: Any) -> int | None:
    """:func:`_child_dim` for the operations of :data:`_THROUGH`: ``d`` in their input, or
    None (unknown, or the examples' own dimension reduced: not rows)."""
    if rank is None:
        return None
    if op in ("View", "UnsafeView"):  # [n, ...] -> [n, ...]: each example's entries stay its row
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        ok = d == 0 and sizes and shape is not None and sizes[0] == shape[0]
        return 0 if ok else None
    if op == "Transpose":
        a = signed(node._saved_dim0) % rank
        b = signed(node._saved_dim1) % rank
        return b if d == a else a if d == b else d
    if op == "Permute":
        dims = [signed(p) % rank for p in node._saved_dims]
        return dims[d] if d < len(dims) else None
    raw = getattr(node, "_saved_dim", None)
    if raw is None:
        return None  # the whole tensor
    given = [signed(s) for s in (raw if isinstance(raw, tuple) else (raw,))]
    if not given:
        return None  # sum(dim=()) reduces everything
    keep = op in _MIXES_ALONG or bool(getattr(node, "_saved_keepdim", False))
    in_rank = rank if keep else rank + len(given)
    reduced = {s % in_rank for s in given}
    remaining = [i for i in range(in_rank) if keep or i not in reduced]
    if d >= len(remaining) or remaining[d] in reduced:
        return None
    return remaining[d]


_MOVES_DIM = frozenset({"Select", "Squeeze", "Unsqueeze", "Slice"})
# operations whose dimensions the walk reads (a negative one needs the rank)
_NEEDS_RANK = frozenset(
    {"Flip", "Roll", "IndexSelect", "Gather", "Sort", "Topk", "Index", "Cat", "Stack"}
) | (_MOVES_DIM)


def _reordered_rows(
    node: Any, op: str, dim: int, n: int, rank: int | None, order: Order, device: torch.device
) -> Any:
    """For an operation that reorders the rows along ``dim``: the order of its input's rows
    that gives ``order`` of its output's (``order`` composed with it); ``True`` for one that
    does not keep rows whole (a sort, a gather along the batch); None for any other."""
    if op in ("Flip", "Roll"):
        dims = _saved_dims_named(node, "_saved_dims", rank)
        if dims and dim not in dims:
            return None
        if op == "Roll" and (not dims or len(dims) != 1):
            return True  # a roll of the flattened tensor, or of several dimensions at once
        rows = torch.arange(n, device=device)
        shift = 0 if op == "Flip" else int(node._saved_shifts[0])
        source = rows.flip(0) if op == "Flip" else (rows - shift).remainder(n)
    elif op in _REORDERS:
        if _saved_dims(node, rank) != (dim,):
            return None
        index = getattr(node, "_saved_index", None)
        if op != "IndexSelect" or index is None or index.numel() != n:
            return True
        source = index.reshape(n).remainder(n)
    elif op == "Index":
        indices = getattr(node, "_saved_indices", ())
        if len(indices) <= dim or indices[dim] is None or any(i is not None for i in indices[:dim]):
            return None
        index = indices[dim]
        if index.dtype == torch.bool or index.shape[:1] != (n,):
            return None  # a mask, or another batch size: the size checks refuse it
        source = index.reshape(n, -1)[:, 0].remainder(n)
    else:
        return None
    return _compose(source, order)


def out_of_order(order: Order, n: int | None) -> Any:
    """A flag for :func:`row_order`'s result: ``False``, ``True``, or a 0-dim tensor on the
    order's device (no host sync) that is true where it is not ``0..n-1``."""
    if order is None or order is False:
        return False
    if order is True or n is None:
        return True
    return (order != torch.arange(n, device=order.device)).any()


# operations along one dimension that may reorder it
_REORDERS = frozenset({"IndexSelect", "Gather", "Sort", "Topk"})
# operations whose output has the examples where their first input had them (the walk back)
_KEEP_ROWS = frozenset(
    [
        "Convolution",
        "MaxPool2DWithIndices",
        "MaxPool3DWithIndices",
        "AvgPool2D",
        "AvgPool3D",
        "AdaptiveAvgPool2D",
        "AdaptiveAvgPool3D",
        "AdaptiveMaxPool2D",
        "NativeLayerNorm",
        "NativeGroupNorm",
        "NativeBatchNorm",
        "CudnnBatchNorm",
    ]
)


def _saved_dims_named(node: Any, name: str, rank: int | None) -> tuple[int, ...] | None:
    saved = getattr(node, name, None)
    if saved is None:
        return None
    out = []
    for d in map(signed, saved if isinstance(saved, tuple) else (saved,)):
        out.append(d % rank if rank and d < 0 else d)
    return tuple(out)


def _output_shape(node: Any) -> Any:
    """The shape of ``node``'s forward output (a sequence of ints), where torch records it."""
    metadata = getattr(node, "_input_metadata", None)
    return metadata[0].shape if metadata else None


_ELEMENTWISE = ("MulBackward0", "AddBackward0", "SubBackward0", "DivBackward0")


def merged_positions(node: Any, model: ModelCall, depth: int = 8) -> int | None:
    """Positions per example of the rows of the tensor ``node`` produced, if they provably are
    ``[N, T, ...]`` merged into ``[N * T, ...]`` (see the module docstring), else None.

    Followed through single-input operations (activations, casts) and through an elementwise
    product or sum of tensors that all are such rows, with as many positions (a gated MLP's
    ``act(gate(z)) * up(z)`` on flattened rows, Qwen2-MoE's shared expert)."""
    while depth > 0:
        if node is None:
            return None
        if node in model.merged:
            return model.merged[node]
        if type(node).__name__ in _RESHAPES:
            sizes = tuple(int(s) for s in getattr(node, "_saved_self_sym_sizes", ()))
            if len(sizes) < 3 or sizes[0] != model.n:
                return None
            if sizes[1:-1].count(model.n):  # [T, N, d] with T == N passes by its sizes
                child = node.next_functions[0][0]
                traced = _trace(child, list(range(len(sizes))), model, [32], ()) if child else None
                if traced is not None and traced[0] != 0:
                    return None  # the examples are in another dimension: not [N, T] rows
            return int(torch.Size(sizes[1:-1]).numel())
        inputs = [nxt for nxt, _ in node.next_functions if nxt is not None]
        if len(inputs) > 1 and type(node).__name__ in _ELEMENTWISE and depth > 1:
            # every input merged alike (a parameter or a broadcast tensor is not: None)
            found = {merged_positions(nxt, model, depth - 1) for nxt in inputs}
            return found.pop() if len(found) == 1 else None
        if len(inputs) != 1:
            return None
        node = inputs[0]
        depth -= 1
    return None


# single-input nodes whose output has their input's shape (activations, copies, dropout)
_SAME_SHAPE = frozenset(
    f"{name}Backward0"
    for name in ("Clone", "ToCopy", "NativeDropout", "Relu", "Gelu", "Silu", "Tanh", "Sigmoid",
                 "LeakyRelu", "Elu", "Hardtanh", "Hardswish", "Mish", "Softplus", "Neg", "Alias")
)  # fmt: skip


def moved_batch(t: torch.Tensor, d: int, n: int, model: ModelCall | None) -> tuple[int, str] | None:
    """The dimension of ``t`` (an input of a layer, read with its examples in dimension ``d``)
    that provably holds the examples where it is not ``d``, with where that was found; None
    where it is ``d`` or unknown.

    Only asked where another dimension of ``t`` has ``n`` entries too: sizes alone cannot tell
    Longformer's ``hidden_states.transpose(0, 1)`` (``[T, N, d]``, sequence-first inside its
    attention) or a sequence-first GRU's output from ``[N, T, d]`` when ``T == N``, and the rule
    would then split the positions as examples. The graph can: from ``t``, through transposes,
    permutes, shape-keeping single-input operations and elementwise sums and products (a
    pre-norm block's residual additions), down to the outputs of batched tracked calls of this
    model call (whose examples' dimension is known), the dimensions' order followed exactly; or,
    for a tensor without a graph, by the strides of a view of the model's input."""
    if model is None or t.shape.count(n) < 2:
        return None  # the sizes say it
    if t.grad_fn is None:
        return _moved_view(t, d, n, model)
    found = _trace(t.grad_fn, list(range(t.dim())), model, [32], ())
    return found if found is not None and found[0] != d else None


def _trace(
    node: Any, where: list[int], model: ModelCall, budget: list[int], through: tuple[str, ...]
) -> tuple[int, str] | None:
    """:func:`moved_batch`'s walk from ``node``, where dimension ``i`` of the layer's input is
    dimension ``where[i]`` of ``node``'s output: that input's dimension holding the examples,
    and where it was found (None: unknown). ``budget``: nodes left to visit, shared."""
    rank = len(where)
    while budget[0] > 0:
        budget[0] -= 1
        if node in model.dims:
            batch, label = model.dims[node]
            found = [i for i in range(rank) if where[i] == batch]
            via = f" through {', '.join(dict.fromkeys(through))}" if through else ""
            return (found[0], f"the output of {label}{via}") if found else None
        name = type(node).__name__
        if name == "TransposeBackward0":  # y = x.transpose(a, b): y's dim k is x's swapped
            a, b = (signed(v) % rank for v in (node._saved_dim0, node._saved_dim1))
            where = [b if k == a else a if k == b else k for k in where]
            through = (*through, "a transpose")
        elif name == "TBackward0":
            where = [1 - k for k in where]
            through = (*through, "a transpose")
        elif name == "PermuteBackward0":  # y = x.permute(p): y's dim k is x's dim p[k]
            order = [signed(v) % rank for v in node._saved_dims]
            where = [order[k] for k in where]
            through = (*through, "a permute")
        elif name in _ELEMENTWISE:  # every input that leads to a known output must agree
            results = [
                r
                for nxt, _ in node.next_functions
                if nxt is not None and (r := _trace(nxt, where, model, budget, through))
            ]
            return results[0] if results and len({r[0] for r in results}) == 1 else None
        elif name not in _SAME_SHAPE:
            return None
        inputs = [nxt for nxt, _ in node.next_functions if nxt is not None]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _moved_view(t: torch.Tensor, d: int, n: int, model: ModelCall) -> tuple[int, str] | None:
    """:func:`moved_batch` for an input without a graph (the model's own input, transposed):
    a view of the model's input whose only dimension with the examples' size and stride is
    not ``d``."""
    src, dim = model.source, model.dim
    if src is None or dim is None or t is src or not t._is_view():
        return None
    if t._base is not (src._base if src._is_view() else src):
        return None
    stride = src.stride(dim)
    found = [j for j in range(t.dim()) if t.shape[j] == n and t.stride(j) == stride]
    if len(found) != 1 or found[0] == d:
        return None
    return found[0], "a view of the model's input"


def _source_text(model: ModelCall) -> str:
    """Where the number of examples was read: the model's first tensor argument (said where it
    holds one example: a shared tensor passed before the batch)."""
    source = model.source
    if not isinstance(source, torch.Tensor):
        return ""
    return (
        f" (its first tensor argument, of shape {tuple(source.shape)}, gives the number of "
        "examples: where another argument holds the batch, pass that one first)"
    )


def _moved_problem(moved: tuple[int, str], d: int, n: int, batch_dim: int) -> str:
    dim, source = moved
    where = f"reads its examples in dimension {d} of its input, but they are in dimension {dim} "
    if d == batch_dim:  # the layer's or its transformer block's own layout may set d too
        return where + (
            f"({source}; both have {n} entries): pass batch_dim={{<its name or its block's>: "
            f"{dim}}}, or batch_dim={d} where the model's input holds its examples in "
            f"dimension {d} (a sequence-first model: a layer inside a torch.nn transformer "
            "block, an RNN or attention layer reads them where its layout says)"
        )
    # a layer read by its own layout (an RNN, attention, a transformer block): batch_dim does
    # not move it; the layers before it took the examples from the wrong dimension
    return where + (
        f"({source}; both have {n} entries), and it reads them where its own layout says "
        f"(batch_first): the layers before it took them from dimension {dim}. Pass "
        f"batch_dim={d} if the model's input holds its examples in dimension {d} (a "
        f"sequence-first model), or give the layers before it that dimension"
    )


def _simple_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    layout: CallLayout,
    model: ModelCall | None,
    batch_first: bool,
) -> Call | None:
    """:func:`split_call` of the most common call, without its general walk: a rule's module
    called on one tensor holding the model's examples in dimension 0, returning one tensor
    that holds them in dimension 0 too (a Linear, a convolution); None for any other call."""
    if not batch_first or kwargs or len(args) != 1 or not isinstance(output, torch.Tensor):
        return None
    x = args[0]
    if not isinstance(x, torch.Tensor) or layout.inputs != [0] or layout.output != [0]:
        return None
    if not output.requires_grad:
        return None
    n = output.shape[0]
    if x.shape[0] != n or moved_batch(x, 0, n, model) is not None:
        return None
    if not x.requires_grad and _made_inside([x], model):
        return None  # rows that may be the examples by coincidence: the general path says
    if model is not None:
        model.adopt([x], layout.inputs)
        model.confirm(n)
        if model.trusted and model.n != n:
            return None  # broadcast, merged or mismatched: the general path says which
    kept = x.detach() if x.requires_grad else x  # no graph kept through the call's input
    return Call(n, (kept,), {}, [], [0], [False], out_spec=flatten(output)[1])


def split_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    layout: CallLayout,
    *,
    model: ModelCall | None,
    batch_dim: int,
    batch_first: bool,
    leading_dims: bool = False,
) -> Call:
    """Split one call (see the module docstring); ``model`` is the model call this module call
    belongs to (None: called outside it); ``leading_dims``: the rule takes inputs with any
    leading dimensions (a merged call may be reshaped for it)."""
    simple = _simple_call(args, kwargs, output, layout, model, batch_first)
    if simple is not None:
        return simple
    out_leaves, out_spec = flatten(output)
    in_leaves, in_spec = flatten((args, kwargs))
    live = [
        k
        for k, t in enumerate(out_leaves)
        if isinstance(t, torch.Tensor) and t.requires_grad and layout.output[k] is not None
    ]
    sizes = {_size(out_leaves[k], layout.output[k]) for k in live}
    n_mod = next(iter(sizes)) if len(sizes) == 1 else None
    n_model = None
    if model is not None:
        model.adopt(in_leaves, layout.inputs)
        model.confirm(n_mod)
        n_model = model.n if model.trusted else None
    n = n_model if n_model is not None else n_mod
    mode = "batched"
    if n_model is not None and n_mod != n_model:
        tensors = [t for t in in_leaves if isinstance(t, torch.Tensor)]
        one_example = all(
            not t.requires_grad and tuple(t.shape) == model.example_shape  # type: ignore[union-attr]
            for t in tensors
        )
        if n_mod == 1 and n_model > 1:
            mode = "broadcast"
        elif batch_dim == 0 and len(out_leaves) == 1 and one_example:
            mode = "unbatched"
        elif positions := _merged(tensors, n_mod, n_model, batch_first and leading_dims, model):
            return _merged_call(args, kwargs, out_leaves, out_spec, n_model, positions)
        else:
            mode = "mismatch"
    elif n is None:
        mode = "mismatch"
    problem = ""
    made_inside = (
        mode == "batched"
        and n_model is not None
        and batch_dim == 0
        and all(d in (0, None) for d in layout.inputs)  # not a layer of its own layout (RNN)
        and not any(isinstance(a, PackedSequence) for a in (*args, *kwargs.values()))
        and _made_inside([t for t in in_leaves if isinstance(t, torch.Tensor)], model)
    )
    if mode == "batched" and n is not None:
        for t, d in zip(in_leaves, layout.inputs, strict=True):
            if isinstance(t, torch.Tensor) and d is not None:
                moved = moved_batch(t, d, n, model)
                if moved is not None:
                    mode, problem = "mismatch", _moved_problem(moved, d, n, batch_dim)
                    break
    if mode == "mismatch":
        shapes = [tuple(t.shape) for t in out_leaves if isinstance(t, torch.Tensor)]
        return Call(
            n or 0,
            args,
            kwargs,
            [],
            list(layout.output),
            [False] * len(out_leaves),
            mode=mode,
            out_spec=out_spec,
            problem=problem
            or (
                f"returned outputs of shapes {shapes} holding "
                f"{sorted(s for s in sizes if s is not None)} examples along their batch "
                f"dimension ({_dims_text(layout.output, batch_dim)}), while the model's input "
                + (
                    f"holds {n_model} examples along dimension {model.dim}"
                    + (_source_text(model) if n_model == 1 else "")
                    if model is not None and n_model is not None
                    else "gives no number of examples"
                )
                + _apart_text(out_leaves, layout.output, n_model)
            ),
        )
    assert n is not None
    new_out = list(out_leaves)
    added = [False] * len(out_leaves)
    out_dims = list(layout.output)
    for k, t in enumerate(out_leaves):
        if not isinstance(t, torch.Tensor):
            continue
        if mode == "unbatched":
            new_out[k] = t.unsqueeze(0).expand(n, *t.shape)
            out_dims[k], added[k] = 0, True
        elif mode == "broadcast" and _size(t, out_dims[k]) == 1:
            new_out[k] = _expand(t, out_dims[k], n)  # type: ignore[arg-type]
    in_dims: list[int | None] = []
    captured: list[Any] = []
    for t, d in zip(in_leaves, layout.inputs, strict=True):
        if not isinstance(t, torch.Tensor):
            captured.append(t)
            in_dims.append(None)
            continue
        t = t.detach()
        size = _size(t, d)
        if batch_first:  # rules: the examples in dimension 0, shared tensors as they are
            if mode == "unbatched":
                t = t.unsqueeze(0).expand(n, *t.shape)
            elif size == n and d:  # d > 0: move the examples to dimension 0
                t = t.movedim(d, 0)
            elif size == 1 and d is not None:
                t = _expand(t, d, n).movedim(d, 0)
        else:  # the fallback: as the module saw them, split where the examples are
            d = d if size == n and mode != "unbatched" else None
        captured.append(t)
        in_dims.append(d)
    cargs, ckwargs = unflatten(captured, in_spec)
    replaced = unflatten(new_out, out_spec) if mode != "batched" else None
    values = versions = None
    autocast: Autocast = ()
    if not batch_first:  # the fallback checks its re-runs against these, computed as these were
        values = [t.detach() if isinstance(t, torch.Tensor) else None for t in new_out]
        versions = [t._version if t is not None else -1 for t in values]
        autocast = autocast_state()
    return Call(
        n,
        cargs,
        ckwargs,
        [] if batch_first else in_dims,
        out_dims,
        added,
        replaced,
        mode,
        out_spec=out_spec,
        values=values,
        versions=versions,
        made_inside=made_inside,
        autocast=autocast,
    )


def _made_inside(tensors: list[torch.Tensor], model: ModelCall | None) -> bool:
    """Whether a call's tensors are all made inside the model without a gradient (no view of
    its inputs: positions from ``torch.arange``, buckets, a buffer): its rows are the model's
    examples only if the model treats them so (checked at the model call's end)."""
    if model is None or not tensors or any(t.requires_grad for t in tensors):
        return False
    inputs = {_storage(t) for t in model.inputs}
    return not any(_storage(t) in inputs for t in tensors)


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s data lives (its own identity for tensors without a plain storage: meta,
    nested, sparse)."""
    if t.device.type == "meta" or t.is_nested or t.layout != torch.strided:
        return id(t)
    return t.untyped_storage().data_ptr()


_SHOWN = 3
"""Layers whose problem a refusal states in full; the others are named only (a model of many
such layers, MobileViT's, gave a message of 16 kB)."""


def _apart_text(leaves: list[Any], dims: list[int | None], n: int | None) -> str:
    """For a call refused as mismatched: the outputs that hold ``n`` examples along another
    dimension than read (Opacus's ``DPLSTM``: ``[N, T, H]`` outputs, ``[layers, N, H]``
    states), which no ``batch_dim`` can describe at once; empty where there are none."""
    if n is None or n < 2:
        return ""
    apart = [
        f"output {k} along dimension {list(t.shape).index(n)}"
        for k, (t, d) in enumerate(zip(leaves, dims, strict=False))
        if isinstance(t, torch.Tensor) and _size(t, d) != n and n in t.shape
    ]
    if not apart or len(apart) == len([t for t in leaves if isinstance(t, torch.Tensor)]):
        return ""
    return (
        f"; its outputs hold the examples in different dimensions ({', '.join(apart)}), which "
        "one batch_dim cannot describe: register a rule for the module "
        "(@gradkit.per_example.register_rule), or freeze it"
    )


def mismatch_error(problems: list[str]) -> GradkitError:
    """The error for calls that cannot be split by example (``"name (Class) problem"`` each;
    a module called several times alike is stated once)."""
    problems = list(dict.fromkeys(problems))
    shown = "; ".join(problems[:_SHOWN])
    if len(problems) > _SHOWN:
        rest = [p.split(") ", 1)[0] + ")" for p in problems[_SHOWN:]]
        names = ", ".join(rest[:12]) + (f" and {len(rest) - 12} more" if len(rest) > 12 else "")
        shown += f"; and {len(rest)} more layers alike: {names}"
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            "batch_dim",
            "every tracked layer's outputs to hold the model's examples along their batch "
            "dimension",
            shown,
            "where a layer holds the examples in another dimension only, pass batch_dim=... "
            "there (an int, or per submodule: batch_dim={'': 1, 'head': 0}); a layer that mixes "
            "examples or sees them merged with other rows untraceably (examples times windows, "
            "patches or heads; [T, N, d] flattened to [T * N, d]) cannot be split: freeze its "
            "parameters (requires_grad_(False)) or register a rule for it",
        )
    )


def apart_error(label: str, apart: list[tuple[str, int, int]]) -> GradkitError:
    """The error for a tracked call whose input holds the examples of an earlier call's output
    in another dimension than that call does (see ``ModelCall.arrive``)."""
    earlier, found, held = apart[0]
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            "batch_dim",
            "the examples in the same dimension of a layer's output for the layer and for "
            "the operations after it",
            f"the input of {label} built from dimension {found} of the output of {earlier}, "
            f"which holds the examples in dimension {held} by the layout batch_dim gives it "
            f"(a reduction, an index or a selection along its dimension {held}: "
            "sequence-first activations [T, N, ...] read as [N, T, ...], whose sizes cannot "
            "tell them apart where T == N)",
            "pass batch_dim where the examples are (batch_dim=1 for a sequence-first model, or "
            "a dict per module), or use batch-first layers",
        )
    )


def mixed_error(label: str, mixed: list[tuple[str, list[str]]]) -> GradkitError:
    """The error for a tracked call whose input rows mix the examples (see ``row_order``):
    ``mixed`` holds what mixes them and the tracked calls whose outputs it mixes."""
    what, layers = mixed[0]
    named = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            f"the input of {label}",
            "rows that each depend on one example (statistics beyond the mean need each "
            "example's own gradient, and the layers before this one see the examples mixed)",
            f"{what}, applied to the outputs of {named}",
            "compute that step per example (statistics of the batch detached: h - "
            "h.mean(0).detach(); GroupNorm or LayerNorm for a batch normalization: "
            "gradkit.per_example.replace_batchnorm), or freeze the layers before it "
            "(requires_grad_(False)) to track the rest; the mean alone (track(model, "
            "'mean')) is exact whatever the model mixes",
        )
    )


def disagree_error(sizes: list[tuple[str, int]]) -> GradkitError:
    """The error for calls of one backward pass with different numbers of examples."""
    labels = {k for k, _ in sizes}
    if len(labels) == 1:
        return GradkitError(
            message(
                "per_example.track(model, ...)",
                "the model's calls",
                "calls on one batch between two backward passes (they are taken as uses on "
                "the same examples: weight tying)",
                f"{labels.pop()} called on batches of sizes {sorted({n for _, n in sizes})} "
                "before one backward",
                "run backward after each micro-batch",
            )
        )
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            "batch_dim",
            "one number of examples for every tracked layer in a backward pass",
            ", ".join(f"{k}: {v}" for k, v in sizes) + " (layer: examples)",
            "pass batch_dim=... where the examples are in each layer's input and output (an "
            "int, or per submodule); RNNs, attention, convolutions and torch.nn transformer "
            "blocks are read by their own layout. Calls of the model on different batches "
            "need a backward pass each",
        )
    )


def counted_again_error(label: str) -> GradkitError:
    """The error for a backward pass through a call whose examples an earlier pass counted
    (``retain_graph=True``: two losses of one forward, backpropagated one after the other)."""
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            "the backward passes",
            "one backward pass into the parameters per forward call (each pass adds its "
            "examples: micro-batches)",
            f"a second pass through a call of {label} whose examples an earlier pass already "
            "counted (retain_graph=True): each example would count twice, and its two "
            "losses' gradients as two examples",
            "add the losses and backpropagate once, (loss_a + loss_b).backward(): the "
            "statistics are then those of each example's whole gradient; or run the model "
            "again for the second loss, if its examples are other examples",
        )
    )

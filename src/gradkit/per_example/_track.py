"""``track``: statistics of individual gradients inside the usual backward pass.

How it works, once per tracked module (a module with parameters of its own that require grad):

1. A forward hook keeps the module's inputs and installs a tensor hook on its output (tensor
   hooks see the gradient w.r.t. the output even when an in-place activation follows, where
   ``register_full_backward_hook`` breaks). It also finds, in the graph the forward just built,
   the edges through which the gradient reaches each parameter, and hooks them: the sum of the
   individual gradients of this pass (the mean) is read there, for free and exactly, without
   any term the loss adds outside the module (a weight-decay term, say).
2. When the output gradient arrives, the layer's rule (looked up along the MRO) turns inputs and
   output gradients into per-example gradients in factored or materialized form, and the
   requested statistics are accumulated. A module used several times in one forward (weight
   tying, recurrence) is processed once all its uses arrived, so its contributions are summed
   per example before any power is taken.
3. At the end of the backward pass (an engine callback) whatever is still pending is processed,
   and every tracked parameter the loss did not reach gets a zero gradient for each of the
   pass's examples (as one example at a time would give it).

At the first tracked output a backward pass reaches, before the gradient reaches any tracked
parameter (so a refused pass leaves ``p.grad`` as it was), the pass is checked: no layer it
will differentiate was split into another number of examples, all agree on ``N``, and the loss
does not certainly contradict ``loss_reduction`` (:func:`._layout.loss_reductions`).

Nothing is set on the model; ``p.grad`` is what it would be without tracking (bit-for-bit,
except the weights of Linear layers on sequences, summed from their per-example gradients: see
``fuse``). The hooks are removed on exit, also when the body raises; captured activations live
in the graph's hook closures and are freed with the graph.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradkit._errors import GradkitError, message
from gradkit._validate import check_bool, check_choice, check_int, check_module, check_optional_int
from gradkit.per_example import _dist
from gradkit.per_example._batch import (
    Call,
    Dims,
    ModelCall,
    check_broadcast_consumers,
    disagree_error,
    mismatch_error,
    split_call,
)
from gradkit.per_example._fused import LinearWithSums, WeightSum
from gradkit.per_example._grads import PerExampleGrad
from gradkit.per_example._layout import (
    call_layout,
    check_feature_dims,
    check_loss_reduction,
    inner_batch_dims,
    parse_batch_dim,
)
from gradkit.per_example._registry import CheckedUses, RuleContext, Use, builtin, find_rule
from gradkit.per_example._stats import ParamStats, _Acc, add_block, parse_want, statistics_dtype
from gradkit.per_example._sum import combine
from gradkit.per_example.rules import vmap_rule
from gradkit.per_example.rules._thirdparty import register_available, unsplittable

__all__ = ["Tracker", "track"]

logger = logging.getLogger(__name__)
_DEFAULT_MAX_MEMORY = 256 * 2**20


@dataclass
class _UseRecord:
    call: Call
    sums: WeightSum | None  # the weight gradient summed from the statistics' blocks
    edges: dict[int, list[tuple[Node, int]]]  # pid -> edges into the parameter
    leaves: dict[int, Node]  # pid -> the parameter's gradient accumulator
    buffered: dict[int, torch.Tensor] = field(default_factory=dict)  # edge sums before deciding
    from_edges: dict[int, bool] = field(default_factory=dict)  # decided: mean read at the edges
    recomputed: bool = False  # a forward run inside a backward (activation checkpointing)
    label: str = ""  # "name (Class)" of the module
    nodes: list[Node] = field(default_factory=list)  # the graph nodes of its outputs

    def release_graph(self) -> None:
        """Drop the references to graph nodes once this backward has read them. The record
        lives in hooks on the graph's own nodes, so a node kept here would make a cycle
        through C++ that Python's garbage collector cannot see (the tracker, its results and
        the inputs would leak). A later backward through a retained graph then takes the mean
        from the rule's output instead of the edges."""
        self.edges, self.leaves, self.buffered, self.nodes = {}, {}, {}, []
        self.call.output = None  # an expanded output holds the hook that holds this record
        self.sums = None
        self.from_edges = dict.fromkeys(self.from_edges, False)

    def release(self) -> None:
        """Drop everything (the tracker is closed)."""
        self.release_graph()
        self.call.args, self.call.kwargs = (), {}


@dataclass
class _ModuleState:
    name: str
    module: nn.Module
    rule: Any
    params: dict[str, torch.Tensor]  # local name -> parameter
    pids: dict[str, int]  # local name -> id(parameter)
    batch_dim: int  # of its inputs and outputs (see inner_batch_dims)
    transposed: bool | None = None  # a weight whose gradient LinearWithSums may sum (layout)
    shared: bool = False
    forward_count: int = 0
    pending: list[tuple[_UseRecord, list[torch.Tensor | None]]] = field(default_factory=list)


_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Tracker] = weakref.WeakKeyDictionary()
"""The tracker of every module hooked by an active track block."""


def _model_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> ModelCall:
    """The candidate number of examples of a model call: the batch dimension of its first
    input that has one (a PackedSequence: its first batch size)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, PackedSequence):
            return ModelCall(int(value.batch_sizes[0]), None)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
                shape = t.shape[:batch_dim] + t.shape[batch_dim + 1 :]
                return ModelCall(int(t.shape[batch_dim]), tuple(shape), first=t, dim=batch_dim)
    return ModelCall(None, None)


def _use(call: Call, grads: list[torch.Tensor | None], native: bool) -> Use:
    """The rule's view of one call: batch-first tensors for rules, the call as the module saw
    it (with its dims) for the fallback."""
    if native:
        return Use(call.args, grads, call.kwargs, Dims(call.in_dims, call.out_dims, call.added))
    return Use(call.args, tree_unflatten(grads, call.out_spec), call.kwargs)


def _param_edges(
    roots: Sequence[Node | None], stops: set[Node], targets: dict[Node, int]
) -> dict[int, list[tuple[Node, int]]]:
    """Edges ``(node, k)`` of the graph below ``roots`` whose k-th input is a target parameter,
    not descending past ``stops`` (the graph that existed before the module's forward)."""
    found: dict[int, list[tuple[Node, int]]] = {}
    seen: set[Node] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if nxt in targets:
                found.setdefault(targets[nxt], []).append((node, k))
            else:
                stack.append(nxt)
    return found


def _in_backward() -> bool:
    """Whether a backward pass is running (a forward inside it re-computes activations)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and int(task()) != -1


def _will_execute(node: Node) -> bool:
    check = getattr(torch._C, "_will_engine_execute_node", None)
    return True if check is None else bool(check(node))


class Tracker(Mapping[str, ParamStats]):
    """The statistics of one ``track`` block: a mapping from parameter name to
    :class:`ParamStats`, plus totals over parameters. Created by :func:`track`."""

    def __init__(
        self,
        model: nn.Module,
        quantities: Sequence[str],
        *,
        moments: Sequence[int],
        loss_reduction: str,
        batch_dim: int | Mapping[str, int],
        fallback: str,
        unbiased: bool,
        max_memory: int,
        chunk_size: int | None,
        fuse: bool = True,
    ) -> None:
        call = "per_example.track(model, ...)"
        check_module(model, call, "pass the model whose parameters to track")
        self._want = parse_want(quantities, moments, call)
        self._loss_reduction = check_choice(loss_reduction, ("mean", "sum"), call, "loss_reduction")
        check_choice(fallback, ("vmap", "warn", "error"), call, "fallback")
        modules = dict(model.named_modules())
        batch_dim, given_dims = parse_batch_dim(batch_dim, modules, call)
        check_bool(fuse, call, "fuse")
        check_bool(unbiased, call, "unbiased")
        check_int(max_memory, call, "max_memory", low=1, example="2**28 (bytes)")
        check_optional_int(
            chunk_size, call, "chunk_size", fix="pass e.g. chunk_size=64 (examples), or None"
        )
        self._fuse = fuse
        self._batch_dim = batch_dim
        self._unbiased = unbiased
        self._max_memory = max_memory
        self._chunk_size = chunk_size
        self._model = model
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._params = {id(p): p for p in model.parameters()}
        self._accs: dict[int, _Acc] = {}
        self._states: list[_ModuleState] = []
        register_available()  # rules for third-party layers whose library the user imported
        owners: dict[int, int] = {}
        claimed: list[str] = []  # subtrees a fallback module differentiates as a whole
        dims = inner_batch_dims(modules, batch_dim, given_dims)
        for name, module in modules.items():
            if any(c == "" or name == c or name.startswith(c + ".") for c in claimed):
                continue
            own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
            if not own:
                continue
            parent = modules[name.rpartition(".")[0]] if name else None
            why = unsplittable(parent, module)
            if why is not None:
                raise GradkitError(
                    message(
                        call,
                        "model",
                        "layers whose gradients can be split by example",
                        f"{name} ({type(module).__name__}): {why}",
                        f"freeze it ({name}.requires_grad_(False)) to track the rest",
                    )
                )
            rule = find_rule(module)
            if rule is None:
                # the fallback takes the whole subtree: a module may use its children's
                # parameters without calling them (MultiheadAttention and out_proj)
                own = {n: p for n, p in module.named_parameters() if p.requires_grad}
                claimed.append(name)
                if fallback == "error":
                    raise GradkitError(
                        message(
                            call,
                            "fallback",
                            "a rule for every tracked module",
                            f"none for {name or 'model'} ({type(module).__name__})",
                            "register one with "
                            "@gradkit.per_example.register_rule, or pass "
                            "fallback='vmap'",
                        )
                    )
                if fallback == "warn":
                    warnings.warn(
                        f"per_example.track: no rule for {name or 'model'} "
                        f"({type(module).__name__}); using the vmap fallback "
                        "(exact, slower, needs a deterministic forward)",
                        stacklevel=3,
                    )
                rule = vmap_rule
            pids = {n: id(p) for n, p in own.items()}
            transposed = getattr(rule, "weight_layout_transposed", None)
            if own.get("weight") is not getattr(module, "weight", None):
                transposed = None  # a parametrized weight: autograd's own product
            self._states.append(_ModuleState(name, module, rule, own, pids, dims[name], transposed))
            for pid in pids.values():
                owners[pid] = owners.get(pid, 0) + 1
                param = self._params[pid]
                self._accs.setdefault(pid, _Acc(param.shape, statistics_dtype(param.dtype)))
        if not self._accs:
            total = sum(1 for _ in model.parameters())
            raise ValueError(
                message(
                    call,
                    "model",
                    "a module with parameters that require grad",
                    f"{type(model).__name__} with {total} parameter(s), none requiring grad",
                    "unfreeze the parameters to track (p.requires_grad_(True))",
                )
            )
        self._frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        for st in self._states:
            st.shared = any(owners[pid] > 1 for pid in st.pids.values())
        self._handles: list[Any] = []
        self._active = False
        self._callback_queued = False
        self._in_rule = False
        self._records: list[_UseRecord] = []  # uses whose graph references are still held
        self._done: list[_UseRecord] = []  # uses processed in the current backward
        self._deferred: dict[int, list[tuple[PerExampleGrad, bool, float]]] = {}
        self._sizes: dict[str, int] = {}  # module -> batch size, in the current backward
        self._reached: set[int] = set()  # parameters reached in the current backward
        self._task: int | None = None  # the backward pass whose start was checked
        self._unbackwarded = 0  # model calls since the last backward pass
        self._merged = False  # all_reduce was called
        self._model_calls: list[ModelCall] = []  # the model calls under way

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> Tracker:
        call = "per_example.track(model, ...)"
        if self._active:
            raise GradkitError(
                message(
                    call,
                    "the track block",
                    "a tracker entered once at a time",
                    "a second `with` on a tracker that is already active",
                    "use the active tracker, or create another one after this block",
                )
            )
        for st in self._states:
            other = _ACTIVE.get(st.module)
            if other is not None:
                raise GradkitError(
                    message(
                        call,
                        "model",
                        "modules that no other active track block tracks",
                        f"{st.name or 'model'} ({type(st.module).__name__}), already tracked by "
                        f"an enclosing track block",
                        "ask for every quantity in one track(model, ...) call (blocks on the "
                        "same modules cannot nest)",
                    )
                )
        for pid, acc in self._accs.items():
            if acc.n == 0:  # the model may have been cast since track() was called
                param = self._params[pid]
                acc.shape, acc.dtype = param.shape, statistics_dtype(param.dtype)
        self._active = True
        for st in self._states:
            _ACTIVE[st.module] = self
        try:
            for st in self._states:
                self._handles.append(
                    st.module.register_forward_hook(self._forward_hook(st), with_kwargs=True)
                )
            self._handles.append(
                self._model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True)
            )
            self._handles.append(
                self._model.register_forward_hook(
                    self._model_hook, with_kwargs=True, always_call=True
                )
            )
            for module in self._model.modules():
                if isinstance(module, _BatchNorm):
                    self._handles.append(module.register_forward_pre_hook(_refuse_batchnorm))
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for st in self._states:
            if _ACTIVE.get(st.module) is self:
                del _ACTIVE[st.module]
        self._active = False
        self._unbackwarded = 0
        self._reached.clear()
        self._model_calls.clear()
        self._sizes.clear()
        for st in self._states:
            st.pending.clear()
            st.forward_count = 0
        for record in self._records:  # uses never backwarded: break their graph cycles
            record.release()
        self._records.clear()

    # -- capture -------------------------------------------------------------------------------

    def _model_pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._model_calls.append(_model_call(args, kwargs, self._batch_dim))

    def _model_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        model_call = self._model_calls.pop() if self._model_calls else None
        n = model_call.n if model_call is not None else None
        failed = sys.exc_info()[1]
        if model_call is not None and failed is None:
            check_broadcast_consumers(output, model_call)
            if model_call.uses and not _in_backward():
                self._unbackwarded += 1
        reshaped = [
            label for call, _, _, label in (model_call.expanded if model_call else [])
            if call.mode == "unbatched"
        ]  # fmt: skip
        if failed is not None and reshaped and hasattr(failed, "add_note"):
            failed.add_note(
                "per_example.track gave these modules a batch dimension of "
                f"{n} examples because their outputs had none: "
                + ", ".join(reshaped)
                + ". A model that does not broadcast such an output over the batch cannot be "
                "split by example there: freeze its parameters (requires_grad_(False)) or "
                "give its inputs the batch dimension"
            )

    def _forward_hook(self, st: _ModuleState) -> Any:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            leaves = tree_flatten(output)[0]
            live = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if self._in_rule or not live:
                return None  # a rule re-running the forward (vmap fallback), or no backward
            frozen = [k for k, p in st.params.items() if not p.requires_grad]
            if frozen:
                name = f"{st.name}.{frozen[0]}" if st.name else frozen[0]
                raise GradkitError(
                    message(
                        "per_example.track(model, ...)",
                        f"parameter {name!r}",
                        "requires_grad=True, as when track() was called",
                        "requires_grad=False (frozen after track() was called)",
                        "freeze parameters before calling track() (frozen ones are skipped)",
                    )
                )
            layout = call_layout(module, args, kwargs, output, st.batch_dim)
            check_feature_dims(st.name, module, args, layout, st.batch_dim)
            if self._model_calls:
                self._model_calls[-1].uses += 1
            call = split_call(
                args,
                kwargs,
                output,
                layout,
                model=self._model_calls[-1] if self._model_calls else None,
                batch_dim=st.batch_dim,
                batch_first=st.rule is not vmap_rule,
                leading_dims=getattr(st.rule, "leading_dims", False),
            )
            replacement = call.output
            if call.mode == "batched" and self._fusable(st, args, output):
                sums = WeightSum()
                replacement = LinearWithSums.apply(
                    args[0], module.weight, module.bias, output.detach(), sums, st.transposed
                )
            else:
                sums = None
            if replacement is not None:
                if call.mode in ("broadcast", "unbatched"):
                    for old, new, d in zip(
                        tree_flatten(output)[0],
                        tree_flatten(replacement)[0],
                        call.out_dims,
                        strict=True,
                    ):
                        if new is not old and isinstance(new, torch.Tensor) and d is not None:
                            label = f"{st.name or 'model'} ({type(module).__name__})"
                            self._model_calls[-1].expanded.append((call, new.grad_fn, d, label))
                output = replacement
                leaves = tree_flatten(output)[0]
                live = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if call.mode == "merged" and isinstance(output, torch.Tensor):
                self._model_calls[-1].merged[output.grad_fn] = call.positions
            edges: dict[int, list[tuple[Node, int]]] = {}
            targets: dict[Node, int] = {}
            if self._want.mean:  # the mean is read at the edges into the parameters
                stops = {
                    a.grad_fn
                    for a in tree_flatten((args, kwargs))[0]
                    if isinstance(a, torch.Tensor) and a.grad_fn is not None
                }
                for local, p in st.params.items():
                    if p.is_leaf:
                        targets[torch.autograd.graph.get_gradient_edge(p).node] = st.pids[local]
                edges = _param_edges([t.grad_fn for t in live], stops, targets)
            record = _UseRecord(call, sums, edges, {pid: nd for nd, pid in targets.items()})
            record.recomputed = _in_backward()
            record.label = f"{st.name or 'model'} ({type(module).__name__})"
            record.nodes = [t.grad_fn for t in live if t.grad_fn is not None]
            self._records.append(record)
            st.forward_count += 1
            if isinstance(output, torch.Tensor):
                output.register_hook(lambda g: self._on_output_grad(st, record, [g]))
            else:  # several outputs (e.g. an RNN's output and state): all their gradients at once
                ids = [id(t) for t in live]

                def on_grads(grads: Sequence[torch.Tensor | None]) -> None:
                    by_id = dict(zip(ids, grads, strict=True))
                    self._on_output_grad(st, record, [by_id.get(id(t)) for t in leaves])

                torch.autograd.graph.register_multi_grad_hook(live, on_grads, mode="all")
            if self._want.mean:
                by_node: dict[Node, list[tuple[int, int]]] = {}
                for pid, es in edges.items():
                    for node, k in es:
                        by_node.setdefault(node, []).append((k, pid))
                for node, ks in by_node.items():
                    node.register_hook(self._edge_hook(record, ks))
            return replacement

        return hook

    def _fusable(self, st: _ModuleState, args: tuple[Any, ...], output: Any) -> bool:
        """Whether this call's weight gradient can be summed from the per-example gradients
        the statistics will materialize (a Linear on sequences, see :mod:`._fused`)."""
        if not self._fuse or st.transposed is None or st.shared or st.batch_dim != 0:
            return False
        if not (self._want.powers or "batch_grad" in self._want.quantities):
            return False
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return False
        positions = x.numel() // max(1, x.shape[0] * x.shape[-1]) if x.dim() >= 2 else 0
        return positions > 1 and output.requires_grad and torch.is_grad_enabled()

    def _scale(self, n: int) -> float:
        return float(n) if self._loss_reduction == "mean" else 1.0

    def _edge_hook(self, record: _UseRecord, ks: list[tuple[int, int]]) -> Any:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> None:
            if not self._active:
                return
            for k, pid in ks:
                g = grad_inputs[k]
                if g is None:
                    continue
                g = g.detach()
                if g.is_sparse:  # Embedding(sparse=True)
                    g = g.to_dense()
                decided = record.from_edges.get(pid)
                if decided:
                    self._accs[pid].add_sum(1, g, alpha=self._scale(record.call.n))
                elif decided is None:  # before the rule ran (deferred module): keep it
                    g = g * self._scale(record.call.n)
                    prev = record.buffered.get(pid)
                    record.buffered[pid] = g if prev is None else prev + g

        return hook

    def _decide_mean(self, record: _UseRecord, pid: int) -> bool:
        """Whether the sum of this use's gradients w.r.t. ``pid`` is read at the parameter's
        edges in this backward; if not, the rule's output gives it."""
        ok = pid in record.edges and pid in record.leaves
        if ok:
            try:
                ok = _will_execute(record.leaves[pid]) and all(
                    _will_execute(node) for node, _ in record.edges[pid]
                )
            except RuntimeError:  # inside torch.autograd.grad: leaves cannot be asked
                ok = False
        return ok

    def _on_output_grad(
        self, st: _ModuleState, record: _UseRecord, grads: list[torch.Tensor | None]
    ) -> None:
        if not self._active:
            return
        self._start_backward()
        call = record.call
        if call.mode == "mismatch" and any(g is not None for g in grads):
            raise mismatch_error([f"{record.label} {call.problem}"])
        leaves: list[Any] = []
        for g, d, added in zip(grads, call.out_dims, call.added, strict=True):
            if g is not None:
                g = g.detach()
                if call.positions > 1:  # [N * T, ...] -> [N, T, ...]
                    g = g.reshape(call.n, call.positions, *g.shape[1:])
                elif call.in_dims or added or d is None or d == 0:  # the fallback: as it is
                    pass
                else:
                    g = g.movedim(d, 0)
            leaves.append(g)
        st.pending.append((record, leaves))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if not st.shared and len(st.pending) == st.forward_count:
            self._process(st)

    # -- checks at the start of a backward pass, before any gradient is accumulated -------------

    def _start_backward(self) -> None:
        """Once per backward pass, at the first tracked output it reaches (before the gradient
        reaches any tracked parameter, so a refused pass leaves every ``p.grad`` as it was):
        refuse what would give wrong statistics."""
        task_id = getattr(torch._C, "_current_graph_task_id", None)
        task = int(task_id()) if task_id is not None else None
        if task is not None and task == self._task:
            return
        self._task = task
        if self._merged:
            raise GradkitError(
                message(
                    "per_example.track(model, ...)",
                    "stats.all_reduce(group)",
                    "no further backward pass into statistics already merged across ranks",
                    "a backward pass after all_reduce",
                    "start a new track block for the next step",
                )
            )
        live: list[_UseRecord] = []
        for r in self._records:
            try:
                if any(_will_execute(node) for node in r.nodes):
                    live.append(r)
            except RuntimeError:
                pass
        mismatched = [r for r in live if r.call.mode == "mismatch"]
        if mismatched:
            raise mismatch_error([f"{r.label} {r.call.problem}" for r in mismatched])
        sizes = [(r.label, r.call.n) for r in live]
        if len({k for _, k in sizes}) > 1:
            raise disagree_error(sizes)
        n = sizes[0][1] if sizes else None
        check_loss_reduction(self._loss_reduction, n, {nd for r in live for nd in r.nodes})

    # -- processing ----------------------------------------------------------------------------

    def _process(self, st: _ModuleState) -> None:
        pending, st.pending = st.pending, []
        ns = {r.call.n for r, _ in pending}
        if len(ns) != 1:
            label = f"{st.name or 'model'} ({type(st.module).__name__})"
            raise disagree_error([(label, k) for k in sorted(ns)])
        n = ns.pop()
        self._sizes[st.name or "model"] = n
        self._done.extend(r for r, _ in pending)
        self._reached.update(st.pids.values())
        if n == 0:  # a batch of no example: nothing to add (its edges carry empty sums)
            for r, _ in pending:
                r.from_edges = dict.fromkeys(st.pids.values(), False)
                r.buffered.clear()
            return
        uses = [_use(r.call, g, st.rule is vmap_rule) for r, g in pending]
        if len(uses) > 1 and not builtin(st.rule):
            uses = CheckedUses(uses)  # a user's rule must read every use
        self._in_rule = True
        try:
            pes = st.rule(st.module, uses, RuleContext(st.params))
        finally:
            self._in_rule = False
        if isinstance(uses, CheckedUses):
            uses.check(st.rule, f"{st.name or 'model'} ({type(st.module).__name__})")
        record = pending[0][0]
        if len(pending) == 1 and record.sums is not None and "weight" in pes:
            pes["weight"].on_block = record.sums.add  # the layer's backward sums them
        for local, p in st.params.items():
            pid = st.pids[local]
            pe = pes.get(local)
            if pe is None or pe.num_examples != n or tuple(pe.shape) != tuple(p.shape):
                got = "nothing" if pe is None else f"{pe.num_examples} x {tuple(pe.shape)}"
                raise GradkitError(
                    message(
                        f"per_example.track: the rule {st.rule.__name__}",
                        f"its result for {self._names[pid]!r}",
                        f"per-example gradients {n} x {tuple(p.shape)}",
                        got,
                        "fix the rule (check it against gradkit.testing.per_example_grads)",
                    )
                )
            mean_given = True
            if self._want.mean:
                # all uses read at the edges, or none (the rule's output then gives the sum)
                mean_given = all([self._decide_mean(r, pid) for r, _ in pending])
                for r, _ in pending:
                    r.from_edges[pid] = mean_given
                    buffered = r.buffered.pop(pid, None)
                    if mean_given and buffered is not None:
                        self._accs[pid].add_sum(1, buffered)
            if st.shared:
                self._deferred.setdefault(pid, []).append((pe, mean_given, self._scale(n)))
            else:
                self._add(pid, pe, mean_given, self._scale(n))

    def _add(self, pid: int, pe: PerExampleGrad, mean_given: bool, scale: float) -> None:
        acc = self._accs[pid]
        if self._chunk_size is not None:
            chunk = self._chunk_size
        else:
            per_example = max(1, pe.shape.numel()) * 4 * 4  # block, cast, power, temporaries
            chunk = max(1, self._max_memory // per_example)
        add_block(acc, pe, scale, self._want, mean_given=mean_given, chunk_size=chunk)

    def _finalize(self) -> None:
        self._callback_queued = False
        if not self._active:
            return
        for st in self._states:
            if st.pending:
                self._process(st)
            st.forward_count = 0
        deferred, self._deferred = self._deferred, {}
        done, self._done = {id(r) for r in self._done}, []
        sizes, self._sizes = self._sizes, {}
        reached, self._reached = self._reached, set()
        self._unbackwarded = 0
        if len(set(sizes.values())) > 1:
            raise disagree_error(list(sizes.items()))
        for record in self._records:
            if id(record) in done:
                record.release_graph()
            elif record.recomputed:  # non-reentrant checkpointing: its gradient went elsewhere
                record.release()
        self._records = [r for r in self._records if id(r) not in done and not r.recomputed]
        for pid, parts in deferred.items():
            pe = parts[0][0] if len(parts) == 1 else combine([p for p, _, _ in parts])
            given = all(g for _, g, _ in parts)
            self._add(pid, pe, given, parts[0][2])
        n = next(iter(sizes.values()), 0)
        for pid, acc in self._accs.items():  # not reached by this loss: 0 for each example
            if pid not in reached:
                acc.add_zeros(n, self._want)

    # -- results -------------------------------------------------------------------------------

    def _readable(self, call: str) -> None:
        """Refuse to read statistics inside the block while a model call waits for its
        backward pass: they would silently leave its examples out."""
        if self._active and self._unbackwarded:
            raise GradkitError(
                message(
                    call,
                    "the track block",
                    "a backward pass after every forward call of the model before reading",
                    f"{self._unbackwarded} forward call(s) of the model since the last backward "
                    "pass",
                    "call backward on their loss first (the statistics cover completed backward "
                    "passes only), or run forward calls you do not backpropagate under "
                    "torch.no_grad()",
                )
            )

    def __getitem__(self, name: str) -> ParamStats:
        for pid, n in self._names.items():
            if n == name and pid in self._accs:
                acc = self._accs[pid]
                return ParamStats(name, acc, self._want, self._unbiased, check=self._readable)
        tracked = [self._names[pid] for pid in self._accs]
        if isinstance(name, str) and name in self._frozen:
            why = f"no tracked parameter {name!r}: it did not require grad when track() was called"
        else:
            why = f"no tracked parameter {name!r}: the model has none of that name"
        raise KeyError(
            message(
                "stats[name]",
                "name",
                f"the name of a tracked parameter: {tracked}",
                why,
                "use a name from list(stats) (as in model.named_parameters())",
            )
        )

    def __iter__(self) -> Iterator[str]:
        return iter([self._names[pid] for pid in self._accs])

    def __len__(self) -> int:
        return len(self._accs)

    @property
    def num_examples(self) -> int:
        """Examples seen: the same for every parameter (one the loss of a backward pass did not
        reach counts that pass's examples, with gradient 0)."""
        counts = {acc.n for acc in self._accs.values()}
        return max(counts) if counts else 0

    def batch_l2(self) -> torch.Tensor:
        """``[N]``: ``||g_i||**2`` summed over all tracked parameters."""
        self._readable("batch_l2()")
        parts = [self[name].batch_l2 for name in self]
        sizes = {p.shape[0] for p in parts}
        if len(sizes) != 1:
            raise GradkitError(
                "per_example.track: batch_l2(): parameters saw different numbers "
                f"of examples {sorted(sizes)}; read stats[name].batch_l2 instead"
            )
        return torch.stack(
            [p.to(torch.float64 if p.dtype == torch.float64 else torch.float32) for p in parts]
        ).sum(0)

    def all_reduce(self, group: Any = None) -> None:
        """Merge the statistics of every rank of ``group`` (torch.distributed), in place.

        Sums are all-reduced; ``batch_l2`` and ``batch_grad`` are gathered in rank order.
        Every rank must call it, with the same tracked parameters and quantities.
        """
        if self._merged:
            raise GradkitError(
                message(
                    "stats.all_reduce(group)",
                    "stats",
                    "statistics not yet merged",
                    "a second call (the sums of every rank were already added)",
                    "call all_reduce once per track block",
                )
            )
        _dist.all_reduce_accs(list(self._accs.values()), self._want, group)
        self._merged = True

    def summary(self) -> str:
        """A per-parameter table: ``|mean|``, ``tr(var)``, gradient SNR and noise scale."""
        from gradkit.per_example._derived import summary_table

        self._readable("summary()")
        if self.num_examples == 0:
            raise GradkitError(
                message(
                    "stats.summary()",
                    "the track block",
                    "statistics of at least one example",
                    "0 examples",
                    "backpropagate inside the block first: with gradkit.per_example.track("
                    "model, ...) as stats: loss.backward()",
                )
            )
        return summary_table(self)


def _refuse_batchnorm(module: nn.Module, args: tuple[Any, ...]) -> None:
    if module.training:
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                "model",
                "layers that treat examples independently",
                f"{type(module).__name__} in training mode, which normalizes with statistics of "
                "the whole batch (each example's loss depends on every other example, and "
                "individual gradients are not defined)",
                "call model.eval() on it (running statistics), or convert the model with "
                "gradkit.per_example.replace_batchnorm(model) (GroupNorm instead: a change of "
                "the model, to be trained as such)",
            )
        )


def track(
    model: nn.Module,
    *quantities: str,
    moments: Sequence[int] = (),
    loss_reduction: str = "mean",
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
            ``Conv1D``) on sequences anyway (variance, second moment, moments, batch_grad),
            take that weight's gradient as their sum instead of multiplying again (about
            one product per such layer saved). ``p.grad`` of those weights then equals an
            untracked backward's up to float rounding (a sum over examples instead of one
            product); ``fuse=False`` keeps every ``p.grad`` bit-for-bit.

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
        a ``[T, N, d]`` tensor read with ``batch_dim=0`` when ``T == N`` cannot be told from
        an ``[N, T, d]`` one.
    """
    return Tracker(
        model,
        quantities,
        moments=moments,
        loss_reduction=loss_reduction,
        batch_dim=batch_dim,
        fallback=fallback,
        unbiased=unbiased,
        max_memory=max_memory,
        chunk_size=chunk_size,
        fuse=fuse,
    )

"""The :class:`Tracker` of a ``track`` block: its hooks and how they turn output gradients into
statistics inside the usual backward pass.

How it works, once per tracked module (a module with parameters of its own that require grad):

1. A forward hook keeps the module's inputs and installs a pre-hook on the node that computed
   its output (:func:`._capture.on_gradient`: it sees the gradient w.r.t. the output even when
   an in-place activation follows, where ``register_full_backward_hook`` breaks, and after any
   hook the model puts on the output; an output that is a view, as a Linear's on sequences, is
   hooked through its base: see :func:`._capture.hook_target`). It also finds,
   in the graph the forward just built, the edges through which the gradient reaches each
   parameter, and hooks them: the sum of the individual gradients of this pass (the mean) is
   read there, for free and exactly, without any term the loss adds outside the module (a
   weight-decay term, say).
2. When the output gradient arrives, the layer's rule (looked up along the MRO) turns inputs and
   output gradients into per-example gradients in factored or materialized form, and the
   requested statistics are accumulated. A module used several times in one forward (weight
   tying, recurrence) is processed once all its uses arrived, so its contributions are summed
   per example before any power is taken.
3. At the end of the backward pass (an engine callback) whatever is still pending is processed,
   per-example gradients kept (``batch_grad``) are written, after autograd's own products (a
   large block written in the middle of the pass evicts from the cache what the next layers'
   backward reads), and every tracked parameter the loss did not reach gets a zero gradient for
   each of the pass's examples (as one example at a time would give it). A pass that raised
   part-way never gets there (the engine drops the callback); the tracker then refuses every
   later pass and read, whose statistics would be partial.

At the first tracked output a backward pass reaches, before the gradient reaches any tracked
parameter (so a refused pass leaves ``p.grad`` as it was), the pass is checked: no layer it
will differentiate was split into another number of examples, all agree on ``N``, and the loss
does not certainly contradict ``loss_reduction`` (:func:`._layout.loss_reductions`).

Nothing is set on the model; ``p.grad`` is what it would be without tracking (bit-for-bit,
except the weights of Linear layers on sequences, summed from their per-example gradients: see
``fuse``). The hooks are removed on exit, also when the body raises; captured activations live
in the graph's hook closures and are freed with the graph.

Where each hook of :class:`Tracker` fires and what it may change:

======================  ===========================  ===================================
hook                     fires                        changes
======================  ===========================  ===================================
``_model_pre_hook``      before each model call       pushes a :class:`ModelCall`
``_forward_hook``        after each tracked module    appends a :class:`UseRecord`;
                         call (not inside a rule)     ``forward_count``; may replace the
                                                      output (fused Linear, a broadcast
                                                      output given the batch dimension)
``_model_hook``          after each model call        pops the model call; counts calls
                                                      awaiting a backward
``_on_output_grad``      the output gradient of a     checks the pass once
                         use arrives                  (``_start_backward``); queues the use
                                                      in ``pending``; runs the rule once
                                                      all uses arrived (``_process``)
``_edge_hook``           the gradient into a          the mean's sum (via :class:`EdgeMean`)
                         parameter's edge arrives
``_finalize``            end of each backward pass    processes what is pending, sums the
                         (engine callback)            uses of shared parameters, adds zeros
                                                      for parameters not reached, releases
                                                      the records' graph references
======================  ===========================  ===================================
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]
from torch.nn.utils.rnn import PackedSequence

from gradkit._errors import GradkitError, message
from gradkit._precision import full_float32, tf32
from gradkit._sharded import is_dtensor, refuse_fsdp1
from gradkit._validate import (
    check_bool,
    check_choice,
    check_int,
    check_module,
    check_number,
    check_optional_int,
    one_number,
)
from gradkit.per_example._batch import (
    ModelCall,
    apart_error,
    check_broadcast_consumers,
    counted_again_error,
    disagree_error,
    mismatch_error,
    mixed_error,
    out_of_order,
    row_order,
    split_call,
)
from gradkit.per_example._capture import (
    ModuleState,
    UseRecord,
    check_pass,
    check_still_trainable,
    hidden_view_error,
    hook_all,
    hook_target,
    in_backward,
    model_call,
    on_gradient,
    refuse_batchnorm,
    refuse_cached_parametrization,
    refuse_hook_before,
    refuse_substituted,
    rule_view,
)
from gradkit.per_example._edge_mean import EdgeMean
from gradkit.per_example._flat import flatten, unflatten
from gradkit.per_example._flat import leaves as flat_leaves
from gradkit.per_example._fused import WeightSum, fusable_call, fused_output
from gradkit.per_example._global_hooks import unwatch, watch
from gradkit.per_example._grads import Materialized, PerExampleGrad
from gradkit.per_example._layout import (
    backward_roots,
    call_layout,
    check_feature_dims,
    parse_batch_dim,
    scaled_mean,
)
from gradkit.per_example._plan import planned_modules
from gradkit.per_example._registry import CheckedUses, RuleContext, check_result
from gradkit.per_example._results import TrackerResults
from gradkit.per_example._stats import PowerSums, add_block, parse_want, statistics_dtype
from gradkit.per_example._sum import combine
from gradkit.per_example.rules import vmap_rule
from gradkit.per_example.rules._thirdparty import register_available

__all__ = ["Tracker"]


_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Tracker] = weakref.WeakKeyDictionary()
"""The tracker of every module hooked by an active track block."""
_GLOBAL_HOOKS = nn.modules.module._global_forward_hooks  # see ._global_hooks


def _read_by_rule(module: nn.Module) -> str | None:
    """The label of ``module`` where an active block's rule reads its output, else None."""
    tracker = _ACTIVE.get(module)
    if tracker is None or not tracker._active:
        return None
    for st in tracker._states:
        if st.module is module and st.rule is not vmap_rule:
            return st.label
    return None


def _parse_loss_scale(value: Any, call: str) -> float:
    """``track``'s ``loss_scale`` as a positive number (None: 1): a ``GradScaler``'s current
    scale, or the number given."""
    if value is None:
        return 1.0
    get_scale = getattr(value, "get_scale", None)
    scaler = False
    if callable(get_scale):
        value, scaler = get_scale(), True
    value = check_number(
        one_number(value),
        call,
        "loss_scale",
        low=0,
        low_open=True,
        example="scaler (a GradScaler) or 1/8",
    )
    # a GradScaler multiplies the loss by its float32 scale tensor; before its first scale()
    # get_scale() gives the init_scale as given (3.7, not float32's 3.700000047...: the
    # statistics of a float64 model 1.3e-8 off)
    return float(torch.tensor(value, dtype=torch.float32, device="cpu")) if scaler else value


def _named_parameters(modules: Mapping[str, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """``list(model.named_parameters())`` from ``dict(model.named_modules())``, without a second
    walk of the module tree (the same names, order and removal of duplicates)."""
    seen: set[int] = set()
    named = []
    for prefix, module in modules.items():
        for key, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            named.append((f"{prefix}.{key}" if prefix else key, p))
    return named


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, run eagerly (a graph break) when Dynamo traces the model: it records the call
    and hooks the graph autograd builds, which a compiled trace of it would not do.

    Where Dynamo is loaded (``torch.compile`` was called), the hook is wrapped by
    ``torch.compiler.disable`` once: about 0.4 us a call in eager mode (torch 2.13). A wrapper
    that disabled the hook only while compiling was itself compiled as a frame, one
    recompilation per module (its closure): a model of more than eight tracked modules hit
    Dynamo's recompile limit. Where it is not loaded, that wrapper is kept (a flag read per
    call): ``torch.compiler.disable`` imports Dynamo, 70 MiB of a process that never compiles,
    and a model compiled only later, inside the block, still gets its hooks run eagerly."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(hook)

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(hook)(*args, **kwargs)
        return hook(*args, **kwargs)

    return run


def _raised(flags: list[tuple[str, Any]]) -> list[str]:
    """The labels whose flag (``False``, ``True`` or a 0-dim tensor, read here: a host sync,
    with the statistics) is set; none set, the flags are dropped, as read."""
    labels = [label for label, flag in flags if bool(flag)]
    if not labels:
        flags.clear()
    return labels


class _PassEnd:
    """The engine callback that ends a backward pass (:meth:`Tracker._finalize`). The engine
    drops it unrun when the pass raises, so a weak reference to it that died while the tracker
    still waits for it tells that the pass ended part-way."""

    __slots__ = ("__weakref__", "tracker")

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def __call__(self) -> None:
        self.tracker._finalize()


def _summed(pe: PerExampleGrad) -> torch.Tensor:
    """``sum_n g_n`` of a rule's result (by its closed form, else over its blocks)."""
    total = pe.power_sum(1)
    if total is None:
        blocks = [b.sum(0) for b in pe.chunks(max(1, pe.num_examples))]
        total = blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)
    return total.detach()


def _differs(total: torch.Tensor, edge: torch.Tensor) -> torch.Tensor:
    """Whether a rule's sum ``total`` is not autograd's ``edge`` to rounding (a 0-dim bool
    tensor: no host sync): within 1e-3 of the larger magnitude in float32 and below, 1e-8 in
    float64 (different orders of summation)."""
    total = total.to(edge.dtype).reshape(edge.shape)
    rtol = 1e-8 if edge.dtype == torch.float64 else 1e-3
    scale = torch.maximum(edge.abs().max(), total.abs().max())
    return (total - edge).abs().max().gt(rtol * scale + torch.finfo(edge.dtype).tiny)


def _own_outputs(output: Any) -> Any:
    """``output`` with each tensor that requires grad replaced by a view of itself, for the
    fallback's module of several outputs. Where the module computed one output from another
    (CLIP's tower outputs beside the embeddings made from them, attention weights beside the
    attention's output), a hook on the first gets the gradient through the second too, and the
    fallback, re-running the module with both gradients, counted that path twice (2x and 3x per
    example on CLIP's layers). A view's hook gets only what reaches it from outside."""
    values, spec = flatten(output)
    return unflatten(
        [t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in values],
        spec,
    )


def _low_precision(outputs: Sequence[Any], module: nn.Module | None = None) -> bool:
    """Whether a call's backward products run below float32: its outputs in bf16/fp16
    (autocast or a low-precision model), or, on CUDA, float32 outputs whose products may run in
    TF32 (see :func:`gradkit._precision.tf32`: cuDNN's convolutions and RNNs by default, matmuls
    after ``set_float32_matmul_precision("high")``): 1e-3 relative, where float32 is 1e-7."""
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    if any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors):
        return True
    cuda32 = any(t.is_cuda and t.dtype == torch.float32 for t in tensors)
    return cuda32 and tf32(module)  # the module's subtree read once


class Tracker(TrackerResults):
    """The statistics of one ``track`` block: a mapping from parameter name to
    :class:`ParamStats`, plus totals over parameters. Created by :func:`track`.

    The capturing half lives here (the module docstring says where each hook fires and
    what it may change), the reading half in :class:`._results.TrackerResults`.
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: Sequence[str],
        *,
        moments: Sequence[int],
        loss_reduction: str,
        batch_dim: int | Mapping[str, int],
        loss_scale: Any = None,
        fallback: str,
        unbiased: bool,
        max_memory: int,
        chunk_size: int | None,
        fuse: bool = True,
    ) -> None:
        call = "per_example.track(model, ...)"
        check_module(model, call, "pass the model whose parameters to track")
        self._modules = modules = dict(model.named_modules())
        refuse_fsdp1(model, call, modules)
        self._want = parse_want(quantities, moments, call)
        self._loss_reduction = check_choice(loss_reduction, ("mean", "sum"), call, "loss_reduction")
        self._loss_scale = _parse_loss_scale(loss_scale, call)
        # False: any loss is read as a sum of per-example shares (a caller that rescales the
        # statistics itself, as GradientMonitor(scale_to_grad=True) does)
        self.verify_reduction = True
        # with verify_reduction False: a pass whose loss is a scaled mean (see
        # _layout.scaled_mean) is read as a mean, its shares times its examples
        self.read_means = False
        # True: a pass may go through calls an earlier pass counted, adding their examples
        # again (the exact curvature diagonals: one pass per column of a factor, summed)
        self.repeat_passes = False
        check_choice(fallback, ("vmap", "warn", "error"), call, "fallback")
        batch_dim, given_dims = parse_batch_dim(batch_dim, modules, call)
        check_bool(fuse, call, "fuse")
        check_bool(unbiased, call, "unbiased")
        check_int(max_memory, call, "max_memory", low=1, example="2**28 (bytes)")
        check_optional_int(
            chunk_size, call, "chunk_size", fix="pass e.g. chunk_size=64 (examples), or None"
        )
        self._fuse = fuse
        # the statistics materialize per-example gradients a fused layer can sum (see _fusable)
        self._materializes = fuse and bool(
            self._want.powers or "batch_grad" in self._want.quantities
        )
        self._batch_dim = batch_dim
        self._unbiased = unbiased
        self._max_memory = max_memory
        self._chunk_size = chunk_size
        self._model = model
        named = _named_parameters(modules)
        # (the mixin: UninitializedParameter's metaclass makes its isinstance a Python call)
        lazy = [n for n, p in named if isinstance(p, UninitializedTensorMixin)]
        if lazy:
            raise ValueError(
                message(
                    call,
                    "model",
                    "parameters with a shape (lazy layers materialized)",
                    f"{lazy[0]!r} uninitialized (a lazy layer, nn.LazyLinear, not run yet)"
                    + (f" and {len(lazy) - 1} more" if len(lazy) > 1 else ""),
                    "run the model once on a batch before track(), as an optimizer needs too",
                )
            )
        self._names = {id(p): n for n, p in named}
        self._params = {id(p): p for _, p in named}
        self._accs: dict[int, PowerSums] = {}
        register_available()  # rules for third-party layers whose library the user imported
        self._states = planned_modules(model, modules, batch_dim, given_dims, fallback, call)
        self._checked = {pid: self._names[pid] for st in self._states for pid in st.checked}
        # parameters whose uses outside their layers' calls cannot be followed (the vmap
        # fallback's, a user's rule's): refused in a pass through the graph of a gradient
        self._unchecked = {
            pid: self._names[pid]
            for st in self._states
            for pid in st.pids.values()
            if pid not in self._checked
        }
        self._left_out: frozenset[int] = frozenset()  # by the pass under way (_start_backward)
        for st in self._states:
            for pid in st.pids.values():
                param = self._params[pid]
                dtype = statistics_dtype(param.dtype)
                self._accs.setdefault(pid, PowerSums(param.shape, dtype, owner=param))
        self._tracked = {pid: self._params[pid] for pid in self._accs}
        self._pids = {self._names[pid]: pid for pid in self._accs}
        if not self._accs:
            total = len(self._params)
            raise ValueError(
                message(
                    call,
                    "model",
                    "a module with parameters that require grad",
                    f"{type(model).__name__} with {total} parameter(s), none requiring grad",
                    "unfreeze the parameters to track (p.requires_grad_(True))",
                )
            )
        self._frozen = {n for n, p in named if not p.requires_grad}
        self._handles: list[Any] = []
        self._active = False
        # the end-of-pass callback queued for the pass under way (None: none is)
        self._pass_end: weakref.ref[_PassEnd] | None = None
        self._broken = False  # a pass raised part-way: the statistics cannot be completed
        self._in_rule = False
        # (module, whether the fallback's re-runs missed its output): read with the statistics
        self._reruns: list[tuple[str, torch.Tensor]] = []
        self._records: list[UseRecord] = []  # uses whose graph references are still held
        self._builds_graph = False  # the pass under way runs with create_graph
        self._kept: set[int] = set()  # calls whose graph the last pass kept (create_graph)
        # a user's rule's sums over examples and its calls in this pass, checked at the pass's
        # end against the gradients autograd sent the parameters (_check_rule_sums)
        self._rule_sums: list[tuple[str, list[UseRecord], dict[int, torch.Tensor]]] = []
        # (rule of module, parameter, whether its sum missed autograd's): read with the stats
        self._rule_flags: list[tuple[str, str, torch.Tensor]] = []
        # (module, whether its input combined the examples' rows in different orders): read
        # with the statistics (see _check_mixed_rows)
        self._mixed_rows: list[tuple[str, Any]] = []
        self._done: list[UseRecord] = []  # uses processed in the current backward
        self._deferred: dict[int, list[tuple[PerExampleGrad, bool, float]]] = {}
        # per-example gradients kept (batch_grad) are written at the pass's end, after
        # autograd's own products: written in the middle, a large block evicts from the cache
        # the tensors the next layers' backward reads (0.2 ms of a 2.4 ms step on the demo CNN)
        self._later: list[tuple[int, PerExampleGrad, bool, float]] = []
        self._write_later = "batch_grad" in self._want.quantities
        # per-example results are read in the examples' order: check the rows reach each layer
        # in that order (see _check_row_order)
        self._in_order = bool({"batch_grad", "batch_l2"} & self._want.quantities)
        # statistics beyond the mean (whose sum over examples is p.grad, mixed or not) need
        # each layer's input rows to be single examples' (see _check_row_order)
        self._rows_walked = self._in_order or bool(self._want.powers)
        self._sizes: dict[str, int] = {}  # module -> batch size, in the current backward
        self._reached: set[int] = set()  # parameters reached in the current backward
        self._task: int | None = None  # the backward pass whose start was checked
        self._unbackwarded = 0  # model calls since the last backward pass
        self._merged = False  # all_reduce was called
        self._model_calls: list[ModelCall] = []  # the model calls under way
        self._cuda = False  # a tracked call ran on CUDA (see _precision.full_float32)
        # each pass's loss is a mean over its rows, maybe scaled (see _layout.scaled_mean), in
        # order: recorded with verify_reduction False (GradientMonitor reads it)
        # (None: a loss over one row, whose mean is its sum)
        self._pass_means: list[bool | None] = []

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> Tracker:
        call = "per_example.track(model, ...)"
        self._check_complete(call)
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
        for pid in self._accs:
            self._adapt(pid)  # the model may have been cast since track() was called
        for st in self._states:
            st.dtypes = {k: p.dtype for k, p in st.params.items()}
        self._active = True
        for st in self._states:
            _ACTIVE[st.module] = self
        if _GLOBAL_HOOKS:
            watch(_read_by_rule)
        try:
            eager = _eager
            for st in self._states:
                # a rule reads the layer's own output: its hook runs before the user's forward
                # hooks, which may replace that output (a hook returning 2 * output made the
                # per-example gradients of a Linear silently wrong). The fallback re-runs the
                # module with its hooks, so it reads the output they leave.
                hook = eager(self._forward_hook(st))
                first = st.rule is not vmap_rule
                handle = st.module.register_forward_hook(hook, with_kwargs=True, prepend=first)
                self._handles.append(handle)
                st.hook_id = handle.id if first else None
            self._handles.append(
                self._model.register_forward_pre_hook(eager(self._model_pre_hook), with_kwargs=True)
            )
            self._handles.append(
                self._model.register_forward_hook(
                    eager(self._model_hook), with_kwargs=True, always_call=True
                )
            )
            for name, module in self._modules.items():
                if isinstance(module, _BatchNorm):
                    refuse = functools.partial(refuse_batchnorm, name=name)
                    self._handles.append(module.register_forward_pre_hook(refuse))
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
        if not _ACTIVE and _GLOBAL_HOOKS:
            unwatch()
        self._unbackwarded = 0
        self._reached.clear()
        self._model_calls.clear()
        self._sizes.clear()
        self._later.clear()
        for st in self._states:
            st.pending.clear()
            st.forward_count = 0
        for record in self._records:  # uses never backwarded: break their graph cycles
            record.release()
        self._records.clear()

    # -- capture -------------------------------------------------------------------------------

    def _model_pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._check_complete("per_example.track(model, ...)")
        if _GLOBAL_HOOKS:  # registered inside the block
            watch(_read_by_rule)
        self._model_calls.append(model_call(args, kwargs, self._batch_dim))

    def _model_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        model_call = self._model_calls.pop() if self._model_calls else None
        n = model_call.n if model_call is not None else None
        failed = sys.exc_info()[1]
        if model_call is not None and failed is None:
            check_broadcast_consumers(output, model_call)
            if model_call.uses and not in_backward():
                self._unbackwarded += 1
        reshaped = [
            f"{label} ({'none' if call.mode == 'unbatched' else 'a batch dimension of 1'})"
            for call, _, _, label in (model_call.expanded if model_call else [])
        ]
        if failed is not None and reshaped and hasattr(failed, "add_note"):
            failed.add_note(
                "per_example.track expanded the outputs of these modules to a batch dimension "
                f"of {n} examples, as they had none or one of size 1: "
                + ", ".join(reshaped)
                + ". A model that does not broadcast such an output over its examples as they "
                "are (e.g. it adds it to [examples * windows, ...] rows) cannot be split by "
                "example there: freeze its parameters (requires_grad_(False)) or give its "
                "inputs the batch dimension; where the module holds the examples in another "
                "dimension than batch_dim (a sequence-first block, whose dimension 0 can have 1 "
                "entry: Longformer's global tokens), pass batch_dim={its name or its block's: "
                "that dimension}"
            )

    def _forward_hook(self, st: ModuleState) -> Any:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            leaves = flat_leaves(output)
            live = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if self._in_rule or not live:
                return None  # a rule re-running the forward (vmap fallback), or no backward
            own = module._parameters
            for k, p in st.params.items():  # frozen or cast since the block began
                if not p.requires_grad or p.dtype is not st.dtypes[k]:
                    check_still_trainable(st)
                    self._recast(st)
                # substituted for the call or removed (FSDP2 gathers its sharded parameters:
                # its own); a fallback's dotted names are its children's
                held = own.get(k)
                if held is not p and (held is not None or "." not in k) and not is_dtensor(p):
                    refuse_substituted(st, k, held)
            if st.hook_id is not None and next(iter(module._forward_hooks)) != st.hook_id:
                refuse_hook_before(st)
            if st.parametrized:
                refuse_cached_parametrization(st)
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
            sums = None
            if call.mode == "batched" and st.fusion is not None and self._fusable(st, args, output):
                sums = WeightSum()
                replacement = fused_output(st.fusion, module, args[0], output, sums)
                if replacement is None:
                    sums = None
            if replacement is None and st.rule is vmap_rule and len(live) > 1:
                replacement = _own_outputs(output)
            if replacement is not None:
                if call.mode in ("broadcast", "unbatched"):
                    for old, new, d in zip(
                        flat_leaves(output),
                        flat_leaves(replacement),
                        call.out_dims,
                        strict=True,
                    ):
                        if new is not old and isinstance(new, torch.Tensor) and d is not None:
                            expanded = (call, new.grad_fn, d, st.label)
                            self._model_calls[-1].expanded.append(expanded)
                output = replacement
                leaves = flat_leaves(output)
                live = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if call.mode == "merged" and isinstance(output, torch.Tensor):
                self._model_calls[-1].merged[output.grad_fn] = call.positions
            elif call.mode == "batched" and self._model_calls:
                # per-example results: the rows must be the examples, in their order
                walked = self._rows_walked
                order = self._check_row_order(st, args, kwargs, layout) if walked else None
                # where later layers' inputs come from (moved_batch): the examples' dimension
                model_call = self._model_calls[-1]
                for t, d in zip(leaves, call.out_dims, strict=False):
                    if d is not None and isinstance(t, torch.Tensor) and t.grad_fn is not None:
                        model_call.dims[t.grad_fn] = (d, st.label)
                        if order is not None:
                            model_call.row_orders[t.grad_fn] = order
                        if call.made_inside:  # checked at the model call's end
                            model_call.coincident.append((call, t.grad_fn, d, st.label))
                        if model_call.expanded or model_call.coincident:
                            model_call.call_inputs[t.grad_fn] = [
                                a.grad_fn
                                for a in flat_leaves((args, kwargs))
                                if isinstance(a, torch.Tensor) and a.grad_fn is not None
                            ]
            params = {st.pids[k]: p for k, p in st.params.items()}
            # the sum of the gradients at the edges is autograd's product, in the layer's
            # precision: under bf16/fp16 it is rounded there (4e-3 relative), while the second
            # moment comes from per-example products in float32, and E[g^2] - mean^2 then mixes
            # the two (a variance 3.9x off at an SNR of 500). Such a call's mean is the rule's.
            low = _low_precision(live, module)
            self._cuda = self._cuda or any(t.is_cuda for t in live)
            at_edges = self._want.mean and not low
            mean = EdgeMean.find(params, (args, kwargs), live) if at_edges else EdgeMean()
            if at_edges and mean.casts():
                # a parameter cast inside the module (Gemma's RMSNorm computes in float32 in a
                # float64 model: weight.float()): the edge sum has the cast's precision, the
                # second moment the per-example products' (variance entries 1.9x off, some
                # clamped to 0). The rule's per-example gradients give the sum instead.
                mean = EdgeMean()
            hooked, base = hook_target(output) if isinstance(output, torch.Tensor) else (None, None)
            record = UseRecord(
                call,
                sums,
                mean,
                recomputed=in_backward(),
                label=st.label,
                nodes=[
                    t.grad_fn
                    for t in ([hooked] if hooked is not None else live)
                    if t.grad_fn is not None
                ],
                checked=st.checked,
                pids=tuple(st.pids.values()),
                base=base,
            )
            if any(pid in self._unchecked for pid in record.pids):  # see check_pass
                record.inputs = [
                    a.grad_fn
                    for a in flat_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and a.grad_fn is not None
                ]
            self._records.append(record)
            st.forward_count += 1
            if isinstance(output, torch.Tensor) and hooked is not None:
                self._hook_output(st, record, output, hooked)
            else:  # several outputs (e.g. an RNN's output and state): all their gradients at once
                ids = [id(t) for t in live]

                def on_grads(grads: Sequence[torch.Tensor | None]) -> None:
                    by_id = dict(zip(ids, grads, strict=True))
                    self._on_output_grad(st, record, [by_id.get(id(t)) for t in leaves])

                hook_all(live, on_grads)
            for node, ks in mean.by_node().items():  # read the mean there
                node.register_hook(self._edge_hook(record, ks))
            if not st.builtin and not low:
                # a user's rule: the gradient this call sends each parameter, to check the
                # rule's per-example sum against at the pass's end (see _compare_rule_sums)
                edges = mean if at_edges else EdgeMean.find(params, (args, kwargs), live)
                record.verify = {}
                for node, ks in edges.by_node().items():
                    node.register_hook(self._verify_hook(record, ks))
            return replacement

        return hook

    def _adapt(self, pid: int) -> bool:
        """Give ``pid``'s statistics its parameter's shape and precision if none were added yet
        (True), else say whether they already have them."""
        acc, param = self._accs[pid], self._params[pid]
        dtype = statistics_dtype(param.dtype)
        if acc.n == 0:
            acc.shape, acc.dtype = param.shape, dtype
            return True
        return acc.dtype == dtype

    def _recast(self, st: ModuleState) -> None:
        """A parameter of ``st`` was cast inside the block (``model.double()``): its statistics
        take the new precision if they hold no example yet; mixing precisions is refused (the
        statistics of a float64 model kept in float32 were 3e-8 off, silently)."""
        for local, p in st.params.items():
            if not self._adapt(st.pids[local]):
                name = f"{st.name}.{local}" if st.name else local
                raise GradkitError(
                    message(
                        "per_example.track(model, ...)",
                        f"parameter {name!r}",
                        f"the precision it had when its statistics began "
                        f"({self._accs[st.pids[local]].dtype})",
                        f"{p.dtype}: the model was cast inside the block, after a backward "
                        "pass added statistics",
                        "cast the model before the track block (or before its first backward "
                        "pass), or start a new block after the cast",
                    )
                )
        st.dtypes = {k: p.dtype for k, p in st.params.items()}

    def _check_row_order(
        self, st: ModuleState, args: tuple[Any, ...], kwargs: dict[str, Any], layout: Any
    ) -> Any:
        """The order in which a call's input rows hold the model's examples
        (:func:`._batch.row_order`; None: in order). Out of order, its parameters' per-example
        results are refused when read (a flag, no host sync here). Rows that mix the examples
        (an operation across the batch between tracked calls) are refused here, for every
        statistic but the mean."""
        model = self._model_calls[-1]
        simple = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
        if simple and layout.inputs == [0]:  # the usual call: one input, examples first
            orders = [row_order(args[0].grad_fn, 0, model, args[0].device)]
        else:
            orders = self._input_orders(args, kwargs, layout, model, simple)
        if model.apart:
            raise apart_error(st.label, model.apart)
        if model.mixed:
            raise mixed_error(st.label, model.mixed)
        if model.mixed_rows:  # read with the statistics (no host sync here)
            self._mixed_rows.extend((st.label, flag) for flag in model.mixed_rows)
            model.mixed_rows.clear()
        if not self._in_order:
            return None
        moved = [o for o in orders if o is not None]
        order = None if not moved else (moved[0] if len(moved) == 1 else True)
        flag = out_of_order(order, model.n)
        if flag is not False:
            for pid in st.pids.values():
                self._accs[pid].reordered.append((st.label, flag))
        return order

    def _input_orders(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        layout: Any,
        model: ModelCall,
        simple: bool,
    ) -> list[Any]:
        """:func:`._batch.row_order` of each input of a call that holds the examples."""
        orders = []
        for value in () if simple else (*args, *kwargs.values()):
            if isinstance(value, PackedSequence) and value.unsorted_indices is not None:
                index = value.unsorted_indices
                model.unsorts.add((index.data_ptr(), index.numel()))
            if isinstance(value, PackedSequence) and value.data.grad_fn is not None:
                # its rows, as the rules read them: unsorted back where it was sorted
                start, dim, first = value.data.grad_fn, 0, value.unsorted_indices
                orders.append(row_order(start, dim, model, value.data.device, first))
        leaves = args if simple else flat_leaves((args, kwargs))
        for t, d in zip(leaves, layout.inputs, strict=False):
            if d is not None and isinstance(t, torch.Tensor) and t.grad_fn is not None:
                orders.append(row_order(t.grad_fn, d, model, t.device))
        return orders

    def _hook_output(
        self, st: ModuleState, record: UseRecord, output: torch.Tensor, hooked: torch.Tensor
    ) -> None:
        """Hook ``hooked`` (``output``, or its base: :func:`._capture.hook_target`) for the
        gradient w.r.t. ``output``."""
        if hooked is output:
            on_gradient(output, lambda g: self._on_output_grad(st, record, [g]))
            if record.base is not None:  # a view of part of a tensor: read before its base
                base = output._base
                assert base is not None
                base.register_hook(lambda g: self._check_read(record))
        else:  # the base of a view of all of it: its gradient, viewed
            shape = output.shape
            on_gradient(hooked, lambda g: self._on_output_grad(st, record, [g.reshape(shape)]))

    def _fusable(self, st: ModuleState, args: tuple[Any, ...], output: Any) -> bool:
        """Whether this call's weight gradient can be summed from the per-example gradients
        the statistics will materialize (a Linear on sequences, a convolution: see
        :mod:`._fused`)."""
        if not self._materializes or st.fusion is None or st.shared or st.batch_dim != 0:
            return False
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return False
        if not (output.requires_grad and torch.is_grad_enabled()):
            return False
        weight = st.params["weight"]
        if not fusable_call(st.fusion, x, weight, output):  # shapes only: asked first
            return False
        if _low_precision([output], st.module):  # autograd's product: p.grad as untracked
            return False
        return not is_dtensor(weight)  # FSDP2: the forward used its own gathered weight

    def _scale(self, n: int) -> float:
        """The factor from the gradients reaching a call of ``n`` examples to their ``g_i``
        (every statistic goes through it)."""
        mean = self._loss_reduction == "mean" or (
            self.read_means and bool(self._pass_means) and self._pass_means[-1]  # this pass's
        )
        share = float(n) if mean else 1.0
        return share / self._loss_scale

    def _edge_hook(self, record: UseRecord, ks: list[tuple[int, int]]) -> Any:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> None:
            if not self._active:
                return
            scale = self._scale(record.call.n)
            for k, pid in ks:
                g = grad_inputs[k]
                if g is not None and pid not in self._left_out:
                    now = record.mean.on_edge(pid, g, scale)
                    if now is not None:
                        self._accs[pid].add_sum(1, now, alpha=scale)

        return hook

    def _verify_hook(self, record: UseRecord, ks: list[tuple[int, int]]) -> Any:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> None:
            if not self._active or record.verify is None:
                return
            for k, pid in ks:
                g = grad_inputs[k]
                if g is not None:
                    g = g.detach().to_dense() if g.is_sparse else g.detach()
                    prev = record.verify.get(pid)
                    record.verify[pid] = g.clone() if prev is None else prev + g

        return hook

    def _on_output_grad(
        self, st: ModuleState, record: UseRecord, grads: list[torch.Tensor | None]
    ) -> None:
        if not self._active:
            return
        record.arrivals += 1
        self._start_backward()
        counts = not self._left_out.issuperset(st.pids.values())
        if record.counted and counts and not self.repeat_passes:
            raise counted_again_error(record.label)
        if torch.is_grad_enabled():  # create_graph: this pass builds a graph through the layer
            self._builds_graph = True
        call = record.call
        if call.mode == "mismatch" and any(g is not None for g in grads):
            raise mismatch_error([f"{record.label} {call.problem}"])
        leaves: list[Any] = []
        for g, d, added in zip(grads, call.out_dims, call.added, strict=True):
            if g is not None:
                if g.requires_grad:  # create_graph (an op per call saved otherwise)
                    g = g.detach()
                if call.positions > 1:  # [N * T, ...] -> [N, T, ...]
                    g = g.reshape(call.n, call.positions, *g.shape[1:])
                elif call.in_dims or added or d is None or d == 0:  # the fallback: as it is
                    pass
                else:
                    g = g.movedim(d, 0)
            leaves.append(g)
        st.pending.append((record, leaves))
        if self._pass_end is None:
            end = _PassEnd(self)
            self._pass_end = weakref.ref(end)
            torch.autograd.Variable._execution_engine.queue_callback(end)
        if not st.shared and len(st.pending) == st.forward_count:
            self._process(st)

    def _check_read(self, record: UseRecord) -> None:
        """At the base of a call's output that is a view of part of it: the view's own
        gradient must have arrived before (see :func:`._capture.hook_target`)."""
        if not self._active:
            return
        record.base_visits += 1
        if record.base_visits > record.arrivals:
            raise hidden_view_error([record.label])

    # -- checks at the start of a backward pass, before any gradient is accumulated -------------

    def _start_backward(self) -> None:
        """Once per backward pass, at the first tracked output it reaches (before the gradient
        reaches any tracked parameter, so a refused pass leaves every ``p.grad`` as it was):
        refuse what would give wrong statistics, and find the parameters whose gradient the
        pass does not compute (:func:`._capture.check_pass`): it adds nothing to theirs."""
        self._check_complete("per_example.track(model, ...)")
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
        roots = backward_roots()
        if not self.verify_reduction:  # any loss read as shares: the monitor asks about it
            self._pass_means.append(scaled_mean(roots))
        self._left_out = check_pass(
            self._records,
            self._loss_reduction if self.verify_reduction else None,
            self._checked,
            self._tracked,
            roots,
            kept=self._kept,
            unchecked=self._unchecked,
        )

    # -- processing ----------------------------------------------------------------------------

    def _process(self, st: ModuleState) -> None:
        if not self._cuda:
            self._process_pending(st)
            return
        with full_float32(True):
            self._process_pending(st)

    def _process_pending(self, st: ModuleState) -> None:
        pending, st.pending = st.pending, []
        ns = {r.call.n for r, _ in pending}
        if len(ns) != 1:
            raise disagree_error([(st.label, k) for k in sorted(ns)])
        n = ns.pop()
        self._sizes[st.name or "model"] = n
        self._done.extend(r for r, _ in pending)
        if not self._builds_graph and not self._left_out.issuperset(st.pids.values()):
            for r, _ in pending:
                r.counted = True
        self._reached.update(st.pids.values())
        if n == 0:  # a batch of no example: nothing to add (its edges carry empty sums)
            for r, _ in pending:
                for pid in st.pids.values():
                    r.mean.settle(pid, False)
            return
        uses = [rule_view(r.call, g, st.rule is vmap_rule) for r, g in pending]
        if len(uses) > 1 and not st.builtin:
            uses = CheckedUses(uses)  # a user's rule must read every use
        self._in_rule = True
        ctx = RuleContext(st.params)
        try:
            pes = st.rule(st.module, uses, ctx)
        except Exception as error:  # a rule's refusal names the class, the note the module
            if hasattr(error, "add_note"):
                error.add_note(f"(raised by the per-example rule of {st.label})")
            raise
        finally:
            self._in_rule = False
        if ctx.reruns:
            self._reruns.append((st.label, torch.stack(ctx.reruns).any()))
        if isinstance(uses, CheckedUses):
            uses.check(st.rule, st.label)
        if not st.builtin:  # gradkit's own rules are tested to return what the loop reads
            grad = uses[0].grad_output
            floating = isinstance(grad, torch.Tensor) and grad.is_floating_point()
            dtype = grad.dtype if floating else None
            check_result(st.rule, pes, st.module, st.params, st.label, dtype)
        if not st.builtin and all(r.verify is not None for r, _ in pending):
            # before the statistics use the blocks (they may square them in place)
            sums = {
                st.pids[k]: _summed(pes[k])
                for k in st.params
                if k in pes and st.pids[k] not in self._left_out
            }
            self._rule_sums.append((st.label, [r for r, _ in pending], sums))
        record = pending[0][0]
        if len(pending) == 1 and record.sums is not None and "weight" in pes:
            pes["weight"].on_block = record.sums.add  # the layer's backward sums them
            bias = pes.get("bias")
            if isinstance(bias, Materialized):  # summed over positions: N rows to add
                record.sums.bias = bias.grads.sum(0)  # before the statistics square them
        left_out = self._left_out
        for local, p in st.params.items():
            pid = st.pids[local]
            if pid in left_out:  # this pass does not compute its gradient
                for r, _ in pending:
                    r.mean.settle(pid, False)
                continue
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
                mean_given = all([r.mean.readable(pid) for r, _ in pending])
                for r, _ in pending:
                    buffered = r.mean.settle(pid, mean_given)
                    if buffered is not None:  # a fresh sum (EdgeMean.on_edge)
                        self._accs[pid].add_sum(1, buffered, owned=True)
            if st.shared:
                self._deferred.setdefault(pid, []).append((pe, mean_given, self._scale(n)))
            elif self._write_later and pe.on_block is None:
                self._later.append((pid, pe, mean_given, self._scale(n)))
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

    def _compare_rule_sums(self) -> None:
        """At a pass's end, when every edge has delivered: flag each parameter of a user's rule
        whose per-example gradients do not sum to the gradient autograd sent it (a factor, a
        use left out); the flags are read with the statistics (no host sync here)."""
        checks, self._rule_sums = self._rule_sums, []
        for label, records, sums in checks:
            for pid, total in sums.items():
                parts = [r.verify.get(pid) for r in records if r.verify is not None]
                edges = [p for p in parts if p is not None]
                if edges and len(edges) == len(records):  # every call's gradient arrived
                    edge = edges[0] if len(edges) == 1 else torch.stack(edges).sum(0)
                    self._rule_flags.append((label, self._names[pid], _differs(total, edge)))
            for r in records:
                if r.verify is not None:
                    r.verify = {}

    def _check_rule_sums(self, call: str) -> None:
        """Refuse statistics where a user's rule's per-example gradients did not sum to what
        autograd computed for the parameter (see :meth:`_compare_rule_sums`)."""
        if not self._rule_flags:
            return
        wrong = [
            f"{name!r} of {label}" for label, name, differs in self._rule_flags if bool(differs)
        ]
        if not wrong:
            self._rule_flags.clear()
            return
        raise GradkitError(
            message(
                call,
                "model",
                "per-example gradients from each registered rule that sum, over the examples, "
                "to the gradient autograd computes for the parameter",
                ", ".join(dict.fromkeys(wrong)) + ": the rule's per-example gradients sum to "
                "something else (a factor, a use or a term left out)",
                "fix the rule (check it against gradkit.testing.per_example_grads)",
            )
        )

    def _check_reruns(self, call: str) -> None:
        """Refuse statistics where the fallback re-ran a module example by example and did not
        get the batch's output back (its flags, kept per backward pass, are read here, with
        the statistics: the backward never waits for the device)."""
        labels = _raised(self._reruns)
        if not labels:
            return
        raise GradkitError(
            message(
                call,
                "model",
                "modules that give each example the output they give it in the batch",
                ", ".join(dict.fromkeys(labels)) + ": re-run on each example alone (the exact "
                "fallback), it did not reproduce that example's part of the batch's output. "
                "It mixes examples, or it was given a tensor shared by every example (a mask "
                "or a table) with as many rows as there are examples, which was split as if "
                "it held them, or a forward pre-hook on it changes its inputs (the re-runs "
                "pass it the inputs the hook already changed, and the hook runs again)",
                "give such a shared tensor another shape (e.g. a leading dimension of 1), "
                "move such a hook to a module around it, register a rule for the module "
                "(@gradkit.per_example.register_rule), or freeze its parameters "
                "(requires_grad_(False)) to track the rest",
            )
        )

    def _check_mixed_rows(self, call: str) -> None:
        """Refuse statistics where a tracked call's input combined the rows of earlier
        calls' outputs in different orders (manifold mixup: ``0.7 * h + 0.3 * h[perm]``): each
        such row holds several examples' activations, so the layers before it have no
        individual gradients. The flags are read here, with the statistics."""
        labels = _raised(self._mixed_rows)
        if not labels:
            return
        raise GradkitError(
            message(
                call,
                "model",
                "layers whose input rows each hold one example's activations",
                f"the input of {', '.join(dict.fromkeys(labels))} combining the rows of earlier "
                "layers' outputs in different orders (as manifold mixup does: "
                "a * h + b * h[perm]): its rows mix several examples, whose individual "
                "gradients the layers before it do not have",
                "mix the model's inputs instead of its hidden rows, freeze the layers before "
                "the mixing (requires_grad_(False)) to track the rest, or track only 'mean'",
            )
        )

    def _check_complete(self, call: str) -> None:
        """Refuse to go on after a backward pass that raised once it had reached a tracked
        layer (a rule's error, an error in another hook or node, out of memory): part of that
        pass's gradients are in the statistics and the rest never will be, so every later
        pass and read would be silently off."""
        if not self._broken and self._pass_end is not None:
            # dropped unrun: the pass raised; or still held (on CUDA the engine may keep a
            # raised pass's callbacks a while) but no backward pass is running any more
            self._broken = self._pass_end() is None or not in_backward()
        if self._broken:
            raise GradkitError(
                message(
                    call,
                    "the track block",
                    "backward passes that run to their end",
                    "a backward pass that raised part-way, after some of its per-example "
                    "gradients were added to the statistics (they would leave out the rest of "
                    "that pass's gradients)",
                    "start a new track block: this one's statistics cannot be completed (to "
                    "skip a batch, catch its error outside the block)",
                )
            )

    def _check_modules_kept(self, unreached: set[int]) -> None:
        """Refuse a pass that left out a tracked module because the model no longer holds it
        (replaced inside the block: the hooks are on the module the block began with, so its
        replacement would get no statistics and the module replaced a 0 for every example)."""
        for st in self._states:
            if unreached.isdisjoint(st.pids.values()):
                continue
            try:
                now = self._model.get_submodule(st.name) if st.name else self._model
            except AttributeError:
                now = None
            if now is not st.module:
                got = "removed" if now is None else f"replaced by another {type(now).__name__}"
                raise GradkitError(
                    message(
                        "per_example.track(model, ...)",
                        "model",
                        "the modules the track block began with (its hooks are on them)",
                        f"{st.label} {got} inside the block: the new module's parameters "
                        "would get no statistics, and the old one's a 0 for every example",
                        "start a new track block after changing the model's modules",
                    )
                )

    def _finalize(self) -> None:
        self._pass_end = None
        if not self._active:
            return
        try:
            self._end_pass()
        except BaseException:
            self._broken = True
            raise

    def _end_pass(self) -> None:
        for st in self._states:
            if st.pending:
                self._process(st)
            st.forward_count = 0
        self._compare_rule_sums()
        later, self._later = self._later, []
        deferred, self._deferred = self._deferred, {}
        done, self._done = {id(r) for r in self._done}, []
        sizes, self._sizes = self._sizes, {}
        reached, self._reached = self._reached, set()
        self._unbackwarded = 0
        if len(set(sizes.values())) > 1:
            raise disagree_error(list(sizes.items()))
        # a pass with create_graph built a graph of the gradient that uses the weights outside
        # their layers' calls (a gradient penalty differentiates it): its calls keep their
        # graph references, so that a later pass through that graph is checked (see
        # check_pass) instead of silently missing those uses. They are released when a pass
        # goes through them, when the next graph-building pass ends (a loop of such steps
        # holds one step's graph, not every step's), or with the block.
        keep, self._builds_graph = self._builds_graph, False
        if keep:
            dropped, self._kept = self._kept - done, set(done)
        else:
            dropped, self._kept = set(), self._kept - done
        for record in self._records:
            if id(record) in done:
                if keep:
                    record.mean.undecide()
                else:
                    record.release_graph()
            elif id(record) in dropped:
                record.release_graph()
            elif record.recomputed:  # non-reentrant checkpointing: its gradient went elsewhere
                record.release()
        self._records = [
            r
            for r in self._records
            if (id(r) in self._kept or id(r) not in done | dropped) and not r.recomputed
        ]
        later.sort(key=lambda item: item[1].shape.numel())  # the largest blocks last
        if not self._cuda:
            self._add_later(later, deferred)
        else:
            with full_float32(True):
                self._add_later(later, deferred)
        n = next(iter(sizes.values()), 0)
        left_out = self._left_out
        unreached = [pid for pid in self._accs if pid not in reached and pid not in left_out]
        if unreached and n:
            self._check_modules_kept(set(unreached))
        for pid in unreached:  # not reached by this loss: 0 for each example
            self._accs[pid].add_zeros(n, self._want)

    def _add_later(
        self,
        later: list[tuple[int, PerExampleGrad, bool, float]],
        deferred: dict[int, list[tuple[PerExampleGrad, bool, float]]],
    ) -> None:
        """Add the per-example gradients kept for the pass's end (``batch_grad``) and those of
        parameters shared by several modules (combined per example first)."""
        for args in later:
            self._add(*args)
        for pid, parts in deferred.items():
            pe = parts[0][0] if len(parts) == 1 else combine([p for p, _, _ in parts])
            given = all(g for _, g, _ in parts)
            if not given and any(g for _, g, _ in parts):
                # a weight tied across modules whose uses differ (an embedding read at its
                # edges, its tied head under autocast not): the sum of the combined gradients
                # would count the first again (0.67 off); only the others' sums are added
                for part, part_given, scale in parts:
                    if not part_given:
                        self._accs[pid].add_sum(1, _summed(part), alpha=scale)
                given = True
            self._add(pid, pe, given, parts[0][2])

    # -- results -------------------------------------------------------------------------------

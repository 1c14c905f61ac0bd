"""What ``track`` captures in the forward pass: which modules it tracks with which rule, and
for every call of a tracked module its inputs, layout and graph edges.

:func:`tracked_modules` decides once per ``track()`` call, :class:`UseRecord` holds one module
call until its backward is over (the tracker's hooks fill and read it, see :mod:`._track`).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.nn.utils.rnn import PackedSequence

from gradkit._autograd import edges_into
from gradkit._errors import GradkitError, message
from gradkit.per_example._batch import Call, Dims, ModelCall, disagree_error, mismatch_error
from gradkit.per_example._edge_mean import EdgeMean, will_execute
from gradkit.per_example._flat import leaves as flat_leaves
from gradkit.per_example._flat import unflatten
from gradkit.per_example._fused import WeightSum
from gradkit.per_example._layout import check_loss_reduction
from gradkit.per_example._outside import (
    check_outside_uses,
    check_uncalled,
    check_uses_outside_calls,
    checked_module,
)
from gradkit.per_example._registry import (
    Use,
    _parametrized,
    builtin,
    find_rule,
    power_iteration,
    reparametrized,
)
from gradkit.per_example.rules import vmap_rule
from gradkit.per_example.rules._thirdparty import unsplittable

__all__ = [
    "ModuleState",
    "UseRecord",
    "check_pass",
    "check_still_trainable",
    "hidden_view_error",
    "hook_all",
    "hook_target",
    "in_backward",
    "model_call",
    "on_gradient",
    "refuse_batchnorm",
    "refuse_cached_parametrization",
    "refuse_hook_before",
    "refuse_substituted",
    "rule_view",
    "tracked_modules",
]


@dataclass
class UseRecord:
    """One call of a tracked module, from its forward until its backward is over."""

    call: Call
    sums: WeightSum | None  # the weight gradient summed from the statistics' blocks
    mean: EdgeMean  # the edges into its parameters, where the mean is read
    recomputed: bool = False  # a forward run inside a backward (activation checkpointing)
    label: str = ""  # "name (Class)" of the module
    nodes: list[Node] = field(default_factory=list)  # the graph nodes of its outputs
    checked: tuple[int, ...] = ()  # ids of its parameters whose other uses are refused
    pids: tuple[int, ...] = ()  # ids of all its tracked parameters
    # the graph nodes of its inputs, where a walk of the call's own graph stops (kept for
    # modules whose other uses are found that way: the vmap fallback's, a user's rule's)
    inputs: list[Node] = field(default_factory=list)
    base: Node | None = None  # the base's node of an output that is a view of part of it
    arrivals: int = 0  # output gradients received (backward passes through this call)
    # a pass that built no graph added this call's examples to its parameters' statistics: a
    # later pass through it (retain_graph=True) would count them again
    counted: bool = False
    base_visits: int = 0  # of those, gradients of the base of a partial view (hook_target)
    # a user's rule is checked against autograd: the gradient its call sent into each
    # parameter in this pass (see Tracker._verify_hook), None when not checked
    verify: dict[int, torch.Tensor] | None = None

    def release_graph(self) -> None:
        """Drop the references to graph nodes once this backward has read them. The record
        lives in hooks on the graph's own nodes, so a node kept here would make a cycle
        through C++ that Python's garbage collector cannot see (the tracker, its results and
        the inputs would leak). A later backward through a retained graph then takes the mean
        from the rule's output instead of the edges."""
        self.mean.release()
        self.verify = None
        self.nodes = []
        self.inputs = []
        self.base = None
        self.call.output = None  # an expanded output holds the hook that holds this record
        self.sums = None

    def release(self) -> None:
        """Drop everything (the tracker is closed)."""
        self.release_graph()
        self.call.args, self.call.kwargs = (), {}


@dataclass
class ModuleState:
    """A tracked module: its rule, its own parameters and the uses awaiting processing."""

    name: str
    module: nn.Module
    rule: Any
    params: dict[str, torch.Tensor]  # local name -> parameter
    pids: dict[str, int]  # local name -> id(parameter)
    batch_dim: int  # of its inputs and outputs (see inner_batch_dims)
    fusion: str | None = None  # how its weight gradient may be summed (see _fused)
    shared: bool = False  # a parameter of it is also another tracked module's
    checked: tuple[int, ...] = ()  # ids of its parameters whose uses outside it are refused
    parametrized: bool = False  # torch.nn.utils.parametrize computes its weight at each call
    forward_count: int = 0
    hook_id: int | None = None  # the tracker's forward hook, first of the module's (a rule's)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # of params, at the last check
    pending: list[tuple[UseRecord, list[torch.Tensor | None]]] = field(default_factory=list)

    @functools.cached_property
    def builtin(self) -> bool:
        """Whether the rule is one of gradkit's own (read once: the hooks ask at every call)."""
        return builtin(self.rule)

    @functools.cached_property
    def label(self) -> str:
        """``"name (Class)"``, for messages (made once: the hooks read it at every call)."""
        return f"{self.name or 'model'} ({type(self.module).__name__})"


def check_pass(
    records: Sequence[UseRecord],
    loss_reduction: str | None,
    checked: Mapping[int, str],
    params: Mapping[int, torch.Tensor],
    roots: list[torch.Tensor],
    *,
    kept: Collection[int] = (),
    unchecked: Mapping[int, str] | None = None,
) -> frozenset[int]:
    """The tracked parameters (``params``: ``id -> parameter``) whose gradient a backward pass
    leaves out although its graph reaches them (all of them: the pass adds no statistic).

    Each parameter's statistics count the passes that compute its gradient, as ``p.grad`` and
    ``torch.autograd.grad`` do: a gradient w.r.t. the input alone (adversarial training) is
    left out of every statistic, one w.r.t. some parameters (``torch.autograd.grad(loss,
    [some])``, ``backward(inputs=...)``) out of the others'. Refused: a pass that
    differentiates a layer split into another number of examples, layers that disagree on
    ``N``, a loss that certainly contradicts ``loss_reduction`` (None: any loss, read as a sum
    of per-example shares), a parameter of ``checked`` (``id -> name``) used outside its
    layer's calls (see :mod:`._outside`; ``kept``: the ids of the records whose graph an
    earlier pass with ``create_graph`` kept, a graph of the gradient whose nodes may use a
    parameter through its layer's own intermediate nodes). Refused too: a pass through those
    calls that computes the gradient of a parameter of ``unchecked``
    (``id -> name``: layers read by the vmap fallback or a user's rule, whose uses inside the
    graph of a gradient cannot be followed). ``roots``: the pass's
    (:func:`._layout.backward_roots`). Called at the pass's
    first tracked output, before the gradient reaches any tracked parameter (a refused pass
    leaves ``p.grad`` as it was)."""
    nodes = [t.grad_fn for t in roots if t.grad_fn is not None]
    accumulators: dict[int, Node] = {}
    found = edges_into(nodes, params, accumulators)
    left_out = frozenset(pid for pid in found if not _differentiates(accumulators[pid]))
    live: list[UseRecord] = []
    for r in records:
        try:
            if any(will_execute(node) for node in r.nodes):
                live.append(r)
        except RuntimeError:
            pass
    seen = {id(r) for r in live}
    hidden = [
        r for r in records if r.base is not None and id(r) not in seen and will_execute(r.base)
    ]
    if hidden:
        raise hidden_view_error([r.label for r in hidden])
    if unchecked and kept and any(id(r) in kept for r in live):
        blind = sorted(unchecked[pid] for pid in found if pid in unchecked and pid not in left_out)
        if blind:
            raise _through_gradient_error(blind)
    mismatched = [r for r in live if r.call.mode == "mismatch"]
    if mismatched:
        raise mismatch_error([f"{r.label} {r.call.problem}" for r in mismatched])
    sizes = [(r.label, r.call.n) for r in live]
    if len({k for _, k in sizes}) > 1:
        raise disagree_error(sizes)
    n = sizes[0][1] if sizes else None
    if loss_reduction is not None:
        check_loss_reduction(loss_reduction, n, {nd for r in live for nd in r.nodes}, roots)
    # the calls this pass differentiates: the engine does not list a root's own node as one it
    # will execute (autograd.grad(out, ...) with out a layer's output)
    tops = set(nodes)
    counted = live + [r for r in records if id(r) not in seen and any(n in tops for n in r.nodes)]
    # a layer not called in this pass: no use at all; a parameter left out: not checked
    expected = {pid: 0 for pid in checked if pid not in left_out}
    for r in counted:
        for pid in r.checked:
            if pid in expected:
                expected[pid] += 1
    calls = {nd for r in counted for nd in r.nodes}
    check_outside_uses(nodes, expected, checked, calls, found, shared=bool(kept))
    if unchecked:
        # a parameter whose gradient the pass computes although no call of its module is in
        # it (a ParameterList's, a module whose forward is bypassed): the statistics come from
        # the calls, so every example would get 0 for it
        held = {pid for r in counted for pid in r.pids}
        uncalled = {
            pid: 0 for pid in found if pid in unchecked and pid not in left_out and pid not in held
        }
        check_uncalled(nodes, uncalled, unchecked, calls, found)
        check_uses_outside_calls(nodes, counted, unchecked, left_out, calls, found)
    return left_out


def _through_gradient_error(names: list[str]) -> GradkitError:
    listed = ", ".join(repr(n) for n in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            "model",
            "in a pass through the graph of a gradient (an earlier pass in the block ran with "
            "create_graph=True, as a gradient penalty does), parameters whose every use on the "
            "examples gradkit can follow",
            f"{listed}, of layers read by the vmap fallback or a rule of yours: the graph of "
            "the gradient uses them too, a use their per-example gradients would leave out",
            "track steps without the penalty, or freeze these parameters "
            "(requires_grad_(False)) to track the rest",
        )
    )


def _differentiates(acc: Node) -> bool:
    """Whether the running backward pass computes the gradient of the parameter whose
    accumulator is ``acc``: the accumulator runs (``.backward()``), or the parameter is an input
    of ``torch.autograd.grad``, where the engine refuses the query for a leaf it captures."""
    try:
        return will_execute(acc)
    except RuntimeError:
        return True


def hook_all(tensors: Sequence[torch.Tensor], fn: Callable[[list[Any]], None]) -> None:
    """Call ``fn`` with the gradients w.r.t. ``tensors`` (None for those this backward pass
    does not reach) once all that it reaches have arrived: a module call's several outputs.

    ``register_multi_grad_hook(mode="all")`` counts the tensors whose node the engine will
    execute, asked at the first arrival; the node of the pass's root (a loss the module
    returns, ``out.loss.backward()``) is not one it will execute then, so the count was one
    short and the hook never ran: the call's statistics were left out, and reading them said
    no backward pass had reached the model. The tensor that arrives is counted here too."""
    node_of = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", lambda t: t.grad_fn)
    nodes = [node_of(t) for t in tensors]  # a leaf's: its accumulator
    waiting: dict[int, tuple[set[int], list[Any]]] = {}  # graph task -> (to come, arrived)
    lock = threading.Lock()  # a GPU backward runs hooks on its device threads

    def arrive(index: int, grad: torch.Tensor) -> None:
        task = int(torch._C._current_graph_task_id())
        with lock:
            entry = waiting.get(task)
            if entry is None:
                expected = {
                    i
                    for i, node in enumerate(nodes)
                    if i == index or (node is not None and _differentiates(node))
                }
                entry = waiting[task] = (expected, [None] * len(nodes))
            entry[0].discard(index)
            entry[1][index] = grad
            done = not entry[0]
            if done:
                del waiting[task]
        if done:
            fn(entry[1])

    for i, t in enumerate(tensors):
        on_gradient(t, functools.partial(arrive, i))


def on_gradient(t: torch.Tensor, fn: Callable[[Any], None]) -> None:
    """Call ``fn`` with the gradient w.r.t. ``t`` as the node that computed ``t`` receives it:
    after every hook on ``t`` itself, registered before this one or after. A hook of the
    model's own on a layer's output (``h.register_hook(lambda g: 2 * g)`` in its forward)
    changes what reaches the layer's backward, and so its parameters' gradients and the mean
    read at their edges; a tensor hook of the tracker's, registered first, ran before it and
    read the gradient unchanged (the second moment 0.35 off the one-example loop's, the mean
    right, silently). A leaf, which no node computed, gets a tensor hook."""
    node = t.grad_fn
    if node is None:
        t.register_hook(fn)
        return
    index = t.output_nr

    def pre(grads: tuple[Any, ...]) -> None:
        fn(grads[index])

    node.register_prehook(pre)


def hook_target(output: torch.Tensor) -> tuple[torch.Tensor, Node | None]:
    """The tensor whose hook gives the gradient w.r.t. a call's ``output``, and the node of the
    base of an ``output`` that is a view of part of a tensor (else None).

    An in-place operation on a view (``relu_`` after a Linear on ``[N, T, d]``, which returns
    its ``[N * T, o]`` product viewed) takes the view's node out of the graph, and the view's
    hooks never fire; its base's node stays in the graph. A view of the whole of its base is
    therefore hooked through the base (same numbers, reshaped). A view of part of it cannot
    be: :func:`check_pass` refuses a pass that reaches its base but not its node, and where the
    pass starts at no other tracked layer, the tracker refuses it at that base."""
    base = output._base if output._is_view() else None
    if base is None or base.grad_fn is None:
        return output, None
    whole = (
        base.numel() == output.numel()
        and output.is_contiguous()
        and base.is_contiguous()
        and output.storage_offset() == base.storage_offset()
    )
    return (base, None) if whole else (output, base.grad_fn)


def hidden_view_error(labels: list[str]) -> GradkitError:
    """The error for calls whose output, a view of part of a tensor, was modified in place
    (see :func:`hook_target`)."""
    return GradkitError(
        message(
            "per_example.track(model, ...)",
            "model",
            "tracked layers whose outputs reach the loss as they are",
            ", ".join(labels) + ": an output that is a view of part of a larger tensor, "
            "modified in place afterwards (its gradient can no longer be read)",
            "make the operation that follows the layer out-of-place (e.g. nn.ReLU(inplace=False))",
        )
    )


def refuse_cached_parametrization(st: ModuleState) -> None:
    """Refuse a call of a parametrized module inside ``torch.nn.utils.parametrize.cached()``:
    its weight is computed once for every call in the block, so the fallback's re-run of one
    example does not recompute it from the parameter (per-example gradients of 0), and the calls
    share the graph into the parameter (each read the others' gradient: the mean 2x)."""
    if torch.nn.utils.parametrize._cache_enabled:
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                st.label,
                "a parametrized weight computed at each call",
                "a call inside torch.nn.utils.parametrize.cached(), which computes it once for "
                "every call in that block",
                "run the tracked forward outside parametrize.cached()",
            )
        )


def check_still_trainable(st: ModuleState) -> None:
    """Refuse a call of a module whose parameter was frozen after ``track()`` (its
    statistics would silently stop)."""
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


def refuse_substituted(st: ModuleState, local: str, held: Any) -> None:
    """Refuse a call of a module that runs with another tensor than its tracked parameter
    ``local`` (``torch.func.functional_call`` or ``torch.nn.utils.stateless`` with
    substituted parameters, a ``DataParallel`` replica): the rule gives the per-example
    gradients of that tensor, not of the parameter (a substituted ``2 * weight`` made the
    second moment 4x too large, a constant one gave a nonzero moment to a parameter the loss
    does not reach), or without it (removed since ``track()``)."""
    name = f"{st.name}.{local}" if st.name else local
    got = (
        "a call without it (removed from the module after track() was called)"
        if held is None
        else "a call with another tensor in its place (torch.func.functional_call or "
        "torch.nn.utils.stateless with substituted parameters, a DataParallel replica): "
        "the statistics would be those of that tensor"
    )
    raise GradkitError(
        message(
            "per_example.track(model, ...)",
            f"parameter {name!r}",
            f"calls of {st.label} with that parameter itself",
            got,
            "call the model with its own parameters inside the track block (or substitute "
            "the same parameter objects), or track the module the substituted tensors belong to",
        )
    )


def refuse_hook_before(st: ModuleState) -> None:
    """Refuse a call of a module whose forward hooks now run one before the tracker's (one
    registered with ``prepend=True`` inside the block): it may have replaced the layer's output
    (``2 * output`` made the per-example gradients half what they are), which the rule reads."""
    raise GradkitError(
        message(
            "per_example.track(model, ...)",
            f"the forward hooks of {st.label}",
            "the tracker's hook first (it reads the layer's own output, before any hook of "
            "yours may replace it)",
            "a hook registered with prepend=True inside the track block, which runs before it",
            "register the hook before the track block, or without prepend=True",
        )
    )


_HOLDERS = (nn.ParameterList, nn.ParameterDict)
"""Modules that hold parameters for another to read and are never called themselves."""


def _holds_parameters(module: nn.Module) -> bool:
    """Whether a child of ``module`` is a :data:`_HOLDERS` with a parameter that requires
    grad."""
    return any(
        isinstance(child, _HOLDERS) and any(p.requires_grad for p in child.parameters())
        for child in module._modules.values()
    )


def tracked_modules(
    modules: Mapping[str, nn.Module], dims: Mapping[str, int], fallback: str, call: str
) -> list[ModuleState]:
    """Every module with parameters of its own that require grad, with its rule: a registered
    one, else the vmap fallback on its whole subtree (``fallback="error"`` refuses, ``"warn"``
    warns). A layer that cannot be split by example raises."""
    states: list[ModuleState] = []
    owners: dict[int, int] = {}  # id(parameter) -> tracked modules holding it
    claimed: list[str] = []  # subtrees a fallback module differentiates as a whole
    for name, module in modules.items():
        if any(c == "" or name == c or name.startswith(c + ".") for c in claimed):
            continue
        own: dict[str, torch.Tensor]
        # the module's own parameters (named_parameters(recurse=False) walks named_modules per
        # call: a tenth of a small model's track() set-up)
        own = {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}
        if not own and _holds_parameters(module) and find_rule(module) is None:
            # a ParameterList or ParameterDict is never called: the module reading its entries
            # is differentiated by the vmap fallback, whose subtree holds them
            own = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if not own:
            if not reparametrized(module):
                continue
            # the parametrized tensor's originals live in a child (`parametrizations`)
            own = {n: p for n, p in module.named_parameters() if p.requires_grad}
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
        if rule is None and power_iteration(module):
            raise GradkitError(
                message(
                    call,
                    "model",
                    "layers whose forward can be re-run for per-example gradients",
                    f"{name or 'model'} ({type(module).__name__}): a spectral norm in training "
                    "mode, whose power iteration updates the module at each call (re-running "
                    "it would change both the module and the weight it differentiates)",
                    f"put it in eval mode ({name or 'model'}.eval()) while tracking, or freeze "
                    "it to track the rest",
                )
            )
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
                    stacklevel=4,  # track()'s caller
                )
            rule = vmap_rule
        pids = {n: id(p) for n, p in own.items()}
        fusion = getattr(rule, "weight_sums", None)
        if "weight" not in own or own["weight"] is not getattr(module, "weight", None):
            fusion = None  # a frozen or parametrized weight: autograd's own product
        states.append(ModuleState(name, module, rule, own, pids, dims[name], fusion))
        states[-1].parametrized = _parametrized(module)
        for pid in pids.values():
            owners[pid] = owners.get(pid, 0) + 1
    checkable = {id(st): checked_module(st.module) and st.rule is not vmap_rule for st in states}
    unchecked = {pid for st in states if not checkable[id(st)] for pid in st.pids.values()}
    for st in states:
        ok = checkable[id(st)]
        st.shared = any(owners[pid] > 1 for pid in st.pids.values())
        if ok:
            st.checked = tuple(pid for pid in st.pids.values() if pid not in unchecked)
    return states


def model_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> ModelCall:
    """The candidate number of examples of a model call: the batch dimension of its first
    input that has one (a PackedSequence: its first batch size)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, PackedSequence):
            return ModelCall(int(value.batch_sizes[0]), None)
        for t in flat_leaves(value):
            if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
                shape = t.shape[:batch_dim] + t.shape[batch_dim + 1 :]
                n = int(t.shape[batch_dim])
                call = ModelCall(n, tuple(shape), first=t, dim=batch_dim, source=t)
                call.inputs = [
                    leaf
                    for v in (*args, *kwargs.values())
                    for leaf in flat_leaves(v)
                    if isinstance(leaf, torch.Tensor)
                ]
                return call
    return ModelCall(None, None)


def rule_view(call: Call, grads: list[torch.Tensor | None], native: bool) -> Use:
    """The rule's view of one call: batch-first tensors for rules, the call as the module saw
    it (with its dims) for the fallback."""
    if native:
        dims = Dims(
            call.in_dims, call.out_dims, call.added, call.values, call.versions, call.autocast
        )
        return Use(call.args, grads, call.kwargs, dims)
    return Use(call.args, unflatten(grads, call.out_spec), call.kwargs)


def in_backward() -> bool:
    """Whether a backward pass is running (a forward inside it re-computes activations)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and int(task()) != -1


def refuse_batchnorm(module: nn.Module, args: tuple[Any, ...], *, name: str = "") -> None:
    """A forward pre-hook: BatchNorm that normalizes with the batch's statistics mixes the
    examples: in training mode, and in eval mode without running statistics
    (``track_running_stats=False``), as ``_BatchNorm.forward`` decides. ``name``: the
    module's in the model, for the message."""
    if module.training:
        mode = "in training mode"
        fix = "call model.eval() on it (running statistics), or "
    elif module.running_mean is None and module.running_var is None:
        mode = "without running statistics (track_running_stats=False), even in eval mode"
        fix = ""
    else:
        return
    raise GradkitError(
        message(
            "per_example.track(model, ...)",
            "model",
            "layers that treat examples independently",
            f"{name or 'model'} ({type(module).__name__}) {mode}, which normalizes with "
            "statistics of the whole "
            "batch (each example's loss depends on every other example, and individual "
            "gradients are not defined)",
            f"{fix}convert the model with gradkit.per_example.replace_batchnorm(model) "
            "(GroupNorm instead: a change of the model, to be trained as such)",
        )
    )

"""The registry of per-layer rules: one decorated function per layer family, looked up along
the module's MRO (so subclasses of ``nn.Linear`` use the Linear rule, not the slow fallback).

A rule has one fixed signature::

    rule(module, uses, ctx) -> {local_param_name: PerExampleGrad}

``uses`` holds one :class:`Use` per forward call of the module in this backward pass (several
for weight tying or recurrent use), each with the module's positional inputs and the gradient of
the loss w.r.t. its output, batch dimension first, *unscaled* (whatever the loss reduction);
``ctx`` is a :class:`RuleContext`. The rule returns the per-example gradients of the module's
own parameters (``module.named_parameters(recurse=False)``) that require grad, summed over uses
per example, in whatever form is cheapest (see :mod:`gradkit.per_example._grads`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit.per_example._batch import Dims
from gradkit.per_example._grads import Materialized, OuterProduct, PerExampleGrad

__all__ = [
    "Rule",
    "RuleContext",
    "Use",
    "check_result",
    "find_rule",
    "functionals",
    "register_rule",
    "registered_rules",
]


@dataclass
class Use:
    """One forward call of a module: its inputs and the gradient w.r.t. its output.

    For a rule, every tensor that carries the examples has them in dimension 0 (inputs that
    broadcast over the batch, e.g. position ids ``[1, T]``, are expanded to it); tensors shared
    by all examples are as the module saw them. The generic fallback gets the call as the module
    saw it instead, with ``dims`` saying where the examples are, and ``grad_output`` as the list
    of the output's leaves' gradients (None where none arrived).
    """

    inputs: tuple[Any, ...]
    grad_output: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    dims: Dims | None = None


@dataclass
class RuleContext:
    """What the rule may need besides the uses."""

    params: dict[str, torch.Tensor]
    """The module's own parameters to differentiate, by local name."""
    gram_norms: bool = True
    """Whether rules may use Gram-form (pairwise) norms when the cost model prefers them."""
    reruns: list[torch.Tensor] = field(default_factory=list)
    """0-dim bool tensors a rule may append, True where re-running the module example by
    example did not reproduce the batch's output (the fallback's check): the tracker refuses
    to give statistics if any is, when they are read (no host sync in the backward)."""


Rule = Callable[[nn.Module, list[Use], RuleContext], dict[str, PerExampleGrad]]
_RULES: dict[type, Rule] = {}
_FORWARDS: dict[type, Any] = {}
"""Each class with a rule -> its ``forward`` when the rule was registered (:func:`find_rule`)."""

_CALLS: dict[type, tuple[str, ...]] = {
    nn.Linear: ("linear",),
    nn.Conv1d: ("conv1d", "pad"),
    nn.Conv2d: ("conv2d", "pad"),
    nn.Conv3d: ("conv3d", "pad"),
    nn.Embedding: ("embedding",),
    nn.EmbeddingBag: ("embedding_bag",),
    nn.LayerNorm: ("layer_norm",),
    nn.GroupNorm: ("group_norm",),
    nn.BatchNorm1d: ("batch_norm",),
    nn.BatchNorm2d: ("batch_norm",),
    nn.BatchNorm3d: ("batch_norm",),
}
"""The ``torch.nn.functional`` functions each ``torch.nn`` class with a built-in rule calls
(looked up in that module at each call: a replacement there is what the layer computes)."""
if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    _CALLS[nn.RMSNorm] = ("rms_norm",)
_CALLED_BY = {getattr(cls, "forward", None): names for cls, names in _CALLS.items()}
_WATCHED = tuple(sorted({name for names in _CALLS.values() for name in names}))
_TORCH_HOMES = ("torch", "torch._C._nn", "torch.nn.functional")


def _own(name: str) -> Any:
    """``torch.nn.functional.<name>`` as torch defines it, or None where it was already
    replaced when gradkit was imported (a function of another module, or a wrapper)."""
    f = getattr(F, name, None)
    genuine = getattr(f, "__module__", None) in _TORCH_HOMES and not hasattr(f, "__wrapped__")
    return f if genuine else None


_ORIGINALS = {name: _own(name) for name in _WATCHED}


def functionals() -> tuple[Any, ...]:
    """The ``torch.nn.functional`` functions the built-in rules' layers call, as they are now
    (part of what a kept decision of :mod:`._plan` depends on)."""
    return tuple(getattr(F, name, None) for name in _WATCHED)


def _replaced(forward: Any) -> bool:
    """Whether a ``torch.nn.functional`` function that ``forward`` (a ``torch.nn`` layer's,
    inherited or not) calls was replaced (``F.linear = ...``, as DeepSpeed's ZeRO-3 does): the
    layer computes what the replacement does, which a rule does not read."""
    names = _CALLED_BY.get(forward, ())
    return any(getattr(F, name, None) is not _ORIGINALS[name] for name in names)


def builtin(rule: Rule) -> bool:
    """Whether ``rule`` is one of gradkit's own (trusted to sum over every use)."""
    return getattr(rule, "__module__", "").startswith("gradkit.per_example")


class CheckedUses(list[Use]):
    """The ``uses`` handed to a user's rule when a module ran more than once: records which
    uses the rule read (by iteration or indexing) so that an unread one raises."""

    def __init__(self, uses: list[Use]) -> None:
        super().__init__(uses)
        self.read: set[int] = set()

    def __iter__(self) -> Any:
        self.read.update(range(len(self)))
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        picked = range(len(self))[index]
        self.read.update(picked if isinstance(picked, range) else (picked,))
        return super().__getitem__(index)

    def check(self, rule: Rule, module: str) -> None:
        """Raise if ``rule`` returned without reading every use."""
        unread = sorted(set(range(len(self))) - self.read)
        if unread:
            raise GradkitError(
                message(
                    f"per_example rule {getattr(rule, '__name__', rule)!r} for {module}",
                    "uses",
                    f"every one of the {len(self)} uses read (the module ran {len(self)} times "
                    "in this backward: tied weights or recurrence)",
                    f"uses {unread} never read",
                    "sum the per-example gradients over all uses (for u in uses: ...)",
                )
            )


def register_rule(*module_types: type, overwrite: bool = False) -> Callable[[Rule], Rule]:
    """Register ``rule`` for the given module classes (and, through the MRO, their subclasses).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.per_example import Materialized, register_rule
        >>> class Scale(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.s = nn.Parameter(torch.ones(()))
        ...     def forward(self, x):
        ...         return self.s * x
        >>> @register_rule(Scale)
        ... def _scale_rule(module, uses, ctx):
        ...     # every forward call of the module (weight tying, recurrence) adds its part
        ...     per_example = sum((u.inputs[0] * u.grad_output).flatten(1).sum(1) for u in uses)
        ...     return {"s": Materialized(per_example)}

    A rule registered here must read every use: gradkit checks it whenever a module was called
    more than once, and raises naming the rule if one was left unread (a rule that reads only
    ``uses[0]`` is silently wrong on tied weights). gradkit's own rules are not wrapped.
    """
    if not module_types or not all(isinstance(t, type) for t in module_types):
        raise TypeError(
            message(
                "register_rule(*module_types)",
                "module_types",
                "one or more classes",
                describe(module_types),
                "pass e.g. register_rule(nn.Linear)",
            )
        )

    def decorate(rule: Rule) -> Rule:
        if not callable(rule):
            raise TypeError(
                message(
                    f"register_rule({', '.join(t.__name__ for t in module_types)})",
                    "rule",
                    "a function rule(module, uses, ctx) -> {name: PerExampleGrad}",
                    describe(rule),
                    "decorate a function with @register_rule(...)",
                )
            )
        for t in module_types:
            if t in _RULES and not overwrite:
                raise ValueError(
                    message(
                        f"register_rule({t.__name__})",
                        "module_types",
                        "a class without a rule",
                        f"{t.__name__} (already has {_RULES[t].__name__})",
                        "pass overwrite=True to replace it",
                    )
                )
            _RULES[t] = rule
            _FORWARDS[t] = getattr(t, "forward", None)
        return rule

    return decorate


def check_result(
    rule: Rule,
    result: Any,
    module: nn.Module,
    params: Mapping[str, Any],
    label: str,
    call_dtype: torch.dtype | None = None,
) -> None:
    """Refuse what a rule returned if it is not a mapping from the module's parameter names to
    :class:`~gradkit.per_example.PerExampleGrad` (a misspelled name would leave a parameter
    without statistics; a raw tensor would fail later, somewhere unclear). ``params``: the
    tracked ones, by local name (the module's others are looked up only for other keys).
    A user's rule is also refused gradients less precise than both the parameter and the
    call's output gradient (``call_dtype``; bf16 under autocast)."""
    call = f"per_example.track: the rule {getattr(rule, '__name__', repr(rule))} of {label}"
    fix = "return {name: Materialized(grads)} ([N, *param.shape]) or another PerExampleGrad"
    if not isinstance(result, Mapping):
        raise TypeError(
            message(
                call,
                "its result",
                "a dict of parameter name -> PerExampleGrad",
                describe(result),
                fix,
            )
        )
    others = [k for k in result if k not in params]
    names = {n for n, _ in module.named_parameters()} if others else set()
    unknown = sorted(str(k) for k in others if k not in names)
    if unknown:
        raise ValueError(
            message(
                call,
                "its result's keys",
                f"names of the module's parameters ({sorted(names)})",
                f"{unknown}, which the module does not have",
                "key each result by the parameter's name in module.named_parameters()",
            )
        )
    own = builtin(rule)
    for key, value in result.items():
        if not isinstance(value, PerExampleGrad):
            raise TypeError(
                message(call, f"its result for {key!r}", "a PerExampleGrad", describe(value), fix)
            )
        param = params.get(key)
        if own or param is None:
            continue
        coarse = _coarsest(value)
        allowed = [param.dtype] + ([call_dtype] if call_dtype is not None else [])
        if coarse is not None and _eps(coarse) > max(_eps(d) for d in allowed):
            # statistics of a float64 model from float32 gradients: 1e-7, not 1e-16, silently
            raise TypeError(
                message(
                    call,
                    f"its result for {key!r}",
                    f"per-example gradients in the parameter's precision ({param.dtype})",
                    f"{coarse} tensors",
                    f"compute them in {param.dtype} (e.g. .to(grad_output.dtype)), or cast the "
                    "model to the precision wanted",
                )
            )


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0


def _coarsest(value: PerExampleGrad) -> torch.dtype | None:
    """The least precise floating dtype of the tensors a :class:`Materialized` or an
    :class:`OuterProduct` holds (None for other forms: their blocks are not computed yet)."""
    if isinstance(value, Materialized):
        tensors = [value.grads]
    elif isinstance(value, OuterProduct):
        tensors = [value.A, value.G]
    else:
        return None
    dtypes = [t.dtype for t in tensors if t.is_floating_point()]
    return max(dtypes, key=_eps) if dtypes else None


def find_rule(module: nn.Module) -> Rule | None:
    """The rule of the nearest class in ``type(module).__mro__`` that has one, or None.

    A subclass that overrides ``forward`` computes something else than the class the rule was
    written for (Hugging Face's ``BartScaledWordEmbedding`` scales ``nn.Embedding``'s lookup):
    it gets no inherited rule (None: the exact fallback) unless a rule is registered for it.
    Nor does a module whose parameters are not the tensors its forward uses (see
    :func:`reparametrized`), nor one whose ``forward`` was replaced on the instance
    (``layer.forward = ...``, as Accelerate's hooks do) or on the class after its rule was
    registered (``nn.Linear.forward = ...``): its calls run that function, not the one the rule
    reads (a Linear whose forward doubled its output had its second moment read 4x too small by
    the Linear rule), nor one whose forward calls a ``torch.nn.functional`` function that was
    replaced (``torch.nn.functional.linear = ...``: a replacement that doubled the weight had
    the Linear rule's second moment 4.3 off), nor a subclass that changes attribute lookup
    (``__getattr__``, which gives a module its parameters, or ``__getattribute__``) from the
    class with the rule: its ``self.weight`` may be another tensor than the parameter (a
    ``__getattr__`` returning ``2 * weight`` had the Linear rule's second moment 0.34 off).
    """
    if "forward" in module.__dict__ or reparametrized(module):
        return None
    kind = type(module)
    forward = getattr(kind, "forward", None)
    for cls in kind.__mro__:
        if cls in _RULES:
            # the forward the rule was written for: the class's when it was registered (a
            # forward replaced on the class since, `nn.Linear.forward = ...`, is another one)
            written_for = _FORWARDS.get(cls, getattr(cls, "forward", None))
            if forward is not written_for or _replaced(forward) or _looks_up(kind, cls):
                return None
            return _RULES[cls]
    return None


def _looks_up(kind: type, cls: type) -> bool:
    """Whether ``kind`` looks attributes up otherwise than ``cls``, the class its rule was
    registered for (a rule registered for a class reads that class's lookup)."""
    return (
        getattr(kind, "__getattr__", None) is not getattr(cls, "__getattr__", None)
        or kind.__getattribute__ is not cls.__getattribute__
    )


def reparametrized(module: nn.Module) -> bool:
    """Whether ``module``'s forward uses tensors computed from its parameters at each call:
    ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``orthogonal``, ...),
    the hook-based ``weight_norm`` and ``spectral_norm``, or ``torch.nn.utils.prune`` (``weight
    = weight_orig * weight_mask``). A rule reads the layer's weight as a parameter, which it is
    not there; the fallback differentiates the whole module."""
    if _parametrized(module):
        return True
    hooks = module._forward_pre_hooks
    if not hooks:
        return False
    if {"WeightNorm", "SpectralNorm"} & _pre_hook_kinds(module):
        return True
    prune = sys.modules.get("torch.nn.utils.prune")  # not imported: nothing was pruned
    return prune is not None and any(isinstance(h, prune.BasePruningMethod) for h in hooks.values())


def power_iteration(module: nn.Module) -> bool:
    """Whether a spectral norm of ``module`` (hook-based or a parametrization) updates its
    power-iteration vectors at each call (training mode)."""
    if module.training and "SpectralNorm" in _pre_hook_kinds(module):
        return True
    if not _parametrized(module):
        return False
    lists = module.parametrizations.values()  # type: ignore[operator]
    return any(type(p).__name__ == "_SpectralNorm" and p.training for ps in lists for p in ps)


def _parametrized(module: nn.Module) -> bool:
    """``parametrize.is_parametrized(module)``, read where ``torch.nn.utils.parametrize`` puts the
    parametrizations (``module._modules``): its ``getattr`` raises and catches an
    ``AttributeError`` for every module without one, 1.5 us each, a fifth of a small model's
    ``track()`` set-up."""
    found = module._modules.get("parametrizations")
    return isinstance(found, nn.ModuleDict) and len(found) > 0


def _pre_hook_kinds(module: nn.Module) -> set[str]:
    """The class names of ``module``'s forward pre-hooks (the hook-based weight and spectral
    norms are instances of ``WeightNorm`` and ``SpectralNorm``)."""
    return {type(hook).__name__ for hook in module._forward_pre_hooks.values()}


def registered_rules() -> dict[type, Rule]:
    """A copy of the registry (class -> rule)."""
    return dict(_RULES)

"""Which modules ``track`` tracks, with which rule and batch dimension, kept per model between
``track()`` calls while nothing they depend on has changed.

Deciding it (:func:`._capture.tracked_modules`, :func:`._layout.inner_batch_dims`) asks every
module for its rule, its parametrizations, its hooks and its layout: 0.12 ms of the demo CNN's
2.5 ms tracked step, repeated at every step by a training loop that opens a ``track`` block per
step. :func:`planned_modules` gives the same decision from a :class:`_Plan` kept for the model
when the model is as it was when the plan was made, by this test (:func:`_structure`):

- the same module objects under the same names (``named_modules()``), each of the same class,
  in the same training mode, with the same children (a ``ParameterList`` its parent reads),
  the same ``forward`` (its class's, and any set on the instance), ``__getattr__`` and
  ``__getattribute__`` (its class's: they give the forward its parameters), the same forward
  pre-hooks (the hook-based weight and spectral norms), the same ``batch_first`` and T5-style
  ``has_relative_attention_bias`` attributes;
- the same parameter objects in each module's ``_parameters``, each with the same
  ``requires_grad``;
- the same registry of rules (:func:`.register_rule`; a library whose rules
  :func:`.rules.register_available` adds was imported since), the same ``torch.nn.functional``
  functions their layers call (:func:`._registry.functionals`), ``fallback`` and
  ``batch_dim``.

Objects are compared by identity through weak references (an object that died is never taken
for the new one that got its ``id``), and the plan holds nothing else of the model's: it never
keeps a model or a replaced layer alive. ``torch.nn.utils.parametrize`` changes the module's
class and adds a ``parametrizations`` child; ``weight_norm``/``spectral_norm`` add pre-hooks and
parameters; freezing, ``train()``/``eval()``, replacing a layer or its weight, all change the
structure and make a new plan. A plan is not kept where ``fallback="warn"`` met a module without
a rule (its warning is given at each ``track()`` call, as without a plan).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from gradkit.per_example._capture import ModuleState, tracked_modules
from gradkit.per_example._layout import inner_batch_dims
from gradkit.per_example._registry import functionals, registered_rules
from gradkit.per_example.rules import vmap_rule

__all__ = ["planned_modules"]


@dataclass(frozen=True)
class _Tracked:
    """One :class:`._capture.ModuleState` as decided, without the module and its parameters
    (found again by name and by the parameters' weak references)."""

    name: str
    rule: Any
    params: tuple[tuple[str, weakref.ReferenceType[Any]], ...]
    batch_dim: int
    fusion: str | None
    shared: bool
    checked: tuple[int, ...]
    parametrized: bool
    label: str
    builtin: bool


@dataclass(frozen=True)
class _Plan:
    key: tuple[Any, ...]
    refs: tuple[weakref.ReferenceType[Any] | None, ...]  # modules and parameters, in order
    tracked: tuple[_Tracked, ...]


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _structure(modules: Mapping[str, nn.Module]) -> tuple[tuple[Any, ...], list[Any]]:
    """What the decision reads of the model, but for object identities (a hashable summary),
    and those objects: each module followed by its ``_parameters`` and its children (None
    included)."""
    summary: list[Any] = []
    objects: list[Any] = []
    for name, module in modules.items():
        attrs = module.__dict__
        params = module._parameters
        summary.append(
            (
                name,
                type(module),
                module.training,
                tuple(module._forward_pre_hooks),
                tuple(params),
                tuple(p is not None and p.requires_grad for p in params.values()),
                getattr(type(module), "forward", None),  # a rule is for its class's forward
                getattr(type(module), "__getattr__", None),  # gives the forward its parameters
                type(module).__getattribute__,
                attrs.get("forward"),  # replaced on the instance: the fallback's
                attrs.get("batch_first"),
                attrs.get("has_relative_attention_bias"),
            )
        )
        objects.append(module)
        objects.extend(params.values())
        objects.extend(module._modules.values())
    return tuple(summary), objects


def _same(refs: tuple[weakref.ReferenceType[Any] | None, ...], objects: list[Any]) -> bool:
    if len(refs) != len(objects):
        return False
    for ref, obj in zip(refs, objects, strict=True):
        if ref is None:
            if obj is not None:
                return False
        elif ref() is not obj:
            return False
    return True


def planned_modules(
    model: nn.Module,
    modules: dict[str, nn.Module],
    batch_dim: int,
    given_dims: Mapping[str, int],
    fallback: str,
    call: str,
) -> list[ModuleState]:
    """``tracked_modules(modules, inner_batch_dims(modules, batch_dim, given_dims), fallback,
    call)``: fresh states, from the model's plan where it still holds (see the module
    docstring)."""
    summary, objects = _structure(modules)
    key = (
        summary,
        tuple(registered_rules().items()),
        functionals(),
        fallback,
        batch_dim,
        tuple(sorted(given_dims.items())),
    )
    plan = _PLANS.get(model)
    if plan is not None and plan.key == key and _same(plan.refs, objects):
        return [_state(t, modules) for t in plan.tracked]
    dims = inner_batch_dims(modules, batch_dim, given_dims)
    states = tracked_modules(modules, dims, fallback, call)
    if fallback == "warn" and any(st.rule is vmap_rule for st in states):
        _PLANS.pop(model, None)
        return states
    refs = tuple(None if obj is None else weakref.ref(obj) for obj in objects)
    tracked = tuple(
        _Tracked(
            st.name,
            st.rule,
            tuple((local, weakref.ref(p)) for local, p in st.params.items()),
            st.batch_dim,
            st.fusion,
            st.shared,
            st.checked,
            st.parametrized,
            st.label,
            st.builtin,
        )
        for st in states
    )
    _PLANS[model] = _Plan(key, refs, tracked)
    return states


def _state(t: _Tracked, modules: Mapping[str, nn.Module]) -> ModuleState:
    params = {}
    for local, ref in t.params:
        p = ref()
        assert p is not None  # a parameter the model holds (checked with the plan)
        params[local] = p
    pids = {local: id(p) for local, p in params.items()}
    state = ModuleState(t.name, modules[t.name], t.rule, params, pids, t.batch_dim, t.fusion)
    state.shared, state.checked, state.parametrized = t.shared, t.checked, t.parametrized
    # its cached properties, as the first state computed them (the class and rule are the plan's)
    state.__dict__["label"], state.__dict__["builtin"] = t.label, t.builtin
    return state

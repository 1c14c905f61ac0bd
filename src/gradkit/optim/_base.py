"""The functional optimizer: an ``init`` / ``update`` pair around one per-tensor update rule.

An update rule maps ``(g, p, slots, count, h)`` -- gradient, parameter, the state slots of
that parameter, the number of updates that parameter's state has had so far and the resolved
hyperparameters -- to ``(delta, new_slots)``; :class:`Optimizer` adds containers (dict or
tuple), hyperparameter resolution (numbers, tensors, schedules, per-parameter values), masks
and checks. Nothing is updated in place, so every result is differentiable with respect to
tensor hyperparameters.

State is kept per parameter, as ``torch.optim`` keeps it: a parameter whose gradient is
``None`` at a step is skipped (no update, its slots and its count untouched), and its count
(``torch.optim``'s ``state[p]["step"]``) starts at its first gradient, so bias corrections and
SGD's undampened first momentum buffer are those of a parameter used late or only sometimes.
Schedules (1-d hyperparameter tensors) are indexed by the optimizer's global step, as
``torch.optim.lr_scheduler`` steps once per ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from gradkit._errors import describe, message
from gradkit._tree import (
    Grads,
    Params,
    Structure,
    entries,
    leaves,
    rebuild,
    structure_of,
)
from gradkit._validate import check_bool
from gradkit.optim._values import Bounds, Scalar, check_value, resolve, widened

__all__ = ["Optimizer", "UpdateRule", "apply_updates", "lerp", "no_buffer", "safe_sqrt"]

UpdateRule = Callable[
    [torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int, dict[str, Scalar]],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]
"""``(g, p, slots, count, h) -> (delta, new_slots)`` for one parameter tensor; ``count`` is the
number of earlier updates of that parameter's state. Slots missing from ``new_slots`` keep
their value; a rule that returns no slot at all (an optimizer with slots, e.g. SGD at a
momentum of 0) leaves the parameter's count unchanged."""


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` for ``x >= 0`` with derivative 0 (not infinity) where ``x == 0``, so entries
    whose second moment is exactly zero (masked or unused weights) give finite hypergradients;
    negative round-off (centered RMSprop) gives 0 instead of NaN."""
    pos = x > 0
    return torch.where(
        pos, torch.sqrt(torch.where(pos, x, torch.ones_like(x))), torch.zeros_like(x)
    )


def lerp(start: torch.Tensor, end: torch.Tensor, weight: Scalar) -> torch.Tensor:
    """``start + weight * (end - start)`` computed as ``torch.lerp`` (the op ``torch.optim``
    uses, for bitwise-close trajectories), differentiable in ``weight``."""
    if isinstance(weight, torch.Tensor):
        # on start's device: a 0-dim CPU hyperparameter (torch.tensor(0.9)) may stand beside
        # CUDA tensors, but expanded to start's shape it is a full CPU tensor lerp refuses
        weight = weight.to(device=start.device, dtype=start.dtype)
        if weight.shape != start.shape:
            weight = weight.expand_as(start)
    return torch.lerp(start, end, weight)


def no_buffer(name: str, hyper: str, value: Any) -> str:
    """The message for a step that overrides ``hyper`` to a nonzero value on an optimizer built
    without the buffer it needs."""
    return message(
        f"{name}.update",
        hyper,
        f"0 (the optimizer was built with {hyper}=0, so its state has no buffer for it)",
        describe(value),
        f"build the optimizer with a nonzero {hyper} (or a tensor) to change it later",
    )


def _check_mask(mask: Any, call: str) -> Any:
    if mask is None:
        return None
    items = list(mask.items()) if isinstance(mask, Mapping) else None
    if items is None and isinstance(mask, (tuple, list)):
        items = list(enumerate(mask))
    if items is None:
        raise TypeError(
            message(
                call,
                "mask",
                "None, or a dict / tuple of boolean tensors (None entries: no mask)",
                describe(mask),
                "pass e.g. mask={'weight': weight != 0}",
            )
        )
    for key, m in items:
        if m is not None and (not isinstance(m, torch.Tensor) or m.dtype != torch.bool):
            raise TypeError(
                message(
                    call,
                    f"mask[{key!r}]",
                    "a boolean tensor (True = trainable) or None",
                    describe(m),
                    "pass e.g. weight != 0",
                )
            )
    return dict(mask) if isinstance(mask, Mapping) else tuple(mask)


class Optimizer:
    """A functional, differentiable optimizer: ``init(params) -> state`` and
    ``update(grads, state, params, **hyper) -> (new_params, new_state)``.

    Built by :func:`sgd`, :func:`adam`, :func:`adamw` or :func:`rmsprop`. ``params`` and
    ``grads`` are a dict ``name -> tensor`` or a tuple of tensors; results mirror them.

    The state is a ``NamedTuple``: ``step`` (the number of ``update`` calls: the index of
    schedules), one buffer per slot and parameter, and ``counts``, the number of updates of each
    parameter's state (``torch.optim``'s ``state[p]["step"]``; a container like the parameters
    of ints, or None for "``step`` for every parameter"). A ``None`` gradient skips its
    parameter: its weights, buffers and count stay as they are, as in ``torch.optim``.

    Attributes:
        name: the optimizer's name (``"sgd"``, ...).
        hyperparams: read-only mapping of the hyperparameter values it was built with.
        slots: the names of the state's per-parameter buffers.
        state_type: the ``NamedTuple`` type of its state (``step``, the slots, ``counts``).
    """

    def __init__(
        self,
        name: str,
        rule: UpdateRule,
        state_type: Any,
        slots: tuple[str, ...],
        hyperparams: dict[str, Any],
        bounds: dict[str, Bounds],
        flags: dict[str, Any],
        *,
        mask: Any = None,
        aliases: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.name = name
        self._rule = rule
        self.state_type = state_type
        self.slots = slots
        self._bounds = bounds
        self._aliases = aliases or {}
        self._values = {k: self._check(k, v, name) for k, v in hyperparams.items()}
        self.hyperparams = MappingProxyType(self._values)
        self.flags = MappingProxyType(dict(flags))
        self.mask = _check_mask(mask, name)

    def _check(self, key: str, value: Any, call: str) -> Any:
        return check_value(value, call, key, self._bounds[key])

    def check_values(self, call: str) -> None:
        """Check every hyperparameter again, as at construction (finite, in range): tensors
        changed in place since (by an outer optimizer) are read once more."""
        for key, value in self._values.items():
            self._check(key, value, call)

    def __repr__(self) -> str:
        def show(v: Any) -> str:
            return describe(v) if isinstance(v, torch.Tensor) else repr(v)

        items = [f"{k}={show(v)}" for k, v in (*self._values.items(), *self.flags.items())]
        return f"{self.name}({', '.join(items)})"

    def _params(self, params: Any, call: str) -> tuple[Structure, list[torch.Tensor]]:
        structure = structure_of(params, call)
        values = leaves(params, structure, call, "params")
        for i, p in enumerate(values):
            if not p.is_floating_point():
                raise TypeError(
                    message(
                        call,
                        f"params{structure.label(i)}",
                        "a floating-point tensor (an optimizer step is fractional)",
                        describe(p),
                        "convert the parameters with .float() or .double()",
                    )
                )
        return structure, values

    def _state(self, fields: dict[str, Any], step: int, counts: Any) -> Any:
        """A state of ``step``, the slots in ``fields`` (the others None) and ``counts``."""
        missing = {f: None for f in self.state_type._fields if f not in fields}
        missing.pop("step", None)
        missing["counts"] = counts
        return self.state_type(step=step, **fields, **missing)

    def _check_devices(self, by_key: dict[Any, torch.Tensor], call: str) -> None:
        """Refuse a per-parameter value of more than one entry on another device than its
        parameter: the update multiplies them, where torch raised its bare device error (a 0-d
        value or a schedule is read wherever it lives)."""
        for key, value in self._values.items():
            if not isinstance(value, Mapping):
                continue
            for name, v in value.items():
                p = by_key.get(name)
                if not (isinstance(v, torch.Tensor) and isinstance(p, torch.Tensor)):
                    continue
                if v.dim() > 0 and v.device != p.device:
                    raise ValueError(
                        message(
                            call,
                            f"{key}[{name!r}]",
                            f"a tensor on its parameter's device ({p.device}), or a 0-d one",
                            f"a {tuple(v.shape)} tensor on {v.device}",
                            f"move it with .to({str(p.device)!r}) when building the optimizer",
                        )
                    )

    def init(self, params: Params) -> Any:
        """The initial state: ``step = 0``, zero slots shaped like ``params`` and every count 0
        (a slot is first written at its parameter's first gradient)."""
        call = f"{self.name}.init(params)"
        structure, values = self._params(params, call)
        self._check_devices(dict(zip(structure.keys, values, strict=True)), call)
        fields = {
            s: rebuild(structure, [torch.zeros_like(p.detach()) for p in values])
            for s in self.slots
        }
        return self._state(fields, 0, rebuild(structure, [0] * len(values)))

    def _merge(self, hyper: dict[str, Any], call: str) -> dict[str, Any]:
        values = dict(self._values)
        for key, value in hyper.items():
            if key in self._aliases:
                names = self._aliases[key]
                if not isinstance(value, (tuple, list)):
                    raise TypeError(
                        message(
                            call, key, f"a pair {names}", describe(value), "pass e.g. (0.9, 0.999)"
                        )
                    )
                if len(value) != len(names):
                    raise ValueError(
                        message(
                            call, key, f"a pair {names}", describe(value), "pass e.g. (0.9, 0.999)"
                        )
                    )
                for n, v in zip(names, value, strict=True):
                    values[n] = self._check(n, v, call)
            elif key in self._values:
                values[key] = self._check(key, value, call)
            else:
                known = ", ".join([*self._values, *self._aliases])
                raise TypeError(
                    message(
                        call,
                        key,
                        f"one of this optimizer's hyperparameters ({known})",
                        repr(key),
                        "override only hyperparameters the optimizer has",
                    )
                )
        return values

    def _state_parts(
        self, state: Any, structure: Structure, ps: list[torch.Tensor], call: str
    ) -> tuple[int, list[int], dict[str, list[Any]]]:
        """``(step, counts, slots)`` of ``state``, checked against the parameters."""
        if not isinstance(state, self.state_type):
            raise TypeError(
                message(
                    call,
                    "state",
                    f"a {self.state_type.__name__} from {self.name}.init(params)",
                    describe(state),
                    f"create the state with {self.name}(...).init(params)",
                )
            )
        step = state.step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                message(call, "state.step", "an int >= 0", repr(step), "use the state init gave")
            )
        counts = [step] * len(ps)
        if state.counts is not None:
            counts = entries(state.counts, structure, call, "state.counts")
            for i, c in enumerate(counts):
                if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= step:
                    raise ValueError(
                        message(
                            call,
                            f"state.counts{structure.label(i)}",
                            f"an int in [0, state.step={step}]",
                            repr(c),
                            "use the state init and update gave",
                        )
                    )
        out = {}
        for s in self.slots:
            slot = getattr(state, s)
            if slot is None:
                raise ValueError(
                    message(
                        call,
                        f"state.{s}",
                        "a buffer (this optimizer's settings use it)",
                        "None",
                        f"create the state with {self.name}(...).init(params) of these settings",
                    )
                )
            out[s] = leaves(slot, structure, call, f"state.{s}")
            for i, (v, p) in enumerate(zip(out[s], ps, strict=True)):
                if v.shape != p.shape or v.dtype != p.dtype or v.device != p.device:
                    raise ValueError(
                        message(
                            call,
                            f"state.{s}{structure.label(i)}",
                            f"a buffer like its parameter ({describe(p)} on {p.device})",
                            f"{describe(v)} on {v.device}",
                            "create the state with init(params) of these very parameters",
                        )
                    )
        return step, counts, out

    def _step(
        self, grads: Grads, state: Any, params: Params, hyper: dict[str, Any]
    ) -> tuple[Structure, list[torch.Tensor], list[torch.Tensor], Any]:
        call = f"{self.name}.update"
        structure, ps = self._params(params, call)
        gs = leaves(grads, structure, call, "grads", allow_none=True)
        step, counts, slots = self._state_parts(state, structure, ps, call)
        values = self._merge(hyper, call)
        masks: list[Any] = [None] * len(ps)
        if self.mask is not None:
            masks = leaves(self.mask, structure, call, "mask", allow_none=True)
        for i, (p, g, m) in enumerate(zip(ps, gs, masks, strict=True)):
            if g is not None and (g.shape != p.shape or g.dtype != p.dtype):
                raise ValueError(
                    message(
                        call,
                        f"grads{structure.label(i)}",
                        f"a tensor of the parameter's shape {tuple(p.shape)} and dtype {p.dtype}",
                        describe(g),
                        "pass the gradient of each parameter (or None to skip it)",
                    )
                )
            if m is not None and m.shape != p.shape:
                raise ValueError(
                    message(
                        call,
                        f"mask{structure.label(i)}",
                        f"a boolean tensor of the parameter's shape {tuple(p.shape)}",
                        describe(m),
                        "build the mask from the parameter, e.g. weight != 0",
                    )
                )
        deltas: list[torch.Tensor] = []
        new_slots: dict[str, list[torch.Tensor]] = {s: [] for s in self.slots}
        new_counts: list[int] = []
        for i, (p, g, m) in enumerate(zip(ps, gs, masks, strict=True)):
            own = {s: slots[s][i] for s in self.slots}
            if g is None:  # torch.optim skips the parameter: nothing moves, nothing counts
                deltas.append(torch.zeros_like(p))
                for s in self.slots:
                    new_slots[s].append(own[s])
                new_counts.append(counts[i])
                continue
            p_in = p
            if m is not None:
                g = torch.where(m, g, torch.zeros_like(g))
                p_in = torch.where(m, p, torch.zeros_like(p))
            h = {
                k: widened(resolve(v, k, structure, i, p, step, call), p) for k, v in values.items()
            }
            d, updated = self._rule(g, p_in, own, counts[i], h)
            if m is not None:
                d = torch.where(m, d, -p)
            deltas.append(d if d.dtype == p.dtype else d.to(p.dtype))
            for s in self.slots:
                v = updated.get(s, own[s])
                new_slots[s].append(v if v.dtype == own[s].dtype else v.to(own[s].dtype))
            new_counts.append(counts[i] + (1 if updated or not self.slots else 0))
        fields: dict[str, Any] = {s: rebuild(structure, new_slots[s]) for s in self.slots}
        new_state = self._state(fields, step + 1, rebuild(structure, new_counts))
        return structure, ps, deltas, new_state

    def delta(self, grads: Grads, state: Any, params: Params, **hyper: Any) -> tuple[Any, Any]:
        """The update itself: ``(delta, new_state)`` with ``new_params = params + delta``.

        Keyword arguments override hyperparameters for this step (same forms as at
        construction). A ``None`` gradient leaves its parameter, slots and count unchanged
        (delta 0), as ``torch.optim`` skips parameters without a gradient.
        """
        structure, _, deltas, new_state = self._step(grads, state, params, hyper)
        return rebuild(structure, deltas), new_state

    def update(
        self,
        grads: Grads,
        state: Any,
        params: Params,
        *,
        return_delta: bool = False,
        **hyper: Any,
    ) -> tuple[Any, ...]:
        """One step, out of place: ``(new_params, new_state)``, or
        ``(new_params, new_state, delta)`` with ``return_delta=True``.

        ``new_params = params + delta``; masked entries become exactly zero. Keyword arguments
        override hyperparameters for this step (same forms as at construction). A ``None``
        gradient skips its parameter (weights, slots and count unchanged).
        """
        check_bool(return_delta, f"{self.name}.update", "return_delta")
        structure, ps, deltas, new_state = self._step(grads, state, params, hyper)
        new = rebuild(structure, [p + d for p, d in zip(ps, deltas, strict=True)])
        if return_delta:
            return new, new_state, rebuild(structure, deltas)
        return new, new_state


def apply_updates(params: Params, delta: Params) -> Any:
    """``params + delta``, entry by entry, out of place (mirrors the container of ``params``).

    Examples:
        >>> import torch
        >>> from gradkit.optim import apply_updates
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    call = "apply_updates(params, delta)"
    structure = structure_of(params, call)
    ps = leaves(params, structure, call, "params")
    ds = leaves(delta, structure, call, "delta")
    for i, (p, d) in enumerate(zip(ps, ds, strict=True)):
        if d.shape != p.shape:
            raise ValueError(
                message(
                    call,
                    f"delta{structure.label(i)}",
                    f"a tensor of the parameter's shape {tuple(p.shape)}",
                    describe(d),
                    "pass the delta an optimizer returned for these parameters",
                )
            )
    return rebuild(structure, [p + d for p, d in zip(ps, ds, strict=True)])

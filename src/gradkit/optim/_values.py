"""Hyperparameter values: a number, a tensor (a scalar or a per-step schedule), or one value per
parameter (a dict for dict parameters, a tuple for tuple parameters).

Resolution for parameter ``key`` at step ``count`` (the number of updates done before this one):

* number ``c`` -> ``c``;
* 0-d tensor ``h`` -> ``h`` (differentiable);
* 1-d tensor ``h`` (a schedule) -> ``h[count]``;
* dict / tuple -> the entry of the parameter: a number, or a tensor that broadcasts to the
  parameter's shape (per-element values, e.g. a per-weight L2 coefficient).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any, NamedTuple

import torch

from gradkit._errors import describe, message
from gradkit._tree import Structure

__all__ = ["Bounds", "HyperValue", "Scalar", "check_value", "is_zero", "resolve"]

Scalar = float | torch.Tensor
HyperValue = Any
"""A float, a 0-d tensor, a 1-d schedule tensor, or a dict/tuple of per-parameter values."""

_FIX = "pass a float, a 0-d tensor, a 1-d tensor of one value per step, or one value per parameter"


class Bounds(NamedTuple):
    """The values a hyperparameter may take: ``low <= v <= high``, the bounds excluded with
    ``low_open`` / ``high_open`` (``high=None``: no upper bound)."""

    low: float = 0.0
    high: float | None = None
    high_open: bool = False
    low_open: bool = False

    def expected(self) -> str:
        low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        if self.high is None:
            return low
        return low + (f" and < {self.high:g}" if self.high_open else f" and <= {self.high:g}")

    def holds(self, v: float) -> bool:
        if math.isnan(v) or math.isinf(v):
            return False
        if v <= self.low if self.low_open else v < self.low:
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)


def _check_number(value: Any, call: str, name: str, bounds: Bounds) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(message(call, name, "a number or a tensor", describe(value), _FIX))
    v = float(value)
    if not bounds.holds(v):
        raise ValueError(
            message(call, name, f"a finite value {bounds.expected()}", repr(value), "fix the value")
        )
    return v


def _check_entries(value: torch.Tensor, call: str, name: str, bounds: Bounds) -> None:
    """Check the values of a tensor hyperparameter (one read at construction or override).

    Tensors that cannot be read (inside ``vmap``, on the meta device) are left alone; a tensor
    that requires grad is read through ``detach()`` (its graph is not touched)."""
    try:
        data = value.detach()
        if data.device.type == "meta" or data.numel() == 0:
            return
        flat = data.reshape(-1).double()
        low_ok = flat > bounds.low if bounds.low_open else flat >= bounds.low
        ok = torch.isfinite(flat) & low_ok
        if bounds.high is not None:
            ok &= flat < bounds.high if bounds.high_open else flat <= bounds.high
        bad = (~ok).nonzero()
        if bad.numel() == 0:
            return
        first = int(bad[0, 0])
        shown = float(flat[first])
    except (RuntimeError, NotImplementedError):  # vmap / functorch wrappers, fake tensors
        return
    shape = tuple(value.shape)
    where = "" if value.dim() == 0 else f" (entry {first} of a tensor of shape {shape})"
    raise ValueError(
        message(
            call,
            name,
            f"a tensor of finite values {bounds.expected()}",
            f"{shown!r}{where}",
            "fix the value (a tensor hyperparameter may require grad, but its value must be valid)",
        )
    )


def _check_tensor(
    value: torch.Tensor, call: str, name: str, bounds: Bounds, *, schedule_ok: bool
) -> None:
    if not value.is_floating_point():
        raise TypeError(
            message(
                call,
                name,
                "a floating-point tensor",
                describe(value),
                "convert it with .double() or .float()",
            )
        )
    if schedule_ok and value.dim() > 1:
        raise ValueError(
            message(
                call,
                name,
                "a 0-d tensor or a 1-d schedule (one value per step)",
                describe(value),
                "give per-parameter tensors in a dict (or a tuple) keyed like the parameters",
            )
        )
    _check_entries(value, call, name, bounds)


def check_value(value: Any, call: str, name: str, bounds: Bounds) -> Any:
    """Check a hyperparameter (at construction, or a per-step override) and return it (numbers
    as floats, containers as a dict or a tuple).

    Numbers and every entry of a tensor must be finite and within ``bounds``; tensors must be
    floating point, 0-d or 1-d (a schedule) at the top level, any shape inside a per-parameter
    container. Tensors are read once here (one device synchronization); tensors that require
    grad are accepted (they are the hyperparameters to differentiate).
    """
    if isinstance(value, torch.Tensor):
        _check_tensor(value, call, name, bounds, schedule_ok=True)
        return value
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(item, torch.Tensor):
                _check_tensor(item, call, f"{name}[{key!r}]", bounds, schedule_ok=False)
            else:
                _check_number(item, call, f"{name}[{key!r}]", bounds)
        return dict(value)
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                _check_tensor(item, call, f"{name}[{i}]", bounds, schedule_ok=False)
            else:
                _check_number(item, call, f"{name}[{i}]", bounds)
        return tuple(value)
    return _check_number(value, call, name, bounds)


def is_zero(value: Any) -> bool:
    """Whether a hyperparameter is the number 0 (a tensor is never treated as zero: it may be a
    hyperparameter to differentiate)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, Mapping):
        return all(is_zero(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return all(is_zero(v) for v in value)
    return False


def widened(value: Scalar, param: torch.Tensor) -> Scalar:
    """``value`` in ``param``'s dtype where it is a floating tensor of a narrower one (a float32
    ``torch.tensor(0.9)`` beside float64 parameters): an update rule's arithmetic on tensors and
    numbers alone (Adam's bias corrections ``1 - beta**t``) stays in the tensor's dtype, which
    would round the step (1e-6 relative in float32). Differentiable (``.to``)."""
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and param.is_floating_point()
        and value.dtype != param.dtype
        and torch.finfo(value.dtype).bits < torch.finfo(param.dtype).bits
    ):
        return value.to(param.dtype)
    return value


def resolve(
    value: Any,
    name: str,
    structure: Structure,
    i: int,
    param: torch.Tensor,
    count: int,
    call: str,
) -> Scalar:
    """The value of hyperparameter ``name`` for parameter ``i`` at step ``count``."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        if count >= value.shape[0]:
            raise ValueError(
                message(
                    call,
                    name,
                    f"a schedule with an entry for step {count} (steps count from 0)",
                    f"a schedule of length {value.shape[0]}",
                    "give one value per step you run",
                )
            )
        return value[count]
    if isinstance(value, Mapping):
        key = structure.keys[i]
        if not structure.is_dict or key not in value:
            keys = list(structure.keys) if structure.is_dict else "a tuple"
            raise ValueError(
                message(
                    call,
                    name,
                    f"a value for every parameter (parameters: {keys})",
                    f"keys {list(value.keys())}",
                    "give one value per parameter, keyed like the parameters",
                )
            )
        item = value[key]
    else:
        if structure.is_dict or len(value) != len(structure.keys):
            raise ValueError(
                message(
                    call,
                    name,
                    "one value per parameter in a container like the parameters",
                    f"a tuple of length {len(value)}",
                    "use a dict for dict parameters and a tuple for tuple parameters",
                )
            )
        item = value[i]
    if isinstance(item, torch.Tensor) and item.dim() > 0:
        try:
            shape = torch.broadcast_shapes(item.shape, param.shape)
        except RuntimeError:
            shape = None
        if shape != param.shape:
            raise ValueError(
                message(
                    call,
                    f"{name}{structure.label(i)}",
                    f"a number or a tensor that broadcasts to {tuple(param.shape)}",
                    describe(item),
                    "give a per-element value shaped like the parameter",
                )
            )
    return item

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
from typing import Any

import torch

from gradkit._errors import describe, message
from gradkit.optim._tree import Structure

__all__ = ["HyperValue", "Scalar", "check_value", "is_zero", "resolve"]

Scalar = float | torch.Tensor
HyperValue = Any
"""A float, a 0-d tensor, a 1-d schedule tensor, or a dict/tuple of per-parameter values."""

_FIX = "pass a float, a 0-d tensor, a 1-d tensor of one value per step, or one value per parameter"


def _check_number(
    value: Any, call: str, name: str, low: float, high: float | None, high_open: bool
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(message(call, name, "a number or a tensor", describe(value), _FIX))
    v = float(value)
    too_high = high is not None and (v >= high if high_open else v > high)
    if not math.isfinite(v) or v < low or too_high:
        bound = "" if high is None else (f" and < {high:g}" if high_open else f" and <= {high:g}")
        raise ValueError(
            message(call, name, f"a finite value >= {low:g}{bound}", repr(value), "fix the value")
        )
    return v


def _check_tensor(value: torch.Tensor, call: str, name: str, *, schedule_ok: bool) -> None:
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


def check_value(
    value: Any,
    call: str,
    name: str,
    *,
    low: float = 0.0,
    high: float | None = None,
    high_open: bool = False,
) -> Any:
    """Check a hyperparameter at construction time and return it (numbers as floats).

    Numbers must lie in ``[low, high]`` (``[low, high)`` with ``high_open``); tensors are
    checked for dtype and rank only, never read (no device synchronization).
    """
    if isinstance(value, torch.Tensor):
        _check_tensor(value, call, name, schedule_ok=True)
        return value
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(item, torch.Tensor):
                _check_tensor(item, call, f"{name}[{key!r}]", schedule_ok=False)
            else:
                _check_number(item, call, f"{name}[{key!r}]", low, high, high_open)
        return dict(value)
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                _check_tensor(item, call, f"{name}[{i}]", schedule_ok=False)
            else:
                _check_number(item, call, f"{name}[{i}]", low, high, high_open)
        return tuple(value)
    return _check_number(value, call, name, low, high, high_open)


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

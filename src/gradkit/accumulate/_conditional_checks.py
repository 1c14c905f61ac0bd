"""Argument checks and small helpers shared by the conditional accumulators (every message
names the call, the argument, what was expected and received, and what to do)."""

from __future__ import annotations

import datetime
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = [
    "MISSING",
    "Shape",
    "accumulation_dtype",
    "as_int",
    "as_tensor",
    "check_device",
    "check_dtype",
    "check_grad_dtype",
    "check_local_step",
    "check_num_required",
    "check_shape",
    "check_timeout",
    "fmt_shape",
]

MISSING: Any = object()
"""Sentinel for ``local_step``: it has no default on purpose (see :func:`check_local_step`)."""

Shape = tuple[int | None, ...]


def check_local_step(value: Any, call: str) -> int:
    """``local_step`` as an int. It is required: TensorFlow's default of 0 silently drops every
    gradient after the first take, since the global step is then 1."""
    if value is MISSING:
        raise TypeError(
            message(
                call,
                "local_step",
                "the number of takes (optimizer updates) that had happened when the gradient "
                "was computed",
                "no value",
                "pass it explicitly, e.g. apply_grad(grad, local_step=acc.global_step); there "
                "is no default because TensorFlow's default local_step=0 makes every gradient "
                "stale, silently dropped, once the first take has set the global step to 1",
            )
        )
    return as_int(value, call, "local_step", "an int (the step the gradient was computed at)")


def check_num_required(value: Any, call: str) -> int:
    """``num_required`` as an int >= 1 (TensorFlow: "Argument num_required must be positive")."""
    n = as_int(value, call, "num_required", "an int >= 1")
    if n < 1:
        raise ValueError(
            message(
                call,
                "num_required",
                "a positive int (the number of gradients to wait for)",
                repr(n),
                "pass num_required >= 1; nothing was consumed",
            )
        )
    return n


def as_int(value: Any, call: str, argument: str, expected: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise TypeError(
                message(
                    call, argument, expected, f"{describe(value)} on the meta device", "pass an int"
                )
            )
        if value.dim() != 0:
            raise ValueError(message(call, argument, f"a scalar: {expected}", value, "pass an int"))
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(message(call, argument, expected, value, "pass an int"))
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(message(call, argument, expected, repr(value), "pass an int"))
    return int(value)


def check_timeout(value: Any, call: str) -> float | None:
    """``timeout`` in seconds (a number >= 0 or a ``datetime.timedelta``), or ``None``."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or math.isnan(float(value))
        or value < 0
    ):
        raise ValueError(
            message(
                call,
                "timeout",
                "None (wait forever) or a number of seconds >= 0",
                repr(value),
                "pass e.g. timeout=10.0",
            )
        )
    return float(value)


def check_dtype(dtype: Any, call: str) -> torch.dtype:
    """A floating or complex ``torch.dtype`` (gradients are real or complex numbers)."""
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            message(
                call,
                "dtype",
                "a floating or complex torch.dtype",
                repr(dtype),
                "pass e.g. dtype=torch.float32",
            )
        )
    return dtype


def check_shape(shape: Any, call: str) -> Shape | None:
    """A partial shape: ``None`` (unknown rank) or a sequence of ints >= 0 and ``None``s."""
    if shape is None:
        return None
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(
            message(
                call,
                "shape",
                "None or a sequence of ints and Nones (unknown dims)",
                repr(shape),
                "pass e.g. shape=(3, None)",
            )
        )
    out: list[int | None] = []
    for d in shape:
        if d is None:
            out.append(None)
        elif isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise ValueError(
                message(
                    call,
                    "shape",
                    "dims that are ints >= 0 or None (unknown)",
                    repr(tuple(shape)),
                    "pass e.g. shape=(3, None)",
                )
            )
        else:
            out.append(int(d))
    return tuple(out)


def fmt_shape(shape: Sequence[int | None] | None) -> str:
    """``(3, ?)`` for a partial shape, ``<unknown rank>`` for ``None``."""
    if shape is None:
        return "<unknown rank>"
    dims = ["?" if d is None else str(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def check_grad_dtype(got: torch.dtype, want: torch.dtype, call: str, argument: str) -> None:
    """Accept ``want`` itself or a floating/complex dtype that widens to it losslessly
    (``float16``/``bfloat16`` -> ``float32`` -> ``float64``, real -> complex). Narrowing casts
    (``float64`` -> ``float32``), integer and bool tensors are rejected."""
    if got == want:
        return
    if (got.is_floating_point or got.is_complex) and torch.promote_types(got, want) == want:
        return
    raise TypeError(
        message(
            call,
            f"{argument}.dtype",
            f"{want} or a floating dtype that converts to it without loss",
            str(got),
            f"cast the gradient yourself (.to({want})) or create the accumulator with the "
            "gradient's dtype",
        )
    )


def as_tensor(value: Any, call: str, argument: str) -> torch.Tensor:
    """``value`` if it is a tensor that holds data (meta tensors have none)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(message(call, argument, "a torch.Tensor", describe(value), "pass a tensor"))
    if value.is_meta:
        raise ValueError(
            message(
                call,
                argument,
                "a tensor with data",
                f"{describe(value)} on the meta device (shapes only, no values)",
                "pass the gradient computed on a real device; nothing was added",
            )
        )
    return value


def check_device(device: Any, call: str) -> torch.device:
    """A device that exists here and holds data: a ``torch.device`` or a string such as
    ``"cpu"`` or ``"cuda:0"`` (not ``"meta"``; not ``"cuda"`` without a GPU)."""
    fix = "pass e.g. device='cpu' or device='cuda:0'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(
            message(call, "device", "a torch.device or a device string", f"{device!r} ({err})", fix)
        ) from err
    if dev.type == "meta":
        raise ValueError(
            message(call, "device", "a device that holds data", "'meta' (shapes only)", fix)
        )
    if dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception as err:  # torch raises RuntimeError or AssertionError here
            raise ValueError(
                message(call, "device", "a device available here", f"{dev} ({err})", fix)
            ) from err
    return dev


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision sums in float32 (exact to more digits); other dtypes sum in themselves."""
    return torch.promote_types(dtype, torch.float32)

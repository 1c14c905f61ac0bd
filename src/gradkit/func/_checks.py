"""Checks of scalar arguments shared by :mod:`gradkit.func` and :mod:`gradkit.curvature`.

Every check raises a ``TypeError`` (wrong type) or ``ValueError`` (wrong value) worded by
:func:`gradkit._errors.message`: the call, the argument, what was expected, what was received and
what to do. ``bool`` is refused where an int is expected (``True`` is an ``int`` in Python).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = [
    "check_bool",
    "check_callable",
    "check_float",
    "check_int",
    "check_optional_int",
    "check_tensor",
    "is_transformed",
]


def check_int(value: Any, call: str, argument: str, *, minimum: int = 1, example: int = 1) -> int:
    """``value`` as an int ``>= minimum`` (refusing bools, floats and strings).

    Examples:
        >>> check_int(3, "f()", "k")
        3
        >>> check_int(0, "f()", "k")
        Traceback (most recent call last):
        ...
        ValueError: f(): k: expected an int >= 1, got 0; pass e.g. k=1
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            message(
                call,
                argument,
                f"an int >= {minimum}",
                repr(value),
                f"pass e.g. {argument}={example}",
            )
        )
    if value < minimum:
        raise ValueError(
            message(
                call,
                argument,
                f"an int >= {minimum}",
                repr(value),
                f"pass e.g. {argument}={example}",
            )
        )
    return value


def check_optional_int(
    value: Any, call: str, argument: str, *, minimum: int = 1, example: int = 64
) -> int | None:
    """``None`` or an int ``>= minimum`` (chunk sizes, limits)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
        raise error(
            message(
                call,
                argument,
                f"None or an int >= {minimum}",
                repr(value),
                f"pass e.g. {argument}={example}",
            )
        )
    return value


def check_float(
    value: Any, call: str, argument: str, *, positive: bool = False, example: str = "1e-6"
) -> float:
    """``value`` as a finite real number, ``> 0`` when ``positive`` else ``>= 0``."""
    kind = "a positive finite number" if positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            message(call, argument, kind, repr(value), f"pass e.g. {argument}={example}")
        )
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(
            message(call, argument, kind, repr(value), f"pass e.g. {argument}={example}")
        )
    return number


def check_bool(value: Any, call: str, argument: str, *, optional: bool = False) -> bool | None:
    """``value`` as a bool (``None`` too when ``optional``); strings like ``"no"`` are refused
    rather than read as true."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        expected = "True, False or None" if optional else "True or False"
        raise TypeError(
            message(call, argument, expected, repr(value), f"pass {argument}=True or False")
        )
    return value


def check_callable(f: Any, call: str, argument: str = "f", what: str = "a function") -> None:
    """Raise a TypeError naming ``call`` unless ``f`` is callable."""
    if not callable(f):
        raise TypeError(
            message(
                call, argument, f"a callable ({what})", describe(f), f"pass {what} as {argument}"
            )
        )


def check_tensor(value: Any, call: str, argument: str) -> torch.Tensor:
    """``value`` if it is a tensor, else a TypeError naming ``call``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            message(
                call,
                argument,
                "a torch.Tensor",
                describe(value),
                f"convert it with torch.as_tensor({argument})",
            )
        )
    return value


def is_transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (inside ``vmap``/``grad``), whose values cannot
    be read."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False

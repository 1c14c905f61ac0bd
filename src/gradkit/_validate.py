"""Argument normalization shared by every pillar (argnums, tensor sequences, choices)."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from numbers import Real
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = [
    "as_tensor_list",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_int",
    "check_module",
    "check_number",
    "check_optional_int",
    "check_tensor",
    "expose",
    "is_batching_error",
    "normalize_argnums",
]


def normalize_argnums(argnums: Any, nargs: int, call: str) -> tuple[int, ...]:
    """Turn ``argnums`` (an int or a non-empty tuple of ints) into a tuple of indices.

    Negative indices count from the end, as in Python. Duplicates are an error.

    Examples:
        >>> normalize_argnums(0, 2, "grad(f)")
        (0,)
        >>> normalize_argnums((1, -1), 3, "grad(f)")
        (1, 2)
        >>> normalize_argnums((1, -2), 3, "grad(f)")
        Traceback (most recent call last):
        ...
        ValueError: grad(f): argnums: expected distinct indices, got (1, -2); ...
    """
    items: tuple[Any, ...]
    if isinstance(argnums, bool) or not isinstance(argnums, (int, tuple, list)):
        raise TypeError(
            message(
                call,
                "argnums",
                "an int or a tuple of ints",
                repr(argnums),
                "pass e.g. argnums=0 or argnums=(0, 1)",
            )
        )
    items = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not items:
        raise ValueError(
            message(call, "argnums", "at least one index", "()", "pass e.g. argnums=0")
        )
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(
                message(call, "argnums", "ints", repr(argnums), "pass e.g. argnums=(0, 1)")
            )
        if not -nargs <= a < nargs:
            raise ValueError(
                message(
                    call,
                    "argnums",
                    f"indices in [{-nargs}, {nargs}) (f was given {nargs} positional "
                    "argument" + ("" if nargs == 1 else "s") + ")",
                    repr(argnums),
                    "pass the index of one of the positional arguments",
                )
            )
        out.append(a % nargs)
    if len(set(out)) != len(out):
        raise ValueError(
            message(call, "argnums", "distinct indices", repr(argnums), "list each argument once")
        )
    return tuple(out)


def as_tensor_list(
    value: Any, call: str, argument: str, *, allow_none: bool = False
) -> tuple[list[Any], bool]:
    """Normalize a tensor or a sequence of tensors to a list.

    Returns ``(items, was_sequence)`` so results can mirror the caller's structure.
    """
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        items = list(value)
        for i, item in enumerate(items):
            if item is None and allow_none:
                continue
            if not isinstance(item, torch.Tensor):
                raise TypeError(
                    message(
                        call,
                        f"{argument}[{i}]",
                        "a torch.Tensor",
                        describe(item),
                        f"pass tensors in {argument}",
                    )
                )
        return items, True
    raise TypeError(
        message(
            call,
            argument,
            "a tensor or a list of tensors",
            describe(value),
            f"pass a torch.Tensor or a list of them as {argument}",
        )
    )


def check_choice(value: Any, choices: Sequence[str], call: str, argument: str) -> str:
    """Check that ``value`` is one of ``choices`` (strings) and return it."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(
            message(call, argument, f"one of {options}", repr(value), f"pass one of {options}")
        )
    return value


def is_batching_error(err: BaseException) -> bool:
    """Whether ``err`` says that vectorization (vmap / batched gradients) failed, as opposed to
    an error a one-at-a-time loop would hit too (e.g. out of memory)."""
    text = str(err).lower()
    return "out of memory" not in text and any(
        w in text for w in ("vmap", "batching rule", "batched", "is_grads_batched")
    )


def check_module(model: Any, call: str, fix: str = "pass the model itself") -> None:
    """Raise a TypeError naming ``call`` unless ``model`` is a ``torch.nn.Module``."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(message(call, "model", "a torch.nn.Module", describe(model), fix))


def expose(namespace: dict[str, Any], names: Sequence[str], public: str) -> None:
    """Give the re-exported objects of a public package its path as ``__module__`` (reprs and
    docs then show ``gradkit.func.jacobian``, never the private module)."""
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", "").startswith(public + "._"):
            obj.__module__ = public


def check_bool(value: Any, call: str, argument: str, *, optional: bool = False) -> bool | None:
    """Raise a TypeError naming ``call`` and ``argument`` unless ``value`` is a bool (or ``None``
    when ``optional``). ``1``, ``"yes"`` and ``"no"`` are refused: a flag given by position or
    as a string is a mistake, and ``"no"`` would read as true.

    Examples:
        >>> check_bool(True, "sgd", "nesterov")
        True
        >>> check_bool(1, "sgd", "nesterov")
        Traceback (most recent call last):
        ...
        TypeError: sgd: nesterov: expected a bool, got 1; pass nesterov=True or nesterov=False
    """
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise TypeError(
            message(
                call,
                argument,
                "a bool or None" if optional else "a bool",
                describe(value),
                f"pass {argument}=True or {argument}=False",
            )
        )
    return value


def check_int(
    value: Any,
    call: str,
    argument: str,
    *,
    low: int | None = None,
    high: int | None = None,
    example: object = None,
    fix: str | None = None,
) -> int:
    """``value`` as an int in ``[low, high]`` (either bound optional).

    Accepts ints and integer scalars such as ``numpy.int64`` (anything with ``__index__``), not
    bools or floats (``2.0`` is a TypeError: a float count is usually a mixed-up argument).
    Wrong type: TypeError; out of range: ValueError; both say the range. The message's remedy
    is ``pass e.g. argument=example`` (``example`` defaults to ``low``), or ``fix`` when given.

    Examples:
        >>> check_int(3, "reverse", "steps", low=1)
        3
        >>> check_int(0, "reverse", "steps", low=1)
        Traceback (most recent call last):
        ...
        ValueError: reverse: steps: expected an int >= 1, got 0; pass e.g. steps=1
    """
    return _check_int(value, call, argument, low, high, example, fix, optional=False)


def check_optional_int(
    value: Any,
    call: str,
    argument: str,
    *,
    low: int = 1,
    example: object = 64,
    fix: str | None = None,
) -> int | None:
    """``None`` (no limit, the default chunking) or an int ``>= low``, as :func:`check_int`.

    Examples:
        >>> check_optional_int(None, "f", "chunk") is None
        True
        >>> check_optional_int(0, "f", "chunk")
        Traceback (most recent call last):
        ...
        ValueError: f: chunk: expected None or an int >= 1, got 0; pass e.g. chunk=64
    """
    if value is None:
        return None
    return _check_int(value, call, argument, low, None, example, fix, optional=True)


def _check_int(
    value: Any,
    call: str,
    argument: str,
    low: int | None,
    high: int | None,
    example: object,
    fix: str | None,
    *,
    optional: bool,
) -> int:
    wrong_type = isinstance(value, bool) or not hasattr(value, "__index__")
    number = 0 if wrong_type else operator.index(value)
    if not (
        wrong_type or (low is not None and number < low) or (high is not None and number > high)
    ):
        return number
    # the message is built only for an error (the checks sit on per-call paths)
    fix = fix or f"pass e.g. {argument}={example if example is not None else (low or 1)}"
    if high is None:
        expected = "an int" if low is None else f"an int >= {low}"
    elif low is None:
        expected = f"an int <= {high}"
    else:
        expected = f"an int in [{low}, {high}]"
    if optional:
        expected = "None or " + expected
    if wrong_type:
        raise TypeError(message(call, argument, expected, describe(value), fix))
    raise ValueError(message(call, argument, expected, repr(value), fix))


def one_number(value: Any) -> Any:
    """``value`` as a Python number where it is a one-element real floating tensor (a learning
    rate kept as a tensor in an optimizer's ``param_groups``), else as it is: for arguments that
    are read once, where reading the tensor (a host sync) costs nothing that matters."""
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and value.is_floating_point()
        and not value.is_complex()
    ):
        return float(value.detach())
    return value


def check_number(
    value: Any,
    call: str,
    argument: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    example: object = None,
    fix: str | None = None,
) -> float:
    """``value`` as a float: a real number (int, float, numpy scalar; not a bool, a string or a
    tensor), finite unless ``finite=False`` (NaN is never accepted), within the bounds
    (``low_open``/``high_open`` exclude them). Wrong type: TypeError; bad value: ValueError.
    The remedy is ``pass e.g. argument=example``, or ``fix`` when given.

    Examples:
        >>> check_number(1e-3, "implicit", "tol", low=0)
        0.001
        >>> check_number(0.0, "adam", "eps", low=0, low_open=True)
        Traceback (most recent call last):
        ...
        ValueError: adam: eps: expected a finite number > 0, got 0.0; pass e.g. eps=...
    """
    wrong_type = isinstance(value, bool) or not isinstance(value, Real)
    number = math.nan if wrong_type else float(value)
    bad = math.isnan(number) or (finite and math.isinf(number))
    if low is not None:
        bad = bad or (number <= low if low_open else number < low)
    if high is not None:
        bad = bad or (number >= high if high_open else number > high)
    if not bad:
        return number
    # the message is built only for an error (the checks sit on per-call paths)
    fix = fix or f"pass e.g. {argument}={example if example is not None else '...'}"
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    expected = ("a finite number" if finite else "a number") + (
        " " + " and ".join(parts) if parts else ""
    )
    if wrong_type:
        raise TypeError(message(call, argument, expected, describe(value), fix))
    raise ValueError(message(call, argument, expected, repr(value), fix))


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

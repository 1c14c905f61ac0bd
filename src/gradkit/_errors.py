"""Errors raised by gradkit and the helpers that word their messages.

Every message names the call and the argument, shows what was expected and what was received,
and says what to do, e.g.::

    jacobian(f, argnums=2): expected argnums < 2 (f was given 2 positional arguments), got 2;
    pass an index of one of the positional arguments.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GradkitError", "describe", "message"]


class GradkitError(Exception):
    """Base class for errors specific to gradkit (bad input raises ValueError/TypeError)."""


def describe(value: Any) -> str:
    """A short description of ``value`` for error messages (tensors by shape and dtype)."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        kind = "list" if isinstance(value, list) else "tuple"
        return f"{kind}[{inner}{more}] (length {len(value)})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def message(call: str, argument: str, expected: str, got: Any, fix: str) -> str:
    """Word an error: ``"call: argument: expected ..., got ...; fix"``."""
    received = got if isinstance(got, str) else describe(got)
    return f"{call}: {argument}: expected {expected}, got {received}; {fix}"

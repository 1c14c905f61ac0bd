"""``tree_flatten`` for the structures a module call has almost always: one tensor, a tuple of
tensors, or ``(args, {})`` with tensor ``args``.

The tracker flattens every call's inputs and outputs; ``torch.utils._pytree`` builds a new
``TreeSpec`` each time (about 10 us per call), which adds up to a large share of a small
model's step. These functions give the same leaves in the same order and reuse one spec per
structure; anything else goes to ``torch.utils._pytree``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["flatten", "leaves", "unflatten"]

_SPECS: dict[tuple[str, int], TreeSpec] = {}
_KIND: dict[int, tuple[str, int]] = {}  # id(spec) -> its structure, for unflatten


def _key(value: Any) -> tuple[str, int] | None:
    if isinstance(value, torch.Tensor):
        return ("tensor", 1)
    if type(value) is tuple:
        if all(isinstance(v, torch.Tensor) for v in value):
            return ("tuple", len(value))
        if (
            len(value) == 2
            and type(value[0]) is tuple
            and type(value[1]) is dict
            and not value[1]
            and all(isinstance(v, torch.Tensor) for v in value[0])
        ):
            return ("call", len(value[0]))
    return None


def _leaves_of(value: Any, key: tuple[str, int]) -> list[Any]:
    if key[0] == "tensor":
        return [value]
    return list(value[0] if key[0] == "call" else value)


def leaves(value: Any) -> list[Any]:
    """``tree_flatten(value)[0]``."""
    key = _key(value)
    return tree_flatten(value)[0] if key is None else _leaves_of(value, key)


def flatten(value: Any) -> tuple[list[Any], TreeSpec]:
    """``tree_flatten(value)``, with the spec of a common structure built once."""
    key = _key(value)
    if key is None:
        return tree_flatten(value)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = tree_flatten(value)[1]
        _KIND[id(spec)] = key
    return _leaves_of(value, key), spec


def unflatten(values: list[Any], spec: TreeSpec) -> Any:
    """``tree_unflatten(values, spec)``."""
    kind = _KIND.get(id(spec))  # the cached specs live as long as the process: ids stay theirs
    if kind is None:
        return tree_unflatten(values, spec)
    if kind[0] == "tensor":
        return values[0]
    if kind[0] == "tuple":
        return tuple(values)
    return (tuple(values), {})

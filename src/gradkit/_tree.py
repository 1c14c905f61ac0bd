"""Parameter containers: a dict ``name -> tensor`` or a tuple of tensors, walked in one order.

Every optimizer accepts either; results (new parameters, deltas, state slots) mirror the
container the parameters came in: a dict with the same keys in the same order, or a tuple.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gradkit._errors import describe, message

__all__ = ["Grads", "Params", "Structure", "entries", "leaves", "rebuild", "structure_of"]

Params = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
"""Parameters (and anything shaped like them): a dict ``name -> tensor`` or a tuple."""

Grads = Mapping[str, torch.Tensor | None] | Sequence[torch.Tensor | None]
"""Gradients shaped like the parameters; ``None`` for a parameter without a gradient (skipped,
as ``torch.optim`` skips a parameter whose ``.grad`` is None)."""


class Structure(NamedTuple):
    """The layout of a parameter container: its keys (names, or indices of a tuple)."""

    keys: tuple[Any, ...]
    is_dict: bool

    def label(self, i: int) -> str:
        """``"['w']"`` for a dict entry, ``"[0]"`` for a tuple entry."""
        return f"[{self.keys[i]!r}]"


def structure_of(params: Any, call: str, argument: str = "params") -> Structure:
    """The :class:`Structure` of ``params``; raises unless it is a dict of tensors or a
    tuple/list of tensors."""
    if isinstance(params, Mapping):
        keys: tuple[Any, ...] = tuple(params.keys())
        values = list(params.values())
        is_dict = True
    elif isinstance(params, (tuple, list)):
        keys, values, is_dict = tuple(range(len(params))), list(params), False
    else:
        raise TypeError(
            message(
                call,
                argument,
                "a dict name -> tensor or a tuple of tensors",
                describe(params),
                "pass e.g. dict(model.named_parameters())",
            )
        )
    for key, value in zip(keys, values, strict=True):
        if is_dict and not isinstance(key, str):
            raise TypeError(
                message(call, argument, "string keys", repr(key), "name parameters by strings")
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                message(
                    call,
                    f"{argument}[{key!r}]",
                    "a torch.Tensor",
                    describe(value),
                    f"pass tensors in {argument}",
                )
            )
    return Structure(keys, is_dict)


def entries(
    value: Any, structure: Structure, call: str, argument: str, what: str = "entries"
) -> list[Any]:
    """The entries of ``value`` in the order of ``structure``, whatever they are; raises when
    ``value`` is not a container of the same kind with the same keys (or length)."""
    expected = (
        f"a dict with the keys {list(structure.keys)}"
        if structure.is_dict
        else f"a tuple of {len(structure.keys)} {what}"
    )
    fix = f"give {argument} the structure of the parameters"
    if structure.is_dict:
        if not isinstance(value, Mapping) or list(value.keys()) != list(structure.keys):
            if isinstance(value, Mapping) and set(value.keys()) == set(structure.keys):
                return [value[k] for k in structure.keys]
            got = f"keys {list(value.keys())}" if isinstance(value, Mapping) else value
            raise ValueError(message(call, argument, expected, got, fix))
        return list(value.values())
    if not isinstance(value, (tuple, list)) or len(value) != len(structure.keys):
        raise ValueError(message(call, argument, expected, value, fix))
    return list(value)


def leaves(
    value: Any,
    structure: Structure,
    call: str,
    argument: str,
    *,
    allow_none: bool = False,
) -> list[Any]:
    """The tensors of ``value`` in the order of ``structure``; raises when ``value`` is not a
    container of the same kind with the same keys (or length), or holds something else than
    tensors (and ``None`` with ``allow_none``)."""
    items = entries(value, structure, call, argument, "tensors")
    for key, item in zip(structure.keys, items, strict=True):
        if item is None and allow_none:
            continue
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                message(
                    call,
                    f"{argument}[{key!r}]",
                    "a torch.Tensor" + (" or None" if allow_none else ""),
                    describe(item),
                    f"pass tensors in {argument}",
                )
            )
    return items


def rebuild(structure: Structure, values: Sequence[Any]) -> Any:
    """A dict (same keys) or a tuple holding ``values``, as ``structure`` says."""
    if structure.is_dict:
        return dict(zip(structure.keys, values, strict=True))
    return tuple(values)

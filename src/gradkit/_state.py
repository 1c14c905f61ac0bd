"""Whether the tensors an operator was built from changed since: an optimizer step, an edit of
``p.data``, ``p.add_`` under ``no_grad``, a swapped parameter, ``model.train()``/``eval()``.

Operators that keep a graph (:class:`gradkit.func.HVPOperator`, the curvature operators of
:mod:`gradkit.curvature` on one batch) record, when they are built:

* each tensor's version counter ``t._version`` (bumped by every in-place operation autograd
  sees: ``optimizer.step()``, ``p.add_`` under ``no_grad``) and its storage address (a new
  ``p.data = ...`` replaces it);
* a bitwise copy of the values (``p.data.add_(...)`` bumps no version counter, so only the
  values tell); it costs the memory of the tracked tensors once;
* which tensor object each name is (a parameter replaced by a new ``nn.Parameter``) and every
  module's ``training`` flag (dropout and BatchNorm change the function, not the tensors).

:meth:`TensorState.changed` compares the cheap parts first and the values last (one pass over
the tracked tensors, much less than one product).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["TensorState", "graph_leaves", "named_state"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers, so that NaNs compare equal to themselves."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    if t.dtype == torch.bool or size not in _INT_OF_SIZE or not t.is_floating_point():
        return t
    return t.view(_INT_OF_SIZE[size])


def _address(t: torch.Tensor) -> int:
    """Where ``t``'s values live (0 where there is no single address: meta, sparse)."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return 0
    return int(t.data_ptr())


def _comparable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.device.type != "meta"


def named_state(
    model: nn.Module, extra: Sequence[tuple[str, torch.Tensor]] = ()
) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers of ``model`` by name, then ``extra``."""
    named: list[tuple[str, torch.Tensor]] = [
        (f"parameter {n!r}", p) for n, p in model.named_parameters()
    ]
    named += [(f"buffer {n!r}", b) for n, b in model.named_buffers()]
    return named + list(extra)


def graph_leaves(roots: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that the graphs of ``roots`` reach (``AccumulateGrad``
    nodes): the parameters a function used, whether passed or captured."""
    seen: set[torch.autograd.graph.Node] = set()
    stack = [r.grad_fn for r in roots if r is not None and r.grad_fn is not None]
    leaves: dict[int, torch.Tensor] = {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return list(leaves.values())


class TensorState:
    """The state of named tensors (and of a model's modes) at one moment.

    Args:
        named: ``(label, tensor)`` pairs; the label names the tensor in messages.
        modules: modules whose ``training`` flags (and parameter objects) are part of the state.
        values: also keep a bitwise copy of the values (to catch edits of ``p.data``); without
            it only versions, storage and identity are compared.
        data: ``(label, tensor)`` pairs compared by version and storage only (inputs).
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        *,
        modules: nn.Module | None = None,
        values: bool = True,
        data: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> None:
        self._named = list(named)
        self._data = list(data)
        self._modules = modules
        self._values = values
        self._copies: list[torch.Tensor] = []
        self.record()

    def _modes(self) -> tuple[bool, ...]:
        if self._modules is None:
            return ()
        return tuple(m.training for m in self._modules.modules())

    def _stamps(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]]:
        return [(t._version, _address(t)) for _, t in named]

    def record(self) -> None:
        """Take the current state as the reference."""
        self._ids = [id(t) for _, t in self._named]
        self._stamp = self._stamps(self._named)
        self._data_stamp = self._stamps(self._data)
        self._mode = self._modes()
        if self._values:
            with torch.no_grad():
                self._copies = [
                    t.detach().clone() if _comparable(t) else t.new_empty(0) for _, t in self._named
                ]

    def same_objects(self, current: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``current`` names the same tensor objects as the recorded state."""
        return [label for label, _ in current] == [label for label, _ in self._named] and [
            id(t) for _, t in current
        ] == self._ids

    def changed(self) -> str | None:
        """``None`` if nothing changed since :meth:`record`, else what changed, in words."""
        for (label, _), (version, ptr), (nv, nptr) in zip(
            self._named, self._stamp, self._stamps(self._named), strict=True
        ):
            if nptr != ptr:
                return f"{label} has new storage (an assignment to .data)"
            if nv != version:
                return (
                    f"{label} was modified in place, e.g. by an optimizer step (version "
                    f"{version} -> {nv})"
                )
        for (label, _), (version, ptr), (nv, nptr) in zip(
            self._data, self._data_stamp, self._stamps(self._data), strict=True
        ):
            if nv != version or nptr != ptr:
                return f"{label} was modified in place"
        if self._modes() != self._mode:
            return "a module switched between train() and eval()"
        if self._values and self._edited():
            for (label, t), copy in zip(self._named, self._copies, strict=True):
                if _comparable(t) and not torch.equal(_bits(t), _bits(copy)):
                    return f"{label} holds other values (an edit of .data, which bumps no version)"
        return None

    def _edited(self) -> bool:
        """Whether any value differs from its copy: one host read per device (a GPU waits for
        its queued work once per check, not once per tensor)."""
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for (_, t), copy in zip(self._named, self._copies, strict=True):
            if _comparable(t) and t.numel():
                flags.setdefault(t.device, []).append((_bits(t) != _bits(copy)).any())
        return any(bool(torch.stack(fs).any()) for fs in flags.values())

"""One contiguous vector for the parameters and an optimizer's state (RFHO's ``MergedVariable``):
what the hypergradient engines store per step, one row of a preallocated history buffer.

Layout: the parameters in container order, then each state slot (in the state's field order),
each in container order. The step counts are not stored: the global one is the row's step
index, the per-parameter ones (``state.counts``, plain ints) are kept beside the buffer by
whoever stores the rows and passed to :meth:`StateLayout.unflatten`.
"""

from __future__ import annotations

from typing import Any

import torch

from gradkit._errors import describe, message
from gradkit._tree import Params, Structure, entries, leaves, rebuild, structure_of
from gradkit._validate import check_int

__all__ = ["StateLayout", "state_layout"]


class StateLayout:
    """Where parameters and state slots lie in one flat vector of ``size`` elements.

    Built by :func:`state_layout`. :meth:`unflatten` returns *views* of the vector, so a
    vector that requires grad gives parameters and slots in its graph.

    Attributes:
        size: the number of elements of the flat vector.
        num_params: the number of elements of the parameter part (it comes first).
        fields: the state slots stored after the parameters.
        names: one label per segment, e.g. ``"params['w']"``, ``"exp_avg['w']"``.
        dtype, device: those of every tensor in the layout.
    """

    def __init__(
        self,
        structure: Structure,
        shapes: list[torch.Size],
        fields: tuple[str, ...],
        state_type: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.structure = structure
        self.shapes = shapes
        self.fields = fields
        self.state_type = state_type
        self.dtype = dtype
        self.device = device
        self._sizes = [s.numel() for s in shapes] * (1 + len(fields))
        self.num_params = sum(s.numel() for s in shapes)
        self.size = self.num_params * (1 + len(fields))
        self.names = [
            f"{field}{structure.label(i)}"
            for field in ("params", *fields)
            for i in range(len(shapes))
        ]

    def __repr__(self) -> str:
        return (
            f"StateLayout(size={self.size}, num_params={self.num_params}, "
            f"fields={self.fields}, dtype={self.dtype})"
        )

    def flatten(
        self, params: Params, state: Any, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Concatenate parameters and slots into a vector ``[size]`` (differentiable; with
        ``out`` written into that tensor without a graph)."""
        call = "StateLayout.flatten"
        parts = leaves(params, self.structure, call, "params")
        for f in self.fields:
            parts += leaves(getattr(state, f), self.structure, call, f"state.{f}")
        flat = [t.reshape(-1) for t in parts]
        if [t.numel() for t in flat] != self._sizes:
            raise ValueError(
                message(
                    call,
                    "params",
                    f"tensors of shapes {[tuple(s) for s in self.shapes]}",
                    describe(parts),
                    "flatten parameters and state of the layout's structure",
                )
            )
        if out is None:
            return torch.cat(flat)
        if (
            not isinstance(out, torch.Tensor)
            or out.shape != (self.size,)
            or out.dtype != self.dtype
        ):
            raise ValueError(
                message(
                    call,
                    "out",
                    f"a 1-d tensor of {self.size} elements of dtype {self.dtype}",
                    describe(out),
                    "pass a row of a buffer made for this layout, or out=None",
                )
            )
        with torch.no_grad():
            return torch.cat(flat, out=out)

    def _check_vector(self, vector: Any, call: str) -> None:
        if not isinstance(vector, torch.Tensor) or vector.shape != (self.size,):
            raise ValueError(
                message(
                    call,
                    "vector",
                    f"a 1-d tensor of {self.size} elements",
                    describe(vector),
                    "pass a vector made by this layout's flatten",
                )
            )

    def params_of(self, vector: torch.Tensor) -> Any:
        """The parameter part of ``vector`` as views shaped like the parameters."""
        self._check_vector(vector, "StateLayout.params_of")
        pieces = vector[: self.num_params].split(self._sizes[: len(self.shapes)])
        return rebuild(
            self.structure, [p.view(s) for p, s in zip(pieces, self.shapes, strict=True)]
        )

    def unflatten(self, vector: torch.Tensor, *, step: int, counts: Any = None) -> tuple[Any, Any]:
        """``(params, state)`` as views of ``vector``, the state at step count ``step`` with the
        per-parameter counts ``counts`` (a container like the parameters of ints; None: ``step``
        for every parameter, i.e. every parameter had a gradient at every step)."""
        call = "StateLayout.unflatten"
        self._check_vector(vector, call)
        step = check_int(step, call, "step", low=0)
        if counts is not None:
            entries(counts, self.structure, call, "counts")
        pieces = [
            p.view(s)
            for p, s in zip(
                vector.split(self._sizes), self.shapes * (1 + len(self.fields)), strict=True
            )
        ]
        n = len(self.shapes)
        params = rebuild(self.structure, pieces[:n])
        slots = {
            f: rebuild(self.structure, pieces[n * (k + 1) : n * (k + 2)])
            for k, f in enumerate(self.fields)
        }
        missing = {f: None for f in self.state_type._fields if f not in slots}
        missing.pop("step", None)
        missing["counts"] = counts
        return params, self.state_type(step=step, **slots, **missing)


def state_layout(params: Params, state: Any) -> StateLayout:
    """The :class:`StateLayout` of ``params`` and an optimizer state (from ``opt.init``).

    All tensors must share one dtype and device.

    Examples:
        >>> import torch
        >>> from gradkit.optim import sgd, state_layout
        >>> params = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
        >>> opt = sgd(lr=0.1, momentum=0.9)
        >>> layout = state_layout(params, opt.init(params))
        >>> layout.size, layout.names
        (18, ["params['w']", "params['b']", "momentum_buffer['w']", "momentum_buffer['b']"])
        >>> vec = layout.flatten(params, opt.init(params))
        >>> p, s = layout.unflatten(vec, step=0)
        >>> p["w"].shape, s.momentum_buffer["b"].shape
        (torch.Size([2, 3]), torch.Size([3]))
    """
    call = "state_layout(params, state)"
    structure = structure_of(params, call)
    tensors = leaves(params, structure, call, "params")
    if not hasattr(state, "_fields") or "step" not in state._fields:
        raise TypeError(
            message(
                call,
                "state",
                "an optimizer state (a NamedTuple with a step field)",
                describe(state),
                "pass opt.init(params)",
            )
        )
    fields = tuple(
        f for f in state._fields if f not in ("step", "counts") and getattr(state, f) is not None
    )
    n = len(tensors)
    for f in fields:
        slot = leaves(getattr(state, f), structure, call, f"state.{f}")
        for i, (v, p) in enumerate(zip(slot, tensors[:n], strict=True)):
            if v.shape != p.shape:
                raise ValueError(
                    message(
                        call,
                        f"state.{f}{structure.label(i)}",
                        f"a buffer shaped like its parameter {tuple(p.shape)}",
                        describe(v),
                        "pass the state opt.init(params) gave for these parameters",
                    )
                )
        tensors += slot
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise TypeError(
            message(
                call,
                "params",
                "tensors of one dtype on one device (they share one buffer)",
                ", ".join(sorted(f"{d} on {v}" for d, v in kinds)),
                "convert them to one dtype and device",
            )
        )
    dtype, device = kinds.pop() if kinds else (torch.get_default_dtype(), torch.device("cpu"))
    shapes = [t.shape for t in tensors[: len(structure.keys)]]
    return StateLayout(structure, shapes, fields, type(state), dtype, device)

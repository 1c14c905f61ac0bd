"""Flat vectors over the selected parameters of a curvature operator: conversions between
``[P]`` (or ``[P, k]``) and parameter-shaped pieces, and the checks of vectors given to
products."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = ["FlatVectors"]


class FlatVectors:
    """Mixin of :class:`~gradkit.curvature.CurvatureOperator`: vectors flat over ``names`` in
    order, each parameter's piece shaped like it."""

    _call: str
    names: list[str]
    shapes: list[torch.Size]
    _sizes: list[int]
    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def flatten(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> torch.Tensor:
        """Tensors shaped like the parameters (a dict keyed by name, or a list in ``names``
        order) as one flat vector ``[P]``."""
        if isinstance(tensors, Mapping):
            if set(tensors) != set(self.names):
                raise ValueError(
                    message(
                        f"{self._call}.flatten",
                        "tensors",
                        f"exactly the keys {self.names}",
                        repr(sorted(tensors)),
                        "key the vector like op.names",
                    )
                )
            parts = [tensors[n] for n in self.names]
        else:
            parts = list(tensors)
        ok = len(parts) == len(self.shapes) and all(
            isinstance(t, torch.Tensor) and t.shape == s
            for t, s in zip(parts, self.shapes, strict=False)
        )
        if not ok:
            raise ValueError(
                message(
                    f"{self._call}.flatten",
                    "tensors",
                    f"tensors of shapes {[tuple(s) for s in self.shapes]}",
                    describe(parts),
                    "shape each piece like its parameter",
                )
            )
        return torch.cat([t.reshape(-1).to(self.dtype) for t in parts])

    def unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Split ``[P]`` (or ``[P, k]``) into pieces shaped like the parameters (``[*shape,
        k]``)."""
        self._check(vector, ".unflatten(vector)")
        tail = vector.shape[1:]
        return [
            p.reshape((*s, *tail))
            for p, s in zip(vector.split(self._sizes), self.shapes, strict=True)
        ]

    def as_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split ``[P]`` (or ``[P, k]``) by parameter name."""
        return dict(zip(self.names, self.unflatten(vector), strict=True))

    def _check(self, v: Any, where: str = " @ v") -> torch.Tensor:
        n = self.shape[0]
        if not isinstance(v, torch.Tensor) or v.dim() not in (1, 2) or v.shape[0] != n:
            raise ValueError(
                message(
                    f"{self._call}{where}",
                    "v",
                    f"a tensor of shape [{n}] or [{n}, k], or a dict keyed like op.names",
                    describe(v),
                    "flatten parameter-shaped vectors with op.flatten(...)",
                )
            )
        if not v.is_floating_point():
            raise TypeError(
                message(
                    f"{self._call}{where}", "v", "a floating-point tensor", describe(v), "cast it"
                )
            )
        if v.device.type == "meta" and self.device.type != "meta":
            raise ValueError(
                message(
                    f"{self._call}{where}",
                    "v",
                    f"a tensor with values (on {self.device})",
                    "a tensor on the meta device (shapes only, no values)",
                    f"create v on {self.device}",
                )
            )
        return v.to(dtype=self.dtype, device=self.device)


FlatVectors.__module__ = "gradkit.curvature"  # help(CurvatureOperator) names the public package

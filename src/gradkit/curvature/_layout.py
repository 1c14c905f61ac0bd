"""Flat vectors over the selected parameters, one batch's contribution (:class:`Point`), and
the parsing of ``blocks=``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = ["Layout", "Point", "parse_blocks"]


class Layout:
    """The selected parameters and the map between flat vectors ``[P]`` (``[k, P]`` when
    batched) and parameter-shaped pieces. Points hold this, never the operator (no reference
    cycle keeps a graph alive after the operator is dropped)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.names = list(params)
        self.params = list(params.values())
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.n = sum(self.sizes)

    def split(self, v: torch.Tensor, batched: bool = False) -> list[torch.Tensor]:
        lead = (v.shape[0],) if batched else ()
        return [
            p.reshape(*lead, *s)
            for p, s in zip(v.split(self.sizes, dim=-1), self.shapes, strict=True)
        ]

    def cat(self, parts: Sequence[torch.Tensor], batched: bool = False) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0].reshape(parts[0].shape[0], -1) if batched else parts[0].reshape(-1)
        if batched:
            return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)
        return torch.cat([p.reshape(-1) for p in parts])


class Point:
    """One batch's contribution: ``apply(v)`` for ``v`` ``[P]`` and ``apply_batched(V)`` for
    ``V`` ``[c, P]`` (one vectorized backward); ``unused`` lists parameter indices the loss
    does not depend on; ``errors`` names graph nodes that refuse a second backward."""

    unused: list[int]
    errors: list[str]

    def apply(self, v: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def apply_batched(self, V: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


def parse_blocks(blocks: Any, names: Sequence[str], call: str) -> list[list[int]] | None:
    if isinstance(blocks, str):
        if blocks == "full":
            return None
        if blocks in ("layer", "param"):
            groups: dict[str, list[int]] = {}
            for i, n in enumerate(names):
                key = n if blocks == "param" else n.rpartition(".")[0]
                groups.setdefault(key, []).append(i)
            return list(groups.values())
    elif isinstance(blocks, Iterable):
        lists = [[b] if isinstance(b, str) else list(b) for b in blocks]
        flat = [n for group in lists for n in group]
        if sorted(flat) == sorted(names) and len(set(flat)) == len(flat):
            index = {n: i for i, n in enumerate(names)}
            return [[index[n] for n in group] for group in lists if group]
    raise ValueError(
        message(
            call,
            "blocks",
            "'full', 'layer', 'param' or lists of parameter names covering each selected "
            f"parameter once ({list(names)[:6]}...)",
            describe(blocks),
            "pass blocks='layer' for one block per module, or a partition of the names",
        )
    )

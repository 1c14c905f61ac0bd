"""The curvature suite's problem (an MLP, a batch and a vector) and its optional peers, BackPACK
and curvlinops (imported when present; a note says when they are skipped)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._bench._case import Method, quiet
from gradkit._bench._models import mlp, mlp_name

__all__ = [
    "BP_NOTE",
    "CL_NOTE",
    "Problem",
    "curvlinops_methods",
    "load_backpack",
    "load_curvlinops",
]


def load_curvlinops() -> Any:
    """The ``curvlinops`` module, or None when it is not installed (or broken)."""
    try:
        with quiet(stderr=True):
            import curvlinops
    except Exception:  # ImportError, or a broken install against this torch
        return None
    return curvlinops


def load_backpack() -> Any:
    """The ``backpack`` package with the parts the suite uses, or None when not installed."""
    try:
        with quiet(stderr=True):
            import backpack
            import backpack.extensions
            import backpack.hessianfree.ggnvp
            import backpack.hessianfree.hvp
    except Exception:
        return None
    return backpack


CL_NOTE = (
    "curvlinops is not installed (optional; `pip install curvlinops-for-pytorch` would replace "
    "torch here): its methods are skipped."
)
BP_NOTE = "BackPACK is not installed (`pip install --no-deps backpack-for-pytorch`): skipped."


class Problem:
    """An MLP (``sizes``, tanh), a batch of ``batch`` examples for cross entropy and a vector
    ``v`` (also as per-parameter views ``vs``), drawn from the current torch RNG state."""

    def __init__(self, sizes: tuple[int, ...], batch: int, dtype: torch.dtype) -> None:
        self.sizes = sizes
        self.model = mlp(sizes, dtype)
        self.params = list(self.model.parameters())
        self.x = torch.randn(batch, sizes[0], dtype=dtype)
        self.y = torch.randint(0, sizes[-1], (batch,))
        self.batch = (self.x, self.y)
        self.n = sum(p.numel() for p in self.params)
        self.v = torch.randn(self.n, dtype=dtype)
        self.vs = [
            t.view_as(p)
            for t, p in zip(
                self.v.split([p.numel() for p in self.params]), self.params, strict=True
            )
        ]

    def loss(self) -> torch.Tensor:
        return F.cross_entropy(self.model(self.x), self.y)

    def grad(self) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(self.loss(), self.params)

    def setup(self) -> dict[str, Any]:
        return {
            "model": mlp_name(self.sizes),
            "parameters": self.n,
            "batch": self.x.shape[0],
            "loss": "cross entropy (mean)",
            "dtype": str(self.x.dtype).replace("torch.", ""),
        }


def curvlinops_methods(p: Problem, name: str, notes: list[str]) -> list[Method]:
    """curvlinops' operator (built once, without its determinism check) times a vector, and
    its construction with the default check; none (and a note) when it is not installed."""
    cl = load_curvlinops()
    if cl is None:
        notes.append(CL_NOTE)
        return []
    cls = getattr(cl, name)
    loss = nn.CrossEntropyLoss()  # curvlinops needs the loss module (its GGN dispatches on it)

    def build(check: bool) -> Any:
        with quiet(stderr=True):
            return cls(p.model, loss, p.params, [p.batch], check_deterministic=check)

    op = build(False)
    return [
        Method("curvlinops", f"curvlinops {name} @ v", lambda: op @ p.v),
        Method(
            "curvlinops_build",
            f"curvlinops {name}(...) construction (default check_deterministic=True)",
            lambda: build(True),
            None,
        ),
    ]

"""Autograd building blocks shared by the packages (a neutral home: ``func`` and ``curvature``
both use them, neither owns them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["second_grads"]


def second_grads(
    gs: Sequence[torch.Tensor | None],
    xs: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    batched: bool = False,
    create_graph: bool = False,
    retain_graph: bool = True,
) -> list[torch.Tensor]:
    """``d/dx sum_k <g_k, v_k>`` by one backward through the first-gradient graph ``gs``
    (kept for further products unless ``retain_graph=False``).

    With ``batched=True`` each ``v_k`` carries a leading dimension of vectors (vectorized
    backward). Gradients that do not depend on ``xs`` (a linear function) contribute zeros.
    """
    live = [k for k, g in enumerate(gs) if g is not None and g.requires_grad]
    lead = (vs[0].shape[0],) if batched else ()
    if not live:
        return [x.new_zeros((*lead, *x.shape)) for x in xs]
    outputs: list[torch.Tensor] = [g for g in gs if g is not None and g.requires_grad]
    res = torch.autograd.grad(
        outputs,
        list(xs),
        grad_outputs=[vs[k] for k in live],
        retain_graph=retain_graph or create_graph,
        create_graph=create_graph,
        allow_unused=True,
        is_grads_batched=batched,
    )
    return [
        x.new_zeros((*lead, *x.shape)) if r is None else r for r, x in zip(res, xs, strict=True)
    ]

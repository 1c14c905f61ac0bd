"""Autograd building blocks shared by the packages (a neutral home: ``func`` and ``curvature``
both use them, neither owns them)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["edges_into", "graph_nodes", "second_grads"]


def graph_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every node of the autograd graphs of ``roots`` (nodes, None skipped), each once."""
    seen: set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


def edges_into(
    roots: Iterable[Any], ids: Container[int], leaves: dict[int, Any] | None = None
) -> dict[int, list[Any]]:
    """``id(leaf) -> [node]``: for each leaf tensor of ``ids`` (parameters) that the graphs of
    ``roots`` reach, the nodes with an edge into its gradient accumulator, one entry per edge.
    A layer's call takes each of its parameters through one such edge, so the counts tell the
    uses of a parameter apart from its layer's calls. ``leaves``, if given, receives
    ``id(leaf) ->`` its accumulator node."""
    found: dict[int, list[Any]] = {}
    seen: set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:  # graph_nodes, inlined: this walk runs at every tracked backward pass
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is None:
                stack.append(nxt)
            elif id(variable) in ids:
                found.setdefault(id(variable), []).append(node)
                if leaves is not None:
                    leaves[id(variable)] = nxt
    return found


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

"""The per-example sum of several per-example gradients of one parameter (a parameter shared by
several modules: a tied embedding and output layer, a layer called twice).

Index legend: ``n`` example, ``t`` position of the output layer's input, ``s`` looked-up token,
``v`` row (vocabulary entry), ``d`` feature.

Sums are formed block by block, in place: dense parts are added into the first one's block and
parts given as sparse rows (embeddings) are scattered into it, with no dense zero block per
part. Squared norms of a tied embedding ``E`` (rows looked up by ``idx[n, s]`` with output
gradients ``H[n, s, d]``) and output Linear ``W[v, d]`` (inputs ``a[n, t, d]``, output gradients
``G[n, t, v]``) need no ``[N, V, d]`` tensor:

.. math:: \\lVert g_n(E) + g_n(W) \\rVert^2 = \\lVert g_n(E) \\rVert^2 + \\lVert g_n(W) \\rVert^2
          + 2 \\sum_{t, s} G[n, t, idx[n, s]] \\, \\langle a[n, t], H[n, s] \\rangle,

each term by its own closed form (sparse rows; Gram form), the cross term in
``O(T S d)`` per example.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gradkit.per_example._grads import Materialized, OuterProduct, PerExampleGrad

__all__ = ["combine"]


class SumGrad(PerExampleGrad):
    """``g_n = sum_k g_n^{(k)}`` over the parts (see the module docstring)."""

    def __init__(self, parts: list[PerExampleGrad]) -> None:
        self.parts = parts
        self.num_examples = parts[0].num_examples
        self.shape = parts[0].shape
        self.sparse = [p for p in parts if hasattr(p, "scatter_into")]
        self.dense = [p for p in parts if not hasattr(p, "scatter_into")]

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        if not self.dense:  # sparse parts only: the first materializes, the rest scatter
            first, rest = self.sparse[0], self.sparse[1:]
            dense_iter: Iterator[tuple[torch.Tensor, ...]] = zip(first.chunks(size))
            owned = True
        else:
            rest = self.sparse
            dense_iter = zip(*(p.chunks(size) for p in self.dense), strict=True)
            owned = self.dense[0].owned
        start = 0
        for blocks in dense_iter:
            total = blocks[0] if owned else blocks[0].clone()
            for block in blocks[1:]:
                total.add_(block.to(total.dtype))
            stop = start + total.shape[0]
            for part in rest:
                part.scatter_into(total, start, stop)
            start = stop
            yield total

    def sq_norms(self) -> torch.Tensor | None:
        emb = [p for p in self.sparse if getattr(p, "tokens", None) is not None]
        lin = [p for p in self.dense if isinstance(p, OuterProduct) and p.groups == 1]
        if len(self.parts) != 2 or len(emb) != 1 or len(lin) != 1:
            return None
        e, w = emb[0], lin[0]
        if tuple(w.shape) != (w.o, w.i):  # not laid out [rows, features]
            return None
        norms_w = w.sq_norms()
        if norms_w is None:
            return None
        idx, h = e.tokens  # type: ignore[attr-defined]  # [N, S], [N, S, d]
        a, g = w.A[:, :, 0], w.G[:, :, 0]  # [N, T, d], [N, T, V]
        n, t = g.shape[:2]
        g_at = torch.gather(g, 2, idx[:, None, :].expand(n, t, idx.shape[1]))  # [N, T, S]
        cross = (g_at * (a @ h.transpose(1, 2))).sum((1, 2))
        norms_e = e.sq_norms()
        if norms_e is None:
            return None
        return norms_e + norms_w + 2 * cross


def combine(parts: list[PerExampleGrad]) -> PerExampleGrad:
    """The per-example sum of ``parts`` in the cheapest form: uses of one layout concatenate
    along positions (an outer product stays an outer product), materialized tensors add."""
    if all(isinstance(p, OuterProduct) for p in parts):
        ops = [p for p in parts if isinstance(p, OuterProduct)]
        first = ops[0]
        if all(o.groups == first.groups and o.i == first.i and o.o == first.o for o in ops):
            return OuterProduct(
                torch.cat([o.A for o in ops], 1), torch.cat([o.G for o in ops], 1), first.shape
            )
    mats = [p for p in parts if isinstance(p, Materialized)]
    if len(mats) == len(parts):
        return Materialized(torch.stack([m.grads for m in mats]).sum(0), owned=True)
    return SumGrad(parts)

"""Per-example gradients of one parameter, in the cheapest form a rule can give.

Index legend: ``n`` example, ``t``/``s`` position (sequence element, spatial output position, or
use of a shared layer), ``g`` group, ``o`` output feature, ``i`` input feature.

* :class:`Materialized`: ``[N, *shape]``, already summed over positions.
* :class:`OuterProduct`: ``g_n = sum_t G[n, t] (x) A[n, t]`` per group, i.e. the gradient of a
  weight used as ``z[n, t, g] = W[g] a[n, t, g]`` (Linear on any number of leading dims,
  convolution with ``A`` the unfolded patches). Closed forms:

  - one position (``T == 1``): ``sum_n g_n^p = (G^p)^T (A^p)`` for every integer p, and
    ``||g_n||^2 = ||a_n||^2 ||G_n||^2``, with no ``[N, *shape]`` tensor;
  - several positions: ``||g_n||^2 = <A_n A_n^T, G_n G_n^T>`` (Gram form, ``O(T^2 (i + o))``
    per example) when cheaper than materializing (``O(T i o)``). Moments need
    ``(sum_t .)^p``, never ``sum_t (.)^p`` (TensorFlow's Conv2D moment drops these cross terms),
    so they are materialized in chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = ["BiasOf", "Materialized", "OuterProduct", "PerExampleGrad", "cat_positions", "powered"]

LATE_POWERS = 2
"""The highest power ``p`` whose ``scale ** p`` may multiply a sum of unscaled ``g ** p``
instead of scaling ``g`` first. Squares keep float32's range for any scale a loss or a gradient
scaler applies (a GradScaler's 65536 squared is 4e9); higher powers do not (65536 to the 8th
is 3e38, float32's largest number, and ``(g / N) ** 4`` at N = 2048 falls among the
subnormals): there the scale goes on ``g`` before the power."""


def powered(t: torch.Tensor, p: int, scale: float) -> tuple[torch.Tensor, float]:
    """``(t', alpha)`` with ``alpha * t' == (scale * t) ** p``: the scale kept as a factor for
    the caller's (smaller) sum up to :data:`LATE_POWERS`, applied to ``t`` first above."""
    if p == 1:
        return t, scale
    if p <= LATE_POWERS or scale == 1.0:
        return t.pow(p), scale**p
    return (t * scale).pow_(p), 1.0


def cat_positions(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate the uses of a layer along the position dimension (1); no copy for one."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class PerExampleGrad:
    """Per-example gradients ``g_n`` of one parameter, ``n = 0..N-1`` (unscaled).

    Subclasses give :meth:`chunks` and may give closed forms in :meth:`power_sum` and
    :meth:`sq_norms` (returning None means "materialize instead").
    """

    num_examples: int
    shape: torch.Size
    owned: bool = True
    """Whether the blocks :meth:`chunks` yields are fresh tensors (scaled in place)."""
    on_block: Callable[[torch.Tensor, float], None] | None = None
    """Called with every block the statistics take, before they use it, and the factor that
    undoes the scale folded into it (1.0: none)."""
    sums_into: bool = False
    """Whether :meth:`power_sum` takes ``out=``: storage shaped like the parameter, in the
    statistics' dtype, which it may write its result into (reused, not freshly allocated).
    A subclass that overrides :meth:`power_sum` without saying so does not."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "power_sum" in cls.__dict__ and "sums_into" not in cls.__dict__:
            cls.sums_into = False

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        """Yield ``[n_c, *shape]`` blocks of per-example gradients, ``n_c <= size``."""
        raise NotImplementedError

    def scaled_chunks(
        self, size: int, scale: float, out: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """Blocks as :meth:`chunks`, each with whether ``scale`` is already applied (a form
        may fold it into a smaller factor than the block, saving a pass over the block).
        ``out`` (``[N, *shape]``, only given where :meth:`writes_into` says so and ``size >=
        N``): the storage to compute the one block into."""
        for block in self.chunks(size):
            yield block, False

    def writes_into(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`scaled_chunks` can compute all examples, in ``dtype``, into a given
        tensor (reused storage: no fresh allocation per step)."""
        return False

    def power_sum(
        self, p: int, scale: float = 1.0, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``sum_n (scale * g_n) ** p`` (shaped like the parameter) by a closed form, or None.
        The result is a tensor the caller may keep: fresh, or ``out`` (given only where
        :attr:`sums_into` says so) holding it."""
        return None

    def sq_norms(self) -> torch.Tensor | None:
        """``[N]`` squared norms ``||g_n||^2`` by a closed form, or None."""
        return None


class Materialized(PerExampleGrad):
    """Per-example gradients given as one tensor ``[N, *shape]``.

    Args:
        grads: the per-example gradients; never modified (a rule may pass a view of an output
            gradient autograd still propagates).
        owned: ``grads`` is a fresh tensor nothing else holds, which the statistics may scale
            and square in place instead of copying.
    """

    def __init__(self, grads: torch.Tensor, *, owned: bool = False) -> None:
        if not isinstance(grads, torch.Tensor) or grads.dim() == 0:
            raise ValueError(
                message(
                    "per_example.Materialized(grads)",
                    "grads",
                    "a tensor [N, *param.shape] (the examples in dimension 0)",
                    describe(grads),
                    "stack the per-example gradients along a new dimension 0 (a 0-dim "
                    "parameter's are [N])",
                )
            )
        self.grads = grads
        self.owned = owned
        self.num_examples = grads.shape[0]
        self.shape = grads.shape[1:]

    sums_into = True

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        if size >= self.num_examples:  # one block: no split views
            yield self.grads
        else:
            yield from self.grads.split(size)

    def power_sum(
        self, p: int, scale: float = 1.0, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if out is not None and out.dtype != self.grads.dtype:
            out = None
        values, alpha = powered(self.grads, p, scale)
        total = torch.sum(values, 0, out=out)
        return total.mul_(alpha) if alpha != 1.0 else total

    def sq_norms(self) -> torch.Tensor | None:
        # reshape, not flatten(1): a 0-dim parameter's gradients are [N]
        return self.grads.reshape(self.num_examples, -1).square().sum(1)


class OuterProduct(PerExampleGrad):
    """``g_n = sum_t G[n, t, g]^T A[n, t, g]`` per group ``g``, reshaped to ``shape``.

    Args:
        A: ``[N, T, groups, i]`` inputs (activations or unfolded patches).
        G: ``[N, T, groups, o]`` gradients w.r.t. the outputs.
        shape: the parameter's shape; ``groups * o * i`` elements laid out as ``[g, o, i]``.
    """

    def __init__(self, A: torch.Tensor, G: torch.Tensor, shape: torch.Size) -> None:
        self.A, self.G = A, G
        self._a2: torch.Tensor | None = None
        self._g2: torch.Tensor | None = None
        self.num_examples, self.T, self.groups, self.i = A.shape
        self.o = G.shape[-1]
        self.shape = shape

    def _block(
        self,
        start: int,
        stop: int,
        scale: float = 1.0,
        on_a: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        whole = start == 0 and stop == self.num_examples  # no slicing (an op per factor)
        a, g = (self.A, self.G) if whole else (self.A[start:stop], self.G[start:stop])
        if scale != 1.0:
            a, g = (a * scale, g) if on_a else (a, g * scale)
        n = stop - start
        into = None if out is None else out.view(n, self.o, self.i)
        if self.T == 1 and self.groups == 1:  # outer products: a broadcast multiply
            block = torch.mul(g.reshape(n, self.o, 1), a.reshape(n, 1, self.i), out=into)
        elif self.groups == 1:
            block = torch.bmm(g[:, :, 0].transpose(1, 2), a[:, :, 0], out=into)  # [n, o, i]
        else:
            block = torch.einsum("ntgo,ntgi->ngoi", g, a)
        return out if out is not None else block.reshape(n, *self.shape)

    def writes_into(self, dtype: torch.dtype) -> bool:
        return self.groups == 1 and self.A.dtype == dtype and self.G.dtype == dtype

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        for start in range(0, self.num_examples, size):
            yield self._block(start, min(start + size, self.num_examples))

    def scaled_chunks(
        self, size: int, scale: float, out: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """The blocks of ``scale * g_n``, the scale applied to the smallest of ``A``, ``G``
        and the block (``T i``, ``T o`` or ``i o`` elements per example and group)."""
        cost = {"a": self.T * self.i, "g": self.T * self.o, "block": self.i * self.o}
        where = min(cost, key=cost.__getitem__) if scale != 1.0 else "block"
        for start in range(0, self.num_examples, size):
            stop = min(start + size, self.num_examples)
            if where == "block":
                yield self._block(start, stop, out=out), False
            else:
                yield self._block(start, stop, scale, where == "a", out=out), True

    sums_into = True

    def power_sum(
        self, p: int, scale: float = 1.0, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if self.T != 1:
            return None
        if p == 2:
            a, g = self._squares()  # [N, groups, i], [N, groups, o]
            alpha = scale**2
        else:  # the scale on G (see powered)
            a = self.A[:, 0] if p == 1 else self.A[:, 0].pow(p)
            g, alpha = powered(self.G[:, 0], p, scale)
        if self.groups == 1:  # the scale rides in the product (addmm's alpha)
            g2d, a2d = g[:, 0], a[:, 0]
            into = None
            if out is not None and out.dtype == a2d.dtype and out.is_contiguous():
                into = out if out.shape == (self.o, self.i) else out.view(self.o, self.i)
            if alpha == 1.0:
                product = torch.mm(g2d.T, a2d, out=into)
            else:  # beta=0: the input is never read (nor its NaNs)
                empty = into if into is not None else g2d.new_empty(())
                product = torch.addmm(empty, g2d.T, a2d, beta=0, alpha=alpha, out=into)
            return out if into is not None else product.view(self.shape)
        if alpha != 1.0:  # on the smaller factor, before the product
            g = g * alpha
        return torch.einsum("ngo,ngi->goi", g, a).reshape(self.shape)

    def _squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A**2, G**2)`` at the single position, computed once (the second moment and the
        squared norms both need them)."""
        return self.A_squared(), self.G_squared()

    def A_squared(self) -> torch.Tensor:
        """``A[:, 0] ** 2`` (one position), computed once."""
        if self._a2 is None:
            self._a2 = self.A[:, 0].square()
        return self._a2

    def G_squared(self) -> torch.Tensor:
        """``G[:, 0] ** 2`` (one position), computed once (an affine layer's bias shares it)."""
        if self._g2 is None:
            self._g2 = self.G[:, 0].square()
        return self._g2

    def gram_is_cheaper(self) -> bool:
        """Cost model: Gram norms ``T^2 (i + o)`` vs materializing ``T i o`` per group."""
        return self.T * (self.i + self.o) < self.i * self.o

    def sq_norms(self) -> torch.Tensor | None:
        if self.T == 1:
            a2, g2 = self._squares()
            return (a2.sum(-1) * g2.sum(-1)).sum(-1)
        if not self.gram_is_cheaper():
            return None
        a = self.A.transpose(1, 2)  # [N, g, T, i]
        g = self.G.transpose(1, 2)
        aa = a @ a.transpose(-1, -2)  # [N, g, T, T]
        gg = g @ g.transpose(-1, -2)
        return (aa * gg).sum((1, 2, 3))


class BiasOf(Materialized):
    """``g_n = sum_t G[n, t]``: the per-example gradients of the bias of an affine layer whose
    weight has the :class:`OuterProduct` ``weight`` (a bias per group and output feature).
    At one position its closed forms reuse the squares the weight's already computed."""

    def __init__(self, weight: OuterProduct) -> None:
        g = weight.G
        if weight.T == 1:  # a view: nothing to sum
            super().__init__(g.reshape(g.shape[0], -1), owned=False)
        else:
            super().__init__(g.sum(1).reshape(g.shape[0], -1), owned=True)
        self.weight = weight

    sums_into = True

    def power_sum(
        self, p: int, scale: float = 1.0, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if p != 2 or self.weight.T != 1:
            return super().power_sum(p, scale, out)
        total = self.weight.G_squared().sum(0).view(self.shape)
        return total.mul_(scale**2) if scale != 1.0 else total

    def sq_norms(self) -> torch.Tensor | None:
        if self.weight.T != 1:
            return super().sq_norms()
        return self.weight.G_squared().flatten(1).sum(1)

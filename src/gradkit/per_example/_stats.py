"""Accumulation of per-example gradient statistics over backward passes, and the per-parameter
result object.

For per-example gradients ``g_i`` (``i = 1..N`` over every example seen in the ``track``):
``mean = (1/N) sum g_i``, ``second_moment = (1/N) sum g_i**2``, ``moment(p) = (1/N) sum g_i**p``,
``variance = second_moment - mean**2`` (population; clamped at 0 against rounding; ``N/(N-1)``
times that with ``unbiased=True``), ``batch_l2[i] = ||g_i||**2``, ``batch_grad[i] = g_i``.
Every quantity is a sum over examples, so passes (micro-batches, ranks) merge exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradkit._errors import GradkitError
from gradkit.per_example._grads import PerExampleGrad

__all__ = ["ParamStats", "Want"]

_QUANTITIES = ("mean", "second_moment", "variance", "batch_l2", "batch_grad")


@dataclass(frozen=True)
class Want:
    """What the caller asked for; only that is computed."""

    quantities: frozenset[str]
    moments: tuple[int, ...] = ()

    @property
    def mean(self) -> bool:
        return bool({"mean", "variance"} & self.quantities) or 1 in self.moments

    @property
    def powers(self) -> tuple[int, ...]:
        """Powers ``p >= 2`` whose sums are needed."""
        ps = {p for p in self.moments if p != 1}
        if {"second_moment", "variance"} & self.quantities:
            ps.add(2)
        return tuple(sorted(ps))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in float64 for float64 parameters, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Acc:
    shape: torch.Size
    dtype: torch.dtype
    n: int = 0
    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    l2: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)

    def add_sum(
        self, p: int, value: torch.Tensor, alpha: float = 1.0, *, owned: bool = False
    ) -> None:
        """Add ``alpha * value`` to the sum of ``g**p``. ``value`` is never modified; with
        ``owned=True`` (a fresh tensor nothing else holds) a first value is kept as is."""
        value = value.to(self.dtype)
        if p in self.sums:
            self.sums[p].add_(value, alpha=alpha)
        elif owned and alpha == 1.0:
            self.sums[p] = value
        else:
            self.sums[p] = torch.mul(value, alpha)


def accumulate(
    acc: _Acc, pe: PerExampleGrad, scale: float, want: Want, *, mean_given: bool, chunk_size: int
) -> None:
    """Add one pass's per-example gradients ``scale * g_n`` to ``acc``.

    Closed forms first; whatever remains is materialized ``chunk_size`` examples at a time.
    ``mean_given`` says the sum of gradients comes from elsewhere (the parameter's own
    gradient in this backward), so p = 1 is not computed here.
    """
    powers = list(want.powers)
    if want.mean and not mean_given:
        powers.insert(0, 1)
    remaining = []
    for p in powers:
        s = pe.power_sum(p, scale)
        if s is None:
            remaining.append(p)
        else:
            acc.add_sum(p, s, owned=True)
    l2_direct = None
    if "batch_l2" in want.quantities:
        l2_direct = pe.sq_norms()
        if l2_direct is not None:
            acc.l2.append(l2_direct.to(acc.dtype) * scale**2)
    need_l2 = "batch_l2" in want.quantities and l2_direct is None
    keep = "batch_grad" in want.quantities
    if keep:  # all blocks are kept anyway: one block, no concatenation later
        chunk_size = max(chunk_size, pe.num_examples)
    if remaining or need_l2 or keep:
        for block in pe.chunks(chunk_size):
            if pe.on_block is not None:
                pe.on_block(block)
            g = block.to(acc.dtype)  # fresh blocks are scaled and squared in place
            if g is block and not pe.owned:
                g = g.clone()
            if scale != 1.0:
                g.mul_(scale)
            if keep:
                acc.grads.append(g)
            if need_l2:
                acc.l2.append(torch.linalg.vector_norm(g.flatten(1), dim=1).square())
            for p in remaining:
                if p == 1:
                    acc.add_sum(1, g.sum(0), owned=True)
                elif p == 2 and not keep and p == remaining[-1]:
                    acc.add_sum(2, g.square_().sum(0), owned=True)  # last use of the block
                else:
                    acc.add_sum(p, g.pow(p).sum(0), owned=True)
    acc.n += pe.num_examples


class ParamStats:
    """Statistics of the individual gradients of one parameter (see the module docstring).

    Attributes:
        name: the parameter's name, as in ``model.named_parameters()``.
        num_examples: ``N``, the number of examples seen.
    """

    def __init__(self, name: str, acc: _Acc, want: Want, unbiased: bool) -> None:
        self.name = name
        self._acc = acc
        self._want = want
        self._unbiased = unbiased

    def __repr__(self) -> str:
        return (
            f"ParamStats({self.name!r}, shape={tuple(self._acc.shape)}, "
            f"num_examples={self.num_examples})"
        )

    @property
    def num_examples(self) -> int:
        return self._acc.n

    def _sum(self, p: int, what: str, ask: str) -> torch.Tensor:
        if p not in self._acc.sums:
            if self._acc.n == 0:
                raise GradkitError(
                    f"stats[{self.name!r}].{what}: no example was seen; run a "
                    "backward pass inside the track block"
                )
            raise GradkitError(
                f"stats[{self.name!r}].{what}: not tracked; pass {ask} to "
                "gradkit.per_example.track(...)"
            )
        return self._acc.sums[p]

    @property
    def mean(self) -> torch.Tensor:
        """``(1/N) sum_i g_i``, shaped like the parameter."""
        return self._sum(1, "mean", "'mean'") / self._acc.n

    @property
    def second_moment(self) -> torch.Tensor:
        """``(1/N) sum_i g_i**2``."""
        return self._sum(2, "second_moment", "'second_moment'") / self._acc.n

    def moment(self, p: int) -> torch.Tensor:
        """``(1/N) sum_i g_i**p`` for a tracked ``p`` (``moments=(p, ...)``; 1 and 2 come with
        'mean' and 'second_moment')."""
        return self._sum(p, f"moment({p})", f"moments=({p},)") / self._acc.n

    def var(self, *, unbiased: bool | None = None) -> torch.Tensor:
        """``second_moment - mean**2`` (clamped at 0), times ``N/(N-1)`` if ``unbiased``."""
        n = self._acc.n
        s1 = self._sum(1, "variance", "'variance'")
        s2 = self._sum(2, "variance", "'variance'")
        v = torch.addcmul(s2, s1, s1, value=-1.0 / n).div_(n).clamp_min_(0)
        if self._unbiased if unbiased is None else unbiased:
            if n < 2:
                raise GradkitError(
                    f"stats[{self.name!r}].var(unbiased=True): needs at least 2 examples, got {n}"
                )
            v = v * (n / (n - 1))
        return v

    @property
    def variance(self) -> torch.Tensor:
        """The variance of the individual gradients (``unbiased`` as set in ``track``)."""
        return self.var()

    @property
    def batch_l2(self) -> torch.Tensor:
        """``[N]``: ``||g_i||**2`` over this parameter, in the order examples were seen."""
        if "batch_l2" not in self._want.quantities:
            raise GradkitError(
                f"stats[{self.name!r}].batch_l2: not tracked; pass 'batch_l2' "
                "to gradkit.per_example.track(...)"
            )
        if not self._acc.l2:
            return torch.zeros(0, dtype=self._acc.dtype)
        if len(self._acc.l2) > 1:  # merge once, keep the merged tensor
            self._acc.l2 = [torch.cat(self._acc.l2)]
        return self._acc.l2[0]

    @property
    def batch_grad(self) -> torch.Tensor:
        """``[N, *shape]``: the individual gradients ``g_i``."""
        if "batch_grad" not in self._want.quantities:
            raise GradkitError(
                f"stats[{self.name!r}].batch_grad: not tracked; pass "
                "'batch_grad' to gradkit.per_example.track(...)"
            )
        if not self._acc.grads:
            return torch.zeros((0, *self._acc.shape), dtype=self._acc.dtype)
        if len(self._acc.grads) > 1:  # merge once, keep the merged tensor
            self._acc.grads = [torch.cat(self._acc.grads)]
        return self._acc.grads[0]

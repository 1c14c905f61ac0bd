"""Accumulation of per-example gradient statistics over backward passes, and the per-parameter
result object.

For per-example gradients ``g_i`` (``i = 1..N`` over every example seen in the ``track``):
``mean = (1/N) sum g_i``, ``second_moment = (1/N) sum g_i**2``, ``moment(p) = (1/N) sum g_i**p``,
``variance = second_moment - mean**2`` (population; clamped at 0 against rounding; ``N/(N-1)``
times that with ``unbiased=True``), ``batch_l2[i] = ||g_i||**2``, ``batch_grad[i] = g_i``.
Every quantity is a sum over examples, so passes (micro-batches, ranks) merge exactly. A pass of
no example adds nothing; a parameter a pass's loss did not reach gets ``g_i = 0`` for each of
its examples (:meth:`PowerSums.add_zeros`), as the one-example-at-a-time loop gives it. Reading a
statistic of no example raises.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from gradkit._errors import GradkitError, describe, message
from gradkit.per_example._buffers import batch_grad_buffer, pool_of, result_buffer
from gradkit.per_example._grads import LATE_POWERS, PerExampleGrad

__all__ = [
    "QUANTITIES",
    "ParamStats",
    "PowerSums",
    "Want",
    "add_block",
    "as_dtype",
    "check_order",
    "merged_l2",
    "parse_want",
    "statistics_dtype",
]

QUANTITIES = ("mean", "second_moment", "variance", "batch_l2", "batch_grad")


def _compiled_hint() -> str:
    """Where torch.compile has compiled code in this process: why a compiled model may have run
    without the hooks ``track`` installs, and what to do."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not dynamo.utils.counters["frames"]["ok"]:
        return ""
    return (
        ". If the model runs through torch.compile: code compiled before the block does not "
        "call the hooks track() installs, as torch._dynamo.config.skip_nnmodule_hook_guards "
        "is True by default; set it to False before the first compiled call (tracked and "
        "untracked calls then compile once each), or call torch._dynamo.reset() before "
        "the block"
    )


@dataclass(frozen=True)
class Want:
    """What the caller asked for; only that is computed."""

    quantities: frozenset[str]
    moments: tuple[int, ...] = ()

    @cached_property
    def mean(self) -> bool:
        return bool({"mean", "variance"} & self.quantities) or 1 in self.moments

    @cached_property
    def powers(self) -> tuple[int, ...]:
        """Powers ``p >= 2`` whose sums are needed."""
        ps = {p for p in self.moments if p != 1}
        if {"second_moment", "variance"} & self.quantities:
            ps.add(2)
        return tuple(sorted(ps))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_want(quantities: Sequence[Any], moments: Any, call: str) -> Want:
    """Check ``track``'s ``*quantities`` and ``moments`` and say what to compute (the same
    :class:`Want` for the same arguments: a training loop asks at every step)."""
    if type(quantities) is not tuple or type(moments) is not tuple:
        return _parse_want(quantities, moments, call)
    # the types too: 1 == True == 1.0, and only the int is a valid power
    key = (quantities, moments, tuple(map(type, quantities)), tuple(map(type, moments)))
    try:
        want = _WANTS.get(key)
    except TypeError:  # an unhashable argument: refused by the check
        return _parse_want(quantities, moments, call)
    if want is None:
        want = _WANTS[key] = _parse_want(quantities, moments, call)
        if len(_WANTS) > 64:
            _WANTS.pop(next(iter(_WANTS)))
    return want


_WANTS: dict[tuple[Any, ...], Want] = {}


def _parse_want(quantities: Sequence[Any], moments: Any, call: str) -> Want:
    options = ", ".join(repr(q) for q in QUANTITIES)
    for q in quantities:
        if isinstance(q, str) and q in QUANTITIES:
            continue
        if isinstance(q, (list, tuple, set)) and all(isinstance(v, str) for v in q):
            fix = "pass them as separate arguments: track(model, " + ", ".join(map(repr, q)) + ")"
        elif isinstance(q, (list, tuple)) and all(_is_int(v) for v in q):
            fix = f"moments are keyword-only: track(model, ..., moments={tuple(q)!r})"
        else:
            fix = f"pass one of {options}"
        raise ValueError(message(call, "quantities", f"one of {options}", describe(q), fix))
    if isinstance(moments, (str, bytes)) or not isinstance(moments, Iterable):
        fix = (
            f"pass a tuple, e.g. moments=({moments!r},)"
            if _is_int(moments)
            else ("pass e.g. moments=(3, 4)")
        )
        raise TypeError(
            message(call, "moments", "a sequence of positive integers", describe(moments), fix)
        )
    moments = tuple(moments)
    for p in moments:
        if not _is_int(p) or p < 1:
            raise ValueError(
                message(
                    call,
                    "moments",
                    "positive integers (powers p of (1/N) sum_i g_i**p)",
                    repr(moments),
                    "pass e.g. moments=(3, 4)",
                )
            )
    if not quantities and not moments:
        raise ValueError(
            message(
                call,
                "quantities",
                f"at least one of {options} or moments=(p, ...)",
                "nothing",
                "name what to compute, e.g. track(model, 'variance')",
            )
        )
    return Want(frozenset(quantities), tuple(sorted(set(moments))))


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call when ``t`` already has it (a no-op ``to`` costs as
    much as a small kernel: a few microseconds per parameter and step)."""
    return t if t.dtype == dtype else t.to(dtype)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in float64 for float64 parameters, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class PowerSums:
    """One parameter's running statistics: the number of examples ``n``, the sums of
    ``g_i**p`` per power ``p`` (``p = 1``: the mean's sum), and the per-example squared norms
    and gradients when asked. Statistics are read from it by :class:`ParamStats`."""

    shape: torch.Size
    dtype: torch.dtype
    n: int = 0
    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    l2: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    owner: torch.Tensor | None = None  # the parameter, whose batch_grad storage is reused
    # (module, whether its input rows were the examples in another order): see _batch.row_order
    reordered: list[tuple[str, Any]] = field(default_factory=list)
    _pool: dict[str, list[torch.Tensor]] | None = field(default=None, repr=False)
    _pool_found: bool = field(default=False, repr=False)

    @property
    def device(self) -> torch.device:
        """The parameter's device, where its statistics live (the CPU without one)."""
        return self.owner.device if self.owner is not None else torch.device("cpu")

    def zeros(self, *shape: int) -> torch.Tensor:
        """Zeros of ``shape``, in the statistics' dtype, on the parameter's device."""
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def pooled(self, kind: str) -> torch.Tensor | None:
        """Storage shaped like the parameter for ``kind`` (a sum, a statistic read), reused
        from an earlier block's when nothing holds it (see :mod:`._buffers`), or None: a fresh
        tensor (nothing is pooled off the CPU or for a small parameter, nor where the parameter
        was given another shape since)."""
        if self.owner is None or self.owner.shape != self.shape:
            return None
        return result_buffer(self.owner, self.dtype, kind, self.pool)

    def pool(self) -> dict[str, list[torch.Tensor]] | None:
        """The parameter's buffers (:func:`._buffers.pool_of`), looked up once."""
        if not self._pool_found and self.owner is not None:
            self._pool, self._pool_found = pool_of(self.owner), True
        return self._pool

    def storage(self, p: int) -> torch.Tensor | None:
        """Storage for the first sum of ``g**p`` (:meth:`pooled`), or None: the sum exists
        and later values add into it."""
        return None if p in self.sums else self.pooled(f"sum{p}")

    def add_sum(
        self, p: int, value: torch.Tensor, alpha: float = 1.0, *, owned: bool = False
    ) -> None:
        """Add ``alpha * value`` to the sum of ``g**p``. ``value`` is not modified, unless
        ``owned=True`` (a fresh tensor nothing else holds): a first value is then kept, scaled
        in place."""
        value = as_dtype(value, self.dtype)
        if p in self.sums:
            self.sums[p].add_(value, alpha=alpha)
        elif owned:
            self.sums[p] = value if alpha == 1.0 else value.mul_(alpha)
        else:  # the copy in reused storage: a fresh one faults its pages in (0.3 ms for 1.6 MB)
            out = self.storage(p) if value.shape == self.shape else None
            self.sums[p] = torch.mul(value, alpha, out=out)

    def add_zeros(self, n: int, want: Want) -> None:
        """Count ``n`` examples whose gradient is zero (the loss did not reach the parameter in
        this backward pass): their sums are unchanged, their norms and gradients are 0."""
        if n <= 0:
            return
        for p in ([1] if want.mean else []) + list(want.powers):
            if p not in self.sums:
                self.sums[p] = self.zeros(*self.shape)
        if "batch_l2" in want.quantities:
            self.l2.append(self.zeros(n))
        if "batch_grad" in want.quantities:
            self.grads.append(self.zeros(n, *self.shape))
        self.n += n


def add_block(
    acc: PowerSums,
    pe: PerExampleGrad,
    scale: float,
    want: Want,
    *,
    mean_given: bool,
    chunk_size: int,
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
        out = acc.storage(p) if pe.sums_into else None
        s = pe.power_sum(p, scale, out=out) if out is not None else pe.power_sum(p, scale)
        if s is None:
            remaining.append(p)
        else:
            acc.add_sum(p, s, owned=True)
    l2_direct = None
    if "batch_l2" in want.quantities:
        l2_direct = pe.sq_norms()
        if l2_direct is not None:
            acc.l2.append(as_dtype(l2_direct, acc.dtype) * scale**2)
    need_l2 = "batch_l2" in want.quantities and l2_direct is None
    keep = "batch_grad" in want.quantities
    out = None
    if keep:  # all blocks are kept anyway: one block, no concatenation later
        chunk_size = max(chunk_size, pe.num_examples)
        if acc.owner is not None and pe.writes_into(acc.dtype):
            shape = (pe.num_examples, *pe.shape)
            out = batch_grad_buffer(acc.owner, shape, acc.dtype, acc.pool)
    if remaining or need_l2 or keep:
        # the scale may be folded into a factor of the block (the layer's backward, which sums
        # the blocks (on_block), then takes that factor out of the sum: a pass over the
        # weight, not over a kept block; blocks not kept stay unscaled, see `late` below);
        # `out` only where writes_into said so (a user's subclass may not take it)
        fold = pe.on_block is None or keep
        if out is not None:
            blocks = pe.scaled_chunks(chunk_size, scale if fold else 1.0, out=out)
        elif fold:
            blocks = pe.scaled_chunks(chunk_size, scale)
        else:
            blocks = ((b, False) for b in pe.chunks(chunk_size))
        for block, scaled in blocks:
            if pe.on_block is not None:
                pe.on_block(block, 1.0 / scale if scaled else 1.0)
            g = as_dtype(block, acc.dtype)
            fresh = g is not block or pe.owned  # may be scaled and squared in place
            # a block not kept stays unscaled: scale**p goes on its sums (N times smaller),
            # up to the powers where that keeps float's range (see _grads.powered)
            late = 1.0
            if scale != 1.0 and not scaled:
                if not keep and all(p <= LATE_POWERS for p in remaining):
                    late = scale
                else:
                    g = g.mul_(scale) if fresh else g * scale
                    fresh = True
            if keep and not fresh:  # kept: the statistics' own copy
                g = g.clone()
            if keep:
                acc.grads.append(g)
            squares = None
            for p in remaining:
                if p == 1:
                    total = torch.sum(g, 0, out=acc.storage(1))
                elif p == 2 and not keep and p == remaining[-1]:
                    # the last use of the block, but for the norms
                    squares = g.square_() if fresh else g.square()
                    total = torch.sum(squares, 0, out=acc.storage(2))
                else:
                    total = torch.sum(g.pow(p), 0, out=acc.storage(p))
                acc.add_sum(p, total, alpha=late**p, owned=True)
            if need_l2:
                # reshape, not flatten(1): a 0-dim parameter's blocks are [n]
                if squares is None:
                    flat = g.reshape(g.shape[0], -1)
                    l2 = torch.linalg.vector_norm(flat, dim=1).square()
                else:
                    l2 = squares.reshape(g.shape[0], -1).sum(1)
                acc.l2.append(l2.mul_(late**2) if late != 1.0 else l2)
    acc.n += pe.num_examples


def check_order(acc: PowerSums, call: str) -> None:
    """Refuse per-example results (norms, gradients) of a parameter whose module received the
    examples' rows in another order (``h.flip(0)``, ``h[perm]``, the rows sorted by length
    for ``pack_padded_sequence`` and restored after): its rows are not the examples, so
    ``batch_l2[i]`` would belong to another example. The order-free statistics (mean,
    moments, variance) are unaffected. The flags are read here, with the results (a host
    sync), never in the backward pass."""
    labels = [label for label, flag in acc.reordered if bool(flag)]
    if labels:
        raise GradkitError(
            message(
                call,
                "the track block",
                "per-example results of layers whose input rows are the examples in order",
                f"{labels[0]} called on rows reordered along the batch (a flip, a roll, an "
                "index, gather or sort along it, on the way from the model's input)",
                "read the order-free statistics (mean, second moment, variance), or reorder the "
                "rows outside the model (sort the batch before the call), or use "
                "pack_padded_sequence(..., enforce_sorted=False) instead of sorting",
            )
        )
    acc.reordered.clear()  # read in order: nothing to keep checking


def merged_l2(acc: PowerSums) -> torch.Tensor:
    """``[N]``: the squared norms of ``acc``'s examples, merged into one tensor once and kept
    (the accumulator's own: a caller handing it out clones it)."""
    if not acc.l2:
        return acc.zeros(0)
    if len(acc.l2) > 1:
        acc.l2 = [torch.cat(acc.l2)]
    return acc.l2[0]


class ParamStats:
    """Statistics of the individual gradients of one parameter (see the module docstring).

    Attributes:
        name: the parameter's name, as in ``model.named_parameters()``.
        num_examples: ``N``, the number of examples seen.
    """

    def __init__(
        self,
        name: str,
        acc: PowerSums,
        want: Want,
        unbiased: bool,
        *,
        check: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self._acc = acc
        self._want = want
        self._unbiased = unbiased
        self._check = check  # raises when the tracker cannot give statistics now

    def _ready(self, what: str) -> None:
        call = f"stats[{self.name!r}].{what}"
        if self._check is not None:
            self._check(call)
        if self._acc.n == 0:
            raise GradkitError(
                message(
                    call,
                    "the track block",
                    "statistics of at least one example",
                    "0 examples (no backward pass through the model inside the block, or "
                    "only over batches of 0 examples)",
                    "use track as a context manager and backpropagate inside it: "
                    "with gradkit.per_example.track(model, ...) as stats: loss.backward() "
                    "(a batch of 0 examples contributes nothing)" + _compiled_hint(),
                )
            )

    def __repr__(self) -> str:
        return (
            f"ParamStats({self.name!r}, shape={tuple(self._acc.shape)}, "
            f"num_examples={self.num_examples})"
        )

    @property
    def num_examples(self) -> int:
        return self._acc.n

    def _tracked(self, tracked: bool, what: str, ask: str) -> None:
        if not tracked:
            raise GradkitError(
                f"stats[{self.name!r}].{what}: not tracked; pass {ask} to "
                "gradkit.per_example.track(...)"
            )

    def _sum(self, p: int, what: str, ask: str) -> torch.Tensor:
        self._tracked((p == 1 and self._want.mean) or p in self._want.powers, what, ask)
        self._ready(what)
        return self._acc.sums[p]

    def _out(self, kind: str) -> torch.Tensor | None:
        """Storage for a result (:meth:`PowerSums.pooled`), or None: a fresh tensor."""
        return self._acc.pooled(kind)

    def _average(self, p: int, what: str, ask: str) -> torch.Tensor:
        """``(1/N) sum_i g_i**p`` as a tensor of the caller's."""
        return torch.div(self._sum(p, what, ask), self._acc.n, out=self._out(f"moment{p}"))

    @property
    def mean(self) -> torch.Tensor:
        """``(1/N) sum_i g_i``, shaped like the parameter."""
        return self._average(1, "mean", "'mean'")

    @property
    def second_moment(self) -> torch.Tensor:
        """``(1/N) sum_i g_i**2``."""
        return self._average(2, "second_moment", "'second_moment'")

    def moment(self, p: int) -> torch.Tensor:
        """``(1/N) sum_i g_i**p`` for a tracked ``p`` (``moments=(p, ...)``; 1 and 2 come with
        'mean' and 'second_moment')."""
        if not _is_int(p) or p < 1:
            raise ValueError(
                message(
                    f"stats[{self.name!r}].moment(p)",
                    "p",
                    "a positive integer tracked with moments=(p, ...)",
                    repr(p),
                    f"pass one of the tracked powers {self.powers()}",
                )
            )
        return self._average(p, f"moment({p})", f"moments=({p},)")

    def powers(self) -> tuple[int, ...]:
        """The powers ``p`` that :meth:`moment` can give."""
        return tuple(sorted({*self._want.powers, *((1,) if self._want.mean else ())}))

    def var(self, *, unbiased: bool | None = None) -> torch.Tensor:
        """``second_moment - mean**2`` (clamped at 0), times ``N/(N-1)`` if ``unbiased``."""
        if unbiased is not None and not isinstance(unbiased, bool):
            raise TypeError(
                message(
                    f"stats[{self.name!r}].var(unbiased=...)",
                    "unbiased",
                    "True, False or None (as set in track)",
                    describe(unbiased),
                    "pass a bool",
                )
            )
        s1 = self._sum(1, "variance", "'variance'")
        s2 = self._sum(2, "variance", "'variance'")
        n = self._acc.n
        unbiased = self._unbiased if unbiased is None else unbiased
        if unbiased and n < 2:
            raise GradkitError(
                message(
                    f"stats[{self.name!r}].var(unbiased=True)",
                    "the track block",
                    "at least 2 examples for the unbiased variance (N/(N-1))",
                    f"{n} example",
                    "backpropagate more examples, or read the population variance "
                    "var(unbiased=False)",
                )
            )
        v = torch.addcmul(s2, s1, s1, value=-1.0 / n, out=self._out("variance"))
        # one division: sum_i (g_i - mean)**2 over N, or over N - 1 (unbiased)
        v.div_(n - 1 if unbiased else n).clamp_min_(0)
        return v

    @property
    def variance(self) -> torch.Tensor:
        """The variance of the individual gradients (``unbiased`` as set in ``track``)."""
        return self.var()

    @property
    def batch_l2(self) -> torch.Tensor:
        """``[N]``: ``||g_i||**2`` over this parameter, in the order examples were seen."""
        self._tracked("batch_l2" in self._want.quantities, "batch_l2", "'batch_l2'")
        self._ready("batch_l2")
        check_order(self._acc, f"stats[{self.name!r}].batch_l2")
        return merged_l2(self._acc).clone()

    @property
    def batch_grad(self) -> torch.Tensor:
        """``[N, *shape]``: the individual gradients ``g_i``. This is the tracker's own storage
        (no copy of ``O(N x params)``): clone it before modifying it in place."""
        self._tracked("batch_grad" in self._want.quantities, "batch_grad", "'batch_grad'")
        self._ready("batch_grad")
        check_order(self._acc, f"stats[{self.name!r}].batch_grad")
        if not self._acc.grads:
            return self._acc.zeros(0, *self._acc.shape)
        if len(self._acc.grads) > 1:  # merge once, keep the merged tensor
            self._acc.grads = [torch.cat(self._acc.grads)]
        return self._acc.grads[0]

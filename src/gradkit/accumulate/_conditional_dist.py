"""A :class:`ConditionalAccumulator` over a torch.distributed process group: applies are local,
``take_grad`` is collective and returns the same reduction of every rank's gradients on every
rank, or fails on every rank with :class:`TakeTimeout` instead of hanging.

Protocol of one take (every rank runs it; every decision is taken from all-gathered values, so
all ranks take the same branch):

1. a monitored barrier (gloo): a rank that never calls ``take_grad`` fails the take after
   ``timeout``, naming the missing ranks;
2. poll: all-gather ``(count, closed, num_required, global_step, deadline passed)`` per rank;
   serve when the counts sum to ``num_required``; else sleep (1 ms, doubling to 50 ms) and
   poll again until some rank's deadline has passed (then every rank raises ``TakeTimeout``,
   nothing consumed, the group still usable);
3. every rank pops its local aggregate (zeros if empty) and advances its global step, then
   sums and counts are all-reduced.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from gradkit._errors import message
from gradkit.accumulate._conditional_base import AccumulatorClosed, TakeTimeout
from gradkit.accumulate._conditional_checks import (
    check_num_required,
    check_timeout,
    fmt_shape,
)
from gradkit.accumulate._conditional_dense import ConditionalAccumulator

__all__ = ["DistributedConditionalAccumulator"]

_MAX_POLL = 0.05


class DistributedConditionalAccumulator(ConditionalAccumulator):
    r"""A :class:`ConditionalAccumulator` whose takes combine every rank of a process group.

    Every rank calls ``apply_grad(grad, local_step)`` on its own accumulator (staleness and
    validation are local; the global step is the same on every rank because every take
    advances it everywhere). ``take_grad(num_required)`` is collective: it waits until the
    ranks together hold ``C >= num_required`` gradients, then returns on every rank

    .. math:: \text{mean} = \frac1C \sum_{\text{ranks}} \sum_i g_i \quad (\text{or the sum}).

    Args:
        shape: the full shape of the gradients (no unknown dims: a rank without gradients
            contributes zeros of this shape).
        dtype, device, reduction: as for :class:`ConditionalAccumulator`; ``device`` must
            suit the backend (CPU for gloo, the rank's GPU for NCCL).
        group: the process group (default: the world).
        timeout: default seconds a ``take_grad`` may wait (a number or a ``timedelta``).
        poll_interval: first pause between polls of the ranks' counts, in seconds.

    A take that times out in the polling phase (every rank present, too few gradients)
    consumes nothing and leaves the group usable. A take that times out because a rank never
    reached it, or stopped answering, leaves the group in an unknown state: treat it as fatal.

    Examples:
        One rank in process (with ``torchrun``, every rank runs the same code):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradkit.accumulate import DistributedConditionalAccumulator
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> acc = DistributedConditionalAccumulator((2,), reduction="sum", timeout=30.0)
        >>> acc.apply_grad(torch.tensor([1.0, 2.0]), local_step=0)
        True
        >>> acc.apply_grad(torch.tensor([3.0, 4.0]), local_step=0)
        True
        >>> acc.take_grad(2), acc.global_step
        (tensor([4., 6.]), 1)
        >>> dist.destroy_process_group()
    """

    _NAME = "DistributedConditionalAccumulator"

    def __init__(
        self,
        shape: Any,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reduction: str = "mean",
        *,
        group: Any = None,
        timeout: Any = 1800.0,
        poll_interval: float = 1e-3,
    ) -> None:
        super().__init__(shape, dtype, device, reduction)
        call = f"{self._NAME}(shape, dtype, device, reduction, group, timeout, poll_interval)"
        if self._shape is None or any(d is None for d in self._shape):
            raise ValueError(
                message(
                    call,
                    "shape",
                    "a fully known shape (a rank without gradients contributes zeros of it)",
                    fmt_shape(self._shape),
                    "pass the parameter's shape, e.g. shape=p.shape",
                )
            )
        if (
            isinstance(poll_interval, bool)
            or not isinstance(poll_interval, (int, float))
            or not 0 < poll_interval < math.inf
        ):
            raise (TypeError if not isinstance(poll_interval, (int, float)) else ValueError)(
                message(
                    call,
                    "poll_interval",
                    "a positive, finite number of seconds",
                    repr(poll_interval),
                    "pass e.g. poll_interval=1e-3",
                )
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{call}: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first (e.g. launch with torchrun)"
            )
        self._full_shape = tuple(d for d in self._shape if d is not None)
        limit = check_timeout(timeout, call)
        self._timeout = 1800.0 if limit is None else limit
        self._poll = float(poll_interval)
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group))
        if self._backend == "nccl" and torch.device(self._device).type != "cuda":
            raise ValueError(
                message(
                    call,
                    "device",
                    "a CUDA device for a group of the NCCL backend (its collectives take CUDA "
                    "tensors only)",
                    repr(str(self._device)),
                    "pass device=torch.device('cuda', local_rank), or use a gloo group",
                )
            )
        self._take_lock = threading.Lock()

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world

    def take_grad(self, num_required: Any, *, timeout: Any = None) -> torch.Tensor:
        """Collective take: every rank of the group must call it with the same
        ``num_required`` (the total over ranks). Returns the same tensor on every rank and
        advances ``global_step`` by 1 everywhere.

        Raises (on every rank alike):
            ValueError: ``num_required < 1`` or different on different ranks.
            RuntimeError: the ranks' global steps differ (call ``set_global_step`` with the
                same value everywhere).
            TakeTimeout: not every rank arrived, or too few gradients within ``timeout``
                (default: the constructor's); nothing consumed.
            AccumulatorClosed: some rank closed its accumulator.
        """
        call = f"{self._NAME}.take_grad(num_required={num_required!r})"
        n = check_num_required(num_required, call)
        limit = check_timeout(timeout, call)
        limit = self._timeout if limit is None else limit
        deadline = time.monotonic() + limit
        with self._take_lock:
            self._barrier(call, n, deadline, limit)
            interval = self._poll
            while True:
                with self._cond:
                    row = [self._counter, int(self._closed), n, self._global_step]
                row.append(int(time.monotonic() >= deadline))
                if self._decide(self._gather(row, call, n, deadline, limit), n, call, limit):
                    break
                time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
                interval = min(2 * interval, _MAX_POLL)
            with self._cond:
                total, count = self._pop_locked()
                self._global_step += 1
                self._counter = 0
            if total is None:
                total = torch.zeros(self._full_shape, dtype=self._acc_dtype, device=self._device)
            counts = torch.tensor([count], dtype=torch.int64, device=self._device)
            for t in (total, counts):
                work = dist.all_reduce(t, group=self._group, async_op=True)
                self._wait(work, call, n, deadline, limit)
        if self._reduction == "mean":
            total.div_(int(counts.item()))
        return total.to(self._dtype)

    # ---- collective helpers
    def _barrier(self, call: str, n: int, deadline: float, limit: float) -> None:
        if self._backend != "gloo":
            return  # the first all-gather's timed wait catches a missing rank
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
        try:
            dist.monitored_barrier(group=self._group, timeout=left, wait_all_ranks=True)
        except RuntimeError as err:
            raise TakeTimeout(
                f"{call}: not every rank reached take_grad within {limit:g} s ({err}); a "
                "collective take needs all ranks; the process group is unusable after this",
                num_required=n,
                num_accumulated=self.num_accumulated,
                timeout=limit,
            ) from err

    def _wait(self, work: Any, call: str, n: int, deadline: float, limit: float) -> None:
        grace = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.0) + limit)
        try:
            work.wait(timeout=grace)
        except RuntimeError as err:
            raise TakeTimeout(
                f"{call}: a collective did not complete ({err}): a rank stopped taking part; "
                "the process group is unusable after this",
                num_required=n,
                num_accumulated=self.num_accumulated,
                timeout=limit,
            ) from err

    def _gather(
        self, row: list[int], call: str, n: int, deadline: float, limit: float
    ) -> list[list[int]]:
        local = torch.tensor(row, dtype=torch.int64, device=self._device)
        out = [torch.empty_like(local) for _ in range(self._world)]
        self._wait(
            dist.all_gather(out, local, group=self._group, async_op=True), call, n, deadline, limit
        )
        return [o.tolist() for o in out]

    def _decide(self, table: list[list[int]], n: int, call: str, limit: float) -> bool:
        """Serve (True), poll again (False) or raise; the same on every rank."""
        counts, closed, required, steps, late = (list(col) for col in zip(*table, strict=True))
        if any(closed):
            ranks = [r for r, c in enumerate(closed) if c]
            raise AccumulatorClosed(
                f"{call}: the accumulator was closed on rank(s) {ranks}; nothing was consumed"
            )
        if len(set(required)) > 1:
            raise ValueError(
                message(
                    call,
                    "num_required",
                    "the same value on every rank",
                    f"{required} on ranks 0..{self._world - 1}",
                    "pass the total number of gradients over all ranks, on every rank",
                )
            )
        if len(set(steps)) > 1:
            raise RuntimeError(
                f"{call}: the global steps differ across ranks ({steps} on ranks "
                f"0..{self._world - 1}); call set_global_step(step) with the same step on every "
                "rank"
            )
        if sum(counts) >= n:
            return True
        if any(late):
            per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            raise TakeTimeout(
                f"{call}: timed out after {limit:g} s waiting for {n} gradient(s) over "
                f"{self._world} ranks; {sum(counts)} arrived ({per_rank}); nothing was "
                "consumed; check that every rank applies its gradient with the current "
                "local_step, or raise the timeout",
                num_required=n,
                num_accumulated=sum(counts),
                timeout=limit,
            )
        return False


DistributedConditionalAccumulator.__module__ = "gradkit.accumulate"

"""Exact micro-batch accumulation: the accumulated gradient equals the large-batch gradient.

The rule (reference: the large-batch loss is a sum of per-micro-batch terms): every micro-step
backpropagates the **sum** of its items' losses (examples, or valid tokens), the accumulator
counts the items, and :meth:`Accumulator.step` divides the summed gradient once by the window's
total count ``N`` (summed over micro-steps *and* ranks):

.. math:: \\nabla L = \\frac{1}{N} \\sum_{j} \\nabla \\sum_{i \\in B_j} \\ell_i

so micro-batches of unequal size, padded token batches, a short last window and ranks with
different token counts all give the full-batch gradient. Everything that must happen once per
window happens once: the all-reduce (DDP ``no_sync`` on every micro-step but the last, or one
explicit all-reduce), AMP unscaling and the inf/NaN check, clipping, the optimizer step, the
scheduler step, ``zero_grad``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import check_choice, check_module

__all__ = ["Accumulator", "StepResult", "split_batch"]

logger = logging.getLogger(__name__)
_NORMALIZE = ("examples", "tokens", "sum")


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Accumulator.step` did for one window.

    Attributes:
        stepped: whether the optimizer stepped (False when the window was skipped).
        count: the window's total count ``N`` over micro-steps and ranks.
        micro_steps: micro-steps in the window (on this rank).
        grad_norm: the total gradient norm before clipping (None unless clipping or asked).
        skipped_reason: why the window was skipped ("non-finite gradient", "amp overflow").
    """

    stepped: bool
    count: float
    micro_steps: int
    grad_norm: float | None = None
    skipped_reason: str | None = None


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return _batch_size(batch[0])
    raise TypeError(
        message(
            "split_batch(batch, ...)",
            "batch",
            "a tensor, or a tuple, list or dict of tensors with the examples along dimension 0",
            describe(batch),
            "pass the batch as the loader gives it",
        )
    )


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: _slice(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, start, stop) for v in batch)
    return batch  # non-tensor leaves are shared by every micro-batch


def split_batch(
    batch: Any, *, micro_batch_size: int | None = None, num_micro_batches: int | None = None
) -> list[Any]:
    """Split a batch (tensor, or tuple/list/dict of tensors, examples along dim 0) into
    micro-batches of ``micro_batch_size`` examples (the last may be shorter) or into
    ``num_micro_batches`` nearly equal parts.

    Examples:
        >>> import torch
        >>> [m.shape[0] for m in split_batch(torch.zeros(10, 3), micro_batch_size=4)]
        [4, 4, 2]
        >>> [m[1].shape[0] for m in split_batch((torch.zeros(5), torch.ones(5)),
        ...                                     num_micro_batches=2)]
        [3, 2]
    """
    call = "split_batch(batch, ...)"
    if (micro_batch_size is None) == (num_micro_batches is None):
        raise ValueError(
            message(
                call,
                "micro_batch_size / num_micro_batches",
                "exactly one of them",
                f"{micro_batch_size!r} / {num_micro_batches!r}",
                "pass e.g. micro_batch_size=8",
            )
        )
    n = _batch_size(batch)
    size = (
        micro_batch_size
        if micro_batch_size is not None
        else math.ceil(n / max(1, num_micro_batches or 1))
    )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            message(
                call,
                "micro_batch_size",
                "a positive int",
                repr(size),
                "pass e.g. micro_batch_size=8",
            )
        )
    return [_slice(batch, s, min(s + size, n)) for s in range(0, n, size)]


class Accumulator:
    """Exact gradient accumulation over micro-batches for a model and its optimizer.

    Args:
        model: the model (possibly wrapped in ``DistributedDataParallel``).
        optimizer: its optimizer.
        normalize: ``"examples"`` (divide by the number of examples; counted from the
            micro-batches :meth:`split` yields, or given as ``count=``), ``"tokens"`` (divide by
            the ``count=`` each micro-step gives, e.g. valid tokens) or ``"sum"`` (no division).
        max_grad_norm: clip the window's gradient to this norm, once, after unscaling.
        scaler: a ``torch.amp.GradScaler``: losses are scaled in :meth:`backward`; unscaling,
            the inf/NaN check and the scale update happen once per window.
        scheduler: stepped once per window, after a successful optimizer step.
        skip_nonfinite: skip a window whose gradient has inf/NaN (without a scaler; with one,
            the scaler decides).
        group: the ``torch.distributed`` process group (default: the world group when
            initialized).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.accumulate import Accumulator
        >>> model = nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = Accumulator(model, opt)
        >>> x, y = torch.randn(10, 3), torch.randn(10, 1)
        >>> for xb, yb in acc.split((x, y), micro_batch_size=4):
        ...     with acc.micro_step():
        ...         acc.backward(((model(xb) - yb) ** 2).sum())   # a SUM over the micro-batch
        >>> acc.step().count
        10.0

    Warning:
        Losses passed to :meth:`backward` must be **sums** over the micro-batch's items:
        the division by the window's total count happens once, in :meth:`step`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        normalize: str = "examples",
        max_grad_norm: float | None = None,
        scaler: Any = None,
        scheduler: Any = None,
        skip_nonfinite: bool = True,
        group: Any = None,
    ) -> None:
        call = "Accumulator(model, optimizer)"
        check_module(model, call, "pass the model being trained")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                message(
                    call,
                    "optimizer",
                    "a torch.optim.Optimizer",
                    describe(optimizer),
                    "pass the model's optimizer",
                )
            )
        self.normalize = check_choice(normalize, _NORMALIZE, call, "normalize")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(
                message(
                    call,
                    "max_grad_norm",
                    "None or a positive number",
                    repr(max_grad_norm),
                    "pass e.g. max_grad_norm=1.0",
                )
            )
        self.model, self.optimizer = model, optimizer
        self.max_grad_norm, self.scaler, self.scheduler = max_grad_norm, scaler, scheduler
        self.skip_nonfinite = skip_nonfinite
        self.group = group
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.windows = 0
        self.skipped = 0
        self._count = 0.0
        self._micro_steps = 0
        self._in_micro = False
        self._micro_count: float | None = None
        self._split_sizes: list[int] = []
        self._split_last = True
        self._last_synced = False
        self._warned_bn = False

    # -- the window ----------------------------------------------------------------------------

    @property
    def _ddp(self) -> bool:
        return isinstance(self.model, nn.parallel.DistributedDataParallel)

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def split(
        self,
        batch: Any,
        *,
        micro_batch_size: int | None = None,
        num_micro_batches: int | None = None,
    ) -> Iterator[Any]:
        """Yield the micro-batches of ``batch`` (see :func:`split_batch`); the last one's
        backward synchronizes DDP gradients, the others run under ``no_sync``."""
        parts = split_batch(
            batch, micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches
        )
        for k, part in enumerate(parts):
            self._split_sizes = [_batch_size(part)]
            self._split_last = k == len(parts) - 1
            yield part
        self._split_sizes = []

    @contextlib.contextmanager
    def micro_step(self, count: float | None = None) -> Iterator[None]:
        """One micro-step: run the micro-batch's forward and :meth:`backward` inside.

        Args:
            count: the number of items whose summed loss this micro-step backpropagates
                (tokens for ``normalize="tokens"``; defaults to the micro-batch's examples when
                :meth:`split` produced it).
        """
        call = "Accumulator.micro_step(count)"
        if self._in_micro:
            raise GradkitError(f"{call}: micro-steps do not nest; close the previous one first")
        if self._micro_steps == 0 and self.windows == 0:
            self._check_clean_start()  # later windows start clean: step() zeroes
        if count is None:
            if self.normalize == "tokens":
                raise ValueError(
                    message(
                        call,
                        "count",
                        "the number of tokens of this micro-batch (normalize='tokens')",
                        "None",
                        "pass count=number of non-padding tokens",
                    )
                )
            if self.normalize == "examples" and not self._split_sizes:
                raise ValueError(
                    message(
                        call,
                        "count",
                        "the number of examples of this micro-batch",
                        "None",
                        "pass count=len(micro_batch) or iterate over acc.split(batch, ...)",
                    )
                )
            count = float(self._split_sizes[0]) if self._split_sizes else 0.0
        elif isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
            raise ValueError(
                message(
                    call,
                    "count",
                    "a non-negative number",
                    repr(count),
                    "pass the number of items the summed loss covers",
                )
            )
        if self._micro_steps == 0:
            self._check_batchnorm()  # once per window
        sync = not self._split_sizes or self._split_last
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self._ddp and not sync:
            assert isinstance(self.model, nn.parallel.DistributedDataParallel)
            ctx = self.model.no_sync()
        self._in_micro = True
        self._micro_count = float(count)
        try:
            with ctx:
                yield
        finally:
            self._in_micro = False
        self._count += float(count)
        self._micro_steps += 1
        self._last_synced = self._ddp and sync

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a micro-batch's **summed** loss (scaled by the AMP scaler if any)."""
        if not self._in_micro:
            raise GradkitError(
                "Accumulator.backward(loss): call it inside "
                "`with acc.micro_step(...)`, which counts the micro-batch and "
                "decides whether DDP synchronizes"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                message(
                    "Accumulator.backward(loss)",
                    "loss",
                    "a scalar tensor (the sum of the micro-batch's losses)",
                    describe(loss),
                    "reduce with .sum()",
                )
            )
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _check_clean_start(self) -> None:
        stale = [p for p in self.params if p.grad is not None and bool(p.grad.any())]
        if stale:
            raise GradkitError(
                "Accumulator.micro_step(): parameters already hold gradients "
                "at the start of a window (they would be added to it); call "
                "optimizer.zero_grad() before the first window"
            )

    def _check_batchnorm(self) -> None:
        if self._warned_bn:
            return
        bn = [
            type(m).__name__
            for m in self.model.modules()
            if isinstance(m, _BatchNorm) and m.training
        ]
        if bn:
            self._warned_bn = True
            warnings.warn(
                f"Accumulator: {bn[0]} in training mode normalizes each micro-batch "
                "with its own statistics (and updates running statistics once per "
                "micro-batch), so the accumulated gradient cannot equal the "
                "large-batch one; use GroupNorm/LayerNorm, or accept the difference",
                stacklevel=3,
            )

    # -- the step ------------------------------------------------------------------------------

    def _global_count(self) -> float:
        if not self._distributed:
            return self._count
        t = torch.tensor(
            [self._count],
            dtype=torch.float64,
            device=self.params[0].device if self.params else "cpu",
        )
        dist.all_reduce(t, group=self.group)
        return float(t.item())

    def _reduce_grads(self, count: float) -> bool:
        """Turn the summed gradients into the window's gradient: all-reduce if DDP did not
        (exactly one all-reduce per window), then divide by the total count. Returns whether
        every gradient is finite (checked in the same pass when no AMP scaler decides)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return True
        world = dist.get_world_size(self.group) if self._distributed else 1
        scale = 1.0
        if self._distributed and not self._last_synced:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        elif self._last_synced:
            scale = float(world)  # DDP averaged over ranks: undo it, then divide by N
        if self.normalize != "sum":
            if count <= 0:
                raise GradkitError(
                    "Accumulator.step(): the window's count is 0; pass the "
                    "number of items with micro_step(count=...)"
                )
            scale /= count
        check = self.scaler is None and self.skip_nonfinite
        device = grads[0].device
        fused = all(
            g.device == device and not g.is_sparse and g.dtype != torch.float64 for g in grads
        )  # AMP's kernel takes the scale in float32: float64 gradients are scaled exactly below
        if check and fused:
            # one fused pass: multiply by `scale` and look for inf/NaN (AMP's own kernel)
            found = torch.zeros(1, device=device)
            inv = torch.full((1,), scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            return bool(found.item() == 0)
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        return not check or all(bool(torch.isfinite(g).all()) for g in grads)

    def step(self) -> StepResult:
        """End the window: reduce, normalize, unscale, clip, step (or skip), zero the grads."""
        if self._in_micro:
            raise GradkitError("Accumulator.step(): still inside a micro_step block")
        if self._micro_steps == 0:
            raise GradkitError(
                "Accumulator.step(): no micro-step in this window; run at least "
                "one `with acc.micro_step(): acc.backward(loss)` first"
            )
        count = self._global_count()
        finite = self._reduce_grads(count)
        norm: float | None = None
        reason: str | None = None
        stepped = True
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            total = nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            norm = float(total)
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < before:
                stepped, reason = False, "amp overflow"
        else:
            if finite:
                self.optimizer.step()
            else:
                stepped, reason = False, "non-finite gradient"
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        if not stepped:
            self.skipped += 1
            logger.warning("Accumulator.step(): window %d skipped (%s)", self.windows, reason)
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(stepped, count, self._micro_steps, norm, reason)
        self.windows += 1
        self._count, self._micro_steps, self._last_synced = 0.0, 0, False
        return result

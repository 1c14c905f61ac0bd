"""Exact micro-batch accumulation: the accumulated gradient equals the large-batch gradient.

The rule (reference: the large-batch loss is a sum of per-micro-batch terms): every micro-step
backpropagates the **sum** of its items' losses (examples, or valid tokens), the accumulator
counts the items, and :meth:`Accumulator.step` divides the summed gradient once by the window's
total count ``N`` (summed over micro-steps *and* ranks):

.. math:: \\nabla L = \\frac{1}{N} \\sum_{j} \\nabla \\sum_{i \\in B_j} \\ell_i

so micro-batches of unequal size, padded token batches, a short last window and ranks with
different token counts all give the full-batch gradient. Everything that must happen once per
window happens once, in :meth:`Accumulator.step`: the all-reduce over ranks (every micro-step
runs under DDP's ``no_sync``; ``step`` sums the count and the gradients explicitly, so ranks
may run different numbers of micro-steps), the division by ``N`` (in each gradient's own
dtype), AMP unscaling and the inf/NaN check, clipping, the optimizer step, the scheduler
step, ``zero_grad``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit._layouts import sequence_first_layer
from gradkit._sharded import fsdp2_modules, is_dtensor, local, refuse_fsdp1
from gradkit._validate import check_choice, check_module
from gradkit.accumulate._batches import batch_size, split_batch
from gradkit.accumulate._micro_checks import (
    batch_statistics_node,
    batchnorm_in_training,
    check_ddp_forward,
    check_deferred_counts,
    check_loss,
    check_max_grad_norm,
    check_optimizer_covers,
    check_scaler,
    check_scheduler,
    check_summed,
    find_ddp,
    is_bad,
    prepare_fsdp2,
    read_counts,
    resolve_count,
)
from gradkit.accumulate._window import (
    all_reduce_grads,
    all_reduce_tally,
    clip_,
    divide_,
    float64_compensation,
    scale_,
    sharded_norm,
)

__all__ = ["Accumulator", "StepResult", "split_batch"]

logger = logging.getLogger(__name__)
_NORMALIZE = ("examples", "tokens", "sum")
_BAD_COUNT = "non-finite or negative count"


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Accumulator.step` did for one window.

    Attributes:
        stepped: whether the optimizer stepped (False when the window was skipped).
        count: the window's total count ``N`` over micro-steps and ranks (NaN, inf and
            negative counts left out).
        micro_steps: micro-steps in the window (on this rank).
        grad_norm: the total gradient norm before clipping (None without ``max_grad_norm``;
            ``max_grad_norm=float('inf')`` reports it without clipping).
        skipped_reason: why the window was skipped: ``"non-finite gradient"``,
            ``"amp overflow"`` or ``"non-finite or negative count"``.
    """

    stepped: bool
    count: float
    micro_steps: int
    grad_norm: float | None = None
    skipped_reason: str | None = None


class Accumulator:
    """Exact gradient accumulation over micro-batches for a model and its optimizer.

    Args:
        model: the model (possibly wrapped in ``DistributedDataParallel``, or sharded with
            FSDP2's ``fully_shard``: FSDP then sums the gradient shards over the ranks, once
            per window when the last micro-step is known, and the norm is the global one;
            every rank runs the same number of micro-steps; FSDP1 is refused).
        optimizer: its optimizer; it must hold at least one trainable parameter of ``model``
            (else ``ValueError``). Only the optimizer's parameters are reduced, divided,
            clipped, stepped and zeroed.
        normalize: ``"examples"`` (divide by the number of examples; counted from the
            micro-batches :meth:`split` yields, or given as ``count=``), ``"tokens"`` (divide by
            the ``count=`` each micro-step gives, e.g. valid tokens) or ``"sum"`` (no division).
        max_grad_norm: clip the window's gradient to this norm, once, after unscaling
            (``float('inf')``: only report the norm).
        scaler: a ``torch.amp.GradScaler``: losses are scaled in :meth:`backward`; unscaling,
            the inf/NaN check and the scale update happen once per window.
        scheduler: stepped once per window, after a successful optimizer step; it must be a
            scheduler of ``optimizer``.
        skip_nonfinite: skip a window whose gradient has inf/NaN (without a scaler; with one,
            the scaler decides), or whose count is NaN, inf or negative. With ``False`` such a
            count raises ``ValueError`` at :meth:`micro_step`, and non-finite gradients are
            stepped.
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
        the division by the window's total count happens once, in :meth:`step`. Run the
        forward inside ``with acc.micro_step()`` (with DDP, :meth:`backward` raises otherwise).
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
        self.max_grad_norm = check_max_grad_norm(max_grad_norm, call)
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(
                message(
                    call, "skip_nonfinite", "True or False", repr(skip_nonfinite), "pass a bool"
                )
            )
        check_scaler(scaler, call)
        check_scheduler(scheduler, optimizer, call)
        check_optimizer_covers(model, optimizer, call)
        refuse_fsdp1(model, call)
        self._fsdp = fsdp2_modules(model)
        self._fsdp_group = (
            prepare_fsdp2(self._fsdp, optimizer, scaler, call) if self._fsdp else None
        )
        self.model, self.optimizer = model, optimizer
        self.scaler, self.scheduler = scaler, scheduler
        self.skip_nonfinite = skip_nonfinite
        self.group = group
        self.windows = 0
        self.skipped = 0
        self._warned_bn = False
        self._graph_read = False  # the first backward's graph was searched (see backward)
        self._warned_layout = False  # see _check_sequence_first
        self._in_micro = False
        self._backward_done = False
        self._pending: int | None = None  # examples of the micro-batch split() just yielded
        self._pending_last: bool | None = None  # whether it is the batch's last one
        self._reset_window()

    def _reset_window(self) -> None:
        self._count = 0.0
        self._micro_steps = 0
        # after the window's last backward: each parameter's gradient and its version, which
        # nothing may change before the next (see _check_held)
        self._held: list[tuple[torch.Tensor | None, int]] | None = None
        self._bad: list[float] = []  # NaN, inf or negative counts of this window
        self._tensor_counts: list[torch.Tensor] = []  # read once, in step()

    # -- the window ----------------------------------------------------------------------------

    @property
    def params(self) -> list[torch.Tensor]:
        """The optimizer's parameters, read at each use (``add_param_group`` is seen)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def split(
        self,
        batch: Any,
        *,
        micro_batch_size: int | None = None,
        num_micro_batches: int | None = None,
        batch_dim: int | None = None,
    ) -> Iterator[Any]:
        """Yield the micro-batches of ``batch`` (see :func:`split_batch`); a
        :meth:`micro_step` without ``count`` counts the examples of the one just yielded.

        ``batch_dim``: the dimension of the batch's tensors that holds the examples (1 for a
        sequence-first ``[T, N, ...]`` batch). Left out, it is 0, with a warning (once per
        accumulator) where the model has a sequence-first layer (an RNN or attention with
        ``batch_first=False``): split along dimension 0, a sequence-first batch would give
        micro-batches of time steps, not of examples. Pass it to say which."""
        if batch_dim is None:
            batch_dim = 0
            self._check_sequence_first()
        parts = split_batch(
            batch,
            micro_batch_size=micro_batch_size,
            num_micro_batches=num_micro_batches,
            batch_dim=batch_dim,
        )
        try:
            for i, part in enumerate(parts):
                self._pending = batch_size(part, batch_dim=batch_dim)
                self._pending_last = i == len(parts) - 1
                yield part
        finally:
            self._pending = None
            self._pending_last = None

    def _check_sequence_first(self) -> None:
        name = None if self._warned_layout else sequence_first_layer(self.model)
        if name is not None:
            self._warned_layout = True
            warnings.warn(
                f"Accumulator.split(batch, ...): {name} takes its examples along dimension 1 "
                "(batch_first=False), and the batch is split along dimension 0 (batch_dim "
                "left out). A sequence-first batch ([T, N, ...]) split there gives micro-batches "
                "of time steps, whose accumulated gradient is not the batch's: pass "
                "batch_dim=1. If the batch is batch-first and the model transposes it, pass "
                "batch_dim=0 to say so.",
                stacklevel=3,
            )

    @contextlib.contextmanager
    def micro_step(self, count: Any = None, *, last: bool | None = None) -> Iterator[None]:
        """One micro-step: run the micro-batch's forward and :meth:`backward` inside.

        Args:
            count: the number (or total weight) of items whose summed loss this micro-step
                backpropagates: tokens for ``normalize="tokens"``; defaults to the micro-batch's
                examples when :meth:`split` produced it. An int, a float or a one-element
                tensor; ``0`` for an empty micro-batch (then :meth:`backward` may be left out).
                A tensor (e.g. ``(labels != -100).sum()`` on the GPU) is not read here:
                :meth:`step` reads the window's tensor counts together, so a micro-step never
                waits for the device. A NaN, inf or negative count skips the window
                (``skip_nonfinite=True``) or raises ``ValueError`` (for a tensor count, from
                :meth:`step`, which then changes nothing).
            last: FSDP2 only: whether this is the window's last micro-step on this rank. FSDP
                then reduce-scatters once, in its backward, and the earlier micro-steps keep
                their gradients local. Micro-batches from :meth:`split` know it; ``None`` (not
                known) reduce-scatters in every micro-step, which is exact too.

        If the block raises after :meth:`backward`, the micro-step still counts (its gradient
        is in ``.grad``); if it raises before, nothing was added.
        """
        call = "Accumulator.micro_step(count)"
        if self._in_micro:
            raise GradkitError(f"{call}: micro-steps do not nest; close the previous one first")
        pending, self._pending = self._pending, None
        pending_last, self._pending_last = self._pending_last, None
        if last is not None and not isinstance(last, bool):
            raise TypeError(
                message(call, "last", "None, True or False", describe(last), "pass a bool")
            )
        value = resolve_count(count, pending, self.normalize, self.skip_nonfinite, call)
        if self._micro_steps == 0:  # once per window
            self._check_clean_start()
            self._check_batchnorm()
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        ddp = find_ddp(self.model)
        if ddp is not None:
            ctx = ddp.no_sync()  # step() all-reduces once
        elif self._fsdp:  # FSDP reduce-scatters in the last micro-step's backward
            ctx = _gradient_sync(
                self._fsdp, (last if last is not None else pending_last) is not False
            )
        self._in_micro, self._backward_done = True, False
        try:
            with ctx:
                yield
        except BaseException:
            if self._backward_done:
                self._commit(value)
            raise
        finally:
            self._in_micro = False
        if not self._backward_done:
            # the rare path that reads a tensor count before step(): a block without backward
            known = float(value) if isinstance(value, torch.Tensor) else value
            if known != 0 and not is_bad(known):
                raise GradkitError(
                    f"{call}: the micro-step with count={known:g} ended without "
                    "acc.backward(loss): its items would be counted with no gradient; call "
                    "acc.backward(summed_loss) inside the block (not loss.backward()), or pass "
                    "count=0 for an empty micro-batch; nothing was added to the window"
                )
        self._commit(value)

    def _commit(self, value: float | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            self._tensor_counts.append(value)
        else:
            self._add_count(value)
        self._micro_steps += 1

    def _add_count(self, value: float) -> None:
        if is_bad(value):
            self._bad.append(value)
        else:
            self._count += value

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a micro-batch's **summed** loss (scaled by the AMP scaler if any)."""
        call = "Accumulator.backward(loss)"
        if not self._in_micro:
            raise GradkitError(
                f"{call}: call it inside `with acc.micro_step(...)`, which counts the "
                "micro-batch and keeps DDP from synchronizing"
            )
        check_loss(loss, call)
        check_summed(loss, call, self.normalize)
        if not self._warned_bn and not self._graph_read:  # the first backward: the graph once
            self._graph_read = True
            name = batch_statistics_node(loss)
            if name is not None:
                self._warn_batchnorm(f"a batch normalization in the loss's graph ({name})", 3)
        check_ddp_forward(self.model, call)
        self._check_held(call)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self._backward_done = True
        self._held = [(p.grad, -1 if p.grad is None else p.grad._version) for p in self.params]

    def _check_held(self, call: str) -> None:
        """Refuse a window whose accumulated gradients were changed since its last backward:
        ``optimizer.zero_grad()`` at the top of each micro-step (the habit of a plain loop)
        drops the earlier micro-steps, a ``loss.backward()`` outside :meth:`backward` adds a
        pass the window does not count; either would be divided by the window's count as if
        it were its sum (50 % off, silently). Reads no value: the tensors and their version
        counters."""
        if self._held is None:
            return
        params = self.params
        changed = len(params) != len(self._held) or any(
            p.grad is not g or (g is not None and g._version != v)
            for p, (g, v) in zip(params, self._held, strict=False)
        )
        if changed:
            raise GradkitError(
                message(
                    call,
                    "the model's gradients",
                    "the sum of this window's earlier micro-steps, as its last backward left it",
                    "gradients cleared or changed since (optimizer.zero_grad() or "
                    "model.zero_grad() inside the window, a loss.backward() outside "
                    "acc.backward, an in-place edit of p.grad)",
                    "call zero_grad() nowhere inside the loop (acc.step() sets the gradients to "
                    "None) and backpropagate only with acc.backward(loss); acc.reset() drops "
                    "the window",
                )
            )

    def _check_clean_start(self) -> None:
        """Refuse a window that starts with nonzero gradients: a backward pass outside
        :meth:`micro_step` since the last :meth:`step` (which sets them to None), or gradients
        left before the first window, would be added to it. Only gradients that are not None
        are read (a device sync): after a step there are none."""
        held = [p.grad for p in self.params if p.grad is not None]
        if held and any(bool(local(g).any()) for g in held):
            raise GradkitError(
                message(
                    "Accumulator.micro_step()",
                    "the model's gradients",
                    "none at the start of a window (step() sets them to None)",
                    "parameters that already hold gradients, which would be added to this "
                    "window: a backward pass "
                    "outside `with acc.micro_step()` since the last acc.step(), or gradients "
                    "left before the first window",
                    "backpropagate only inside micro_step with acc.backward(loss); call "
                    "acc.reset() (or optimizer.zero_grad()) to drop such gradients",
                )
            )

    def _check_batchnorm(self) -> None:
        name = None if self._warned_bn else batchnorm_in_training(self.model)
        if name is not None:
            self._warn_batchnorm(f"{name} in training mode", 4)

    def _warn_batchnorm(self, what: str, stacklevel: int) -> None:
        self._warned_bn = True
        warnings.warn(
            f"Accumulator: {what} normalizes each micro-batch with its own statistics (and "
            "updates running statistics once per micro-batch), so the accumulated gradient "
            "cannot equal the large-batch one; use GroupNorm/LayerNorm, or accept the "
            "difference",
            stacklevel=stacklevel,
        )

    def reset(self) -> None:
        """Discard the open window without stepping: the optimizer's gradients are set to
        ``None`` and the counts to 0 (e.g. after :meth:`step` refused a window of count 0)."""
        if self._in_micro:
            raise GradkitError("Accumulator.reset(): still inside a micro_step block")
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    # -- the step ------------------------------------------------------------------------------

    def _tally(self) -> tuple[float, float, float, float, list[bool]]:
        """(count, bad counts, micro-steps, sparse gradients, which parameters have a
        gradient), summed over the ranks: one small all-reduce."""
        params = self.params
        if self._tensor_counts:  # one synchronization for the window's tensor counts
            values = read_counts(self._tensor_counts)
            check_deferred_counts(values, self.skip_nonfinite, "Accumulator.step()")
            self._tensor_counts = []
            for value in values:
                self._add_count(value)
        present = [p.grad is not None for p in params]
        sparse = any(p.grad is not None and p.grad.is_sparse for p in params)
        values = [self._count, float(len(self._bad)), float(self._micro_steps), float(sparse)]
        values += [float(h) for h in present]
        if self._distributed:
            device = params[0].device if params else torch.device("cpu")
            values = all_reduce_tally(values, device, self.group)
        count, bad, micro, sparse_ranks = values[:4]
        return count, bad, micro, sparse_ranks, [v > 0 for v in values[4:]]

    def _finish(self, result: StepResult) -> StepResult:
        if not result.stepped:
            self.skipped += 1
            logger.warning(
                "Accumulator.step(): window %d skipped (%s)", self.windows, result.skipped_reason
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.windows += 1
        self._reset_window()
        return result

    def step(self) -> StepResult:
        """End the window: all-reduce (count and gradients, once), divide by the count,
        unscale, clip, step (or skip), step the scheduler, zero the grads.

        Raises (leaving gradients, weights and the open window as they were):
            GradkitError: no micro-step in the window (on any rank), or a window count of 0
                with ``normalize="examples"``/``"tokens"`` (call :meth:`reset` to drop it).
        """
        call = "Accumulator.step()"
        if self._in_micro:
            raise GradkitError(f"{call}: still inside a micro_step block")
        count, bad, micro, sparse, present = self._tally()
        where = " on any rank" if self._distributed else ""
        if micro == 0:
            raise GradkitError(
                f"{call}: no micro-step in this window{where}; run at least one "
                "`with acc.micro_step(): acc.backward(loss)` first"
            )
        if bad:
            return self._finish(StepResult(False, count, self._micro_steps, None, _BAD_COUNT))
        if self.normalize != "sum" and count == 0:
            raise GradkitError(
                f"{call}: the window's count (normalize={self.normalize!r}) is 0{where}, so its "
                "mean is undefined; pass the number of items with micro_step(count=...), or "
                "drop the window with acc.reset(); nothing was changed"
            )
        if self._distributed and sparse:
            raise GradkitError(
                f"{call}: sparse gradients (e.g. nn.Embedding(sparse=True)) are not all-reduced "
                "across ranks; use dense gradients (sparse=False); nothing was changed"
            )
        params = self.params
        if self._distributed:  # FSDP has reduced its shards; the rest is all-reduced here
            plain = [i for i, p in enumerate(params) if not is_dtensor(p)]
            all_reduce_grads([params[i] for i in plain], [present[i] for i in plain], self.group)
        grads = [local(p.grad) for p in params if p.grad is not None]
        # a disabled GradScaler (enabled=use_amp) decides nothing: the window is checked here
        scaling = self.scaler is not None and self.scaler.is_enabled()
        check = not scaling and self.skip_nonfinite
        finite = divide_(
            grads,
            None if self.normalize == "sum" else count,
            check=check,
            wide=float64_compensation(self.scaler),
        )
        if scaling:
            assert self.scaler is not None
            self.scaler.unscale_(self.optimizer)
        norm: float | None = None
        if self._fsdp and self._fsdp_group is not None:
            finite, norm = sharded_norm(params, finite, self.max_grad_norm, self._fsdp_group)
            if norm is not None and self.max_grad_norm is not None:
                scale_(grads, norm, self.max_grad_norm)
        elif self.max_grad_norm is not None:
            norm = clip_(grads, self.max_grad_norm)
        if scaling:
            assert self.scaler is not None
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < before:
                return self._finish(
                    StepResult(False, count, self._micro_steps, norm, "amp overflow")
                )
        elif not finite:
            return self._finish(
                StepResult(False, count, self._micro_steps, norm, "non-finite gradient")
            )
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return self._finish(StepResult(True, count, self._micro_steps, norm))


@contextlib.contextmanager
def _gradient_sync(modules: list[nn.Module], sync: bool) -> Iterator[None]:
    """FSDP2's gradient reduction on (``sync``) or off for the block; on again afterwards."""
    fsdp = [cast(Any, m) for m in modules]
    for m in fsdp:
        m.set_requires_gradient_sync(sync, recurse=False)
    try:
        yield
    finally:
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)

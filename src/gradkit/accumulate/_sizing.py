"""Choosing batch sizes: the largest micro-batch that fits a memory budget, and an adaptive
number of micro-batches per step from the statistics of individual gradients.

Micro-batch size never changes the result of :class:`~gradkit.accumulate.Accumulator` (it is
exact for any split), only memory and speed, so it can be chosen freely.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import (
    check_choice,
    check_int,
    check_module,
    check_number,
    check_optional_int,
)
from gradkit.accumulate._batches import batch_size, slice_batch

__all__ = ["AdaptiveBatchSize", "activation_bytes", "find_micro_batch_size"]


def _check_loss_fn(loss_fn: Any, call: str) -> None:
    if not callable(loss_fn):
        raise TypeError(
            message(
                call,
                "loss_fn",
                "a callable loss_fn(model, micro_batch) -> summed loss",
                describe(loss_fn),
                "pass e.g. loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1], reduction='sum')",
            )
        )


def _check_loss(loss: Any, call: str) -> torch.Tensor:
    if (
        not isinstance(loss, torch.Tensor)
        or loss.numel() != 1
        or not loss.is_floating_point()
        or not loss.requires_grad
    ):
        raise ValueError(
            message(
                call,
                "loss_fn",
                "to return a scalar loss that requires grad (the summed loss of the micro-batch)",
                describe(loss)
                + (
                    " that does not require grad"
                    if isinstance(loss, torch.Tensor) and not loss.requires_grad
                    else ""
                ),
                "return e.g. loss.sum(), computed from model(micro_batch) outside torch.no_grad()",
            )
        )
    return loss


def activation_bytes(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], micro_batch: Any
) -> int:
    """Bytes the forward pass of ``loss_fn(model, micro_batch)`` saves for backward (the
    activation memory of one micro-step): each saved tensor once, parameters excluded.

    The backward runs too (so the graph is freed). The model is left as it was: gradients
    the parameters held before, buffers (e.g. BatchNorm running statistics) and the random
    number generators (dropout) are restored afterwards.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(10, 20), nn.Tanh())
        >>> activation_bytes(model, lambda m, b: m(b).sum(), torch.randn(8, 10))  # x, tanh(.)
        960
    """
    call = "activation_bytes(model, loss_fn, micro_batch)"
    check_module(model, call)
    _check_loss_fn(loss_fn, call)
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()  # the saved view, not its whole storage
        seen[(t.data_ptr(), nbytes)] = nbytes
        return t

    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=cuda):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                try:
                    value = loss_fn(model, micro_batch)
                except Exception as error:  # the other convention, loss_fn(output, targets)?
                    if not hasattr(error, "add_note"):  # Python < 3.11
                        raise
                    error.add_note(
                        f"({call} calls loss_fn(model, micro_batch): the model, then a micro-batch "
                        "to run it on; a loss of (output, targets) goes inside, e.g. "
                        "loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1], reduction='sum'))"
                    )
                    raise
                loss = _check_loss(value, call)
            # into the model's parameters only: a criterion's or an outside head's would keep
            # every probe's gradient
            loss.backward(inputs=params)
    finally:
        for p, g in zip(params, before, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    return sum(b for (ptr, _), b in seen.items() if ptr not in param_ptrs)


def find_micro_batch_size(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    *,
    budget_bytes: int | None = None,
    max_size: int | None = None,
) -> int:
    """The largest micro-batch size (at most the batch's) whose micro-step fits.

    With ``budget_bytes`` (any device): the activation bytes of a micro-step (see
    :func:`activation_bytes`) must stay within the budget; they are measured at a small size,
    extrapolated linearly, then checked at the chosen size (and the size lowered until it
    fits). Without a budget on CUDA: sizes are tried from the largest down, halving on
    out-of-memory. The result is exact whatever the size: only memory and speed change.

    Args:
        model: the model.
        loss_fn: ``loss_fn(model, micro_batch) -> summed loss``.
        batch: a full batch (tensor, or tuple/list/dict of tensors, examples along dim 0).
        budget_bytes: the activation memory allowed per micro-step.
        max_size: an upper bound (default: the batch size).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.accumulate import activation_bytes, find_micro_batch_size
        >>> model = nn.Sequential(nn.Linear(100, 100), nn.Tanh(), nn.Linear(100, 1))
        >>> batch = torch.randn(64, 100)
        >>> loss_fn = lambda m, b: m(b).sum()
        >>> per_8 = activation_bytes(model, loss_fn, batch[:8])
        >>> find_micro_batch_size(model, loss_fn, batch, budget_bytes=2 * per_8)
        16
    """
    call = "find_micro_batch_size(model, loss_fn, batch)"
    check_module(model, call)
    _check_loss_fn(loss_fn, call)
    budget: float | None = None
    if budget_bytes is not None:
        budget = check_number(
            budget_bytes, call, "budget_bytes", low=0, low_open=True, example="2 * 1024**3"
        )
    if max_size is not None:
        max_size = check_optional_int(
            max_size, call, "max_size", fix="pass e.g. max_size=64, or None"
        )
    n = batch_size(batch, call)
    top = min(n, max_size) if max_size is not None else n
    if top < 1:
        raise ValueError(
            message(
                call, "batch", "at least one example", describe(batch), "pass a non-empty batch"
            )
        )
    if budget is None:
        device = next(iter(model.parameters()), torch.empty(0)).device
        if device.type != "cuda":
            raise ValueError(
                message(
                    call,
                    "budget_bytes",
                    f"a byte budget on a {device.type} device",
                    "None",
                    "pass budget_bytes= (out-of-memory probing is for CUDA only)",
                )
            )
        size = top
        while size >= 1:
            try:
                activation_bytes(model, loss_fn, slice_batch(batch, 0, size, n))
                return size
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                size //= 2
        raise GradkitError(f"{call}: even a micro-batch of 1 example runs out of memory")
    probe = min(top, 4)
    per_example = activation_bytes(model, loss_fn, slice_batch(batch, 0, probe, n)) / probe
    size = top if per_example <= 0 else max(1, min(top, int(budget // per_example)))
    while True:
        used = activation_bytes(model, loss_fn, slice_batch(batch, 0, size, n))
        if used <= budget:
            return _largest_fitting(model, loss_fn, batch, n, size, top, budget)
        if size == 1:
            raise ValueError(
                message(
                    call,
                    "budget_bytes",
                    f"at least {used} bytes (the activations of a micro-batch of 1 example)",
                    repr(budget_bytes),
                    "raise the budget, or make one example cheaper (shorter sequences, "
                    "activation checkpointing)",
                )
            )
        size = max(1, int(size * 0.9) if size > 10 else size - 1)


def _largest_fitting(
    model: nn.Module, loss_fn: Any, batch: Any, n: int, fits: int, top: int, budget: float
) -> int:
    """The largest size in ``[fits, top]`` whose activations fit ``budget``, ``fits`` known to
    fit: a binary search above it (the estimate from a small probe is low where part of the
    memory does not grow with the batch: 55 where 62 fit)."""
    lo, hi = fits + 1, top
    while lo <= hi:
        mid = (lo + hi) // 2
        if activation_bytes(model, loss_fn, slice_batch(batch, 0, mid, n)) <= budget:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    return fits


@dataclass
class AdaptiveBatchSize:
    """Sets the number of micro-batches per step from statistics of individual gradients.

    Rules (from ``stats`` of :func:`gradkit.per_example.track` over the last window, with
    ``"variance"`` tracked):

    * ``"cabs"`` (Balles et al. 2017): ``B = lr * tr(Sigma) / loss``;
    * ``"noise_scale"`` (McCandlish et al. 2018): ``B = tr(Sigma) / |G|^2``, both estimated
      without bias in each window (see :func:`gradkit.per_example.noise_scale`) and smoothed
      separately, as the paper does: a window's ratio is noisy where ``B`` is well above the
      window's size (its ``|G|^2`` is a small difference of large numbers, sometimes
      negative), the ratio of the smoothed parts is not. While the smoothed ``|G|^2`` is not
      positive (the windows are too small to resolve the signal from the noise), the number
      of micro-batches doubles at each update.

    The estimate is smoothed (exponential moving average), turned into a number of
    micro-batches ``ceil(B / micro_batch_size)`` and clipped to ``[min_micro, max_micro]``.
    Every update is logged in :attr:`history` (``estimate``: the window's own, ``smoothed``:
    the one used; either may be ``inf``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> model = nn.Linear(4, 1)
        >>> ctl = gradkit.accumulate.AdaptiveBatchSize(micro_batch_size=8, max_micro=16)
        >>> with gradkit.per_example.track(model, "variance") as stats:
        ...     model(torch.randn(8, 4)).pow(2).mean().backward()
        >>> 1 <= ctl.update(stats) <= 16
        True
    """

    micro_batch_size: int
    rule: str = "noise_scale"
    min_micro: int = 1
    max_micro: int = 64
    smoothing: float = 0.5
    lr: float | None = None
    num_micro: int = 1
    history: list[dict[str, float]] = field(default_factory=list)
    _ema: float | None = None
    _parts: tuple[float, float] | None = None  # the smoothed (tr(Sigma), |G|^2) of noise_scale

    def __post_init__(self) -> None:
        call = "AdaptiveBatchSize(...)"
        self.micro_batch_size = check_int(
            self.micro_batch_size, call, "micro_batch_size", low=1, example=8
        )
        check_choice(self.rule, ("noise_scale", "cabs"), call, "rule")
        self.min_micro = check_int(self.min_micro, call, "min_micro", low=1, example=1)
        self.max_micro = check_int(self.max_micro, call, "max_micro", low=1, example=64)
        self.num_micro = check_int(self.num_micro, call, "num_micro", low=1, example=1)
        if self.lr is None and self.rule == "cabs":
            raise ValueError(
                message(
                    call,
                    "lr",
                    "the (positive) learning rate for the CABS rule",
                    "None",
                    "pass lr=... (the optimizer's learning rate)",
                )
            )
        if self.lr is not None:
            self.lr = check_number(
                self.lr, call, "lr", low=0, low_open=True, fix="pass the optimizer's learning rate"
            )
        if not self.min_micro <= self.max_micro:
            raise ValueError(
                message(
                    call,
                    "min_micro / max_micro",
                    "1 <= min_micro <= max_micro",
                    f"{self.min_micro} / {self.max_micro}",
                    "fix the bounds",
                )
            )
        if (
            isinstance(self.smoothing, bool)
            or not isinstance(self.smoothing, numbers.Real)
            or not 0 <= self.smoothing < 1
        ):
            raise (ValueError if isinstance(self.smoothing, numbers.Real) else TypeError)(
                message(
                    call,
                    "smoothing",
                    "a number in [0, 1)",
                    repr(self.smoothing),
                    "pass e.g. smoothing=0.5",
                )
            )
        self.num_micro = min(max(self.num_micro, self.min_micro), self.max_micro)

    def update(self, stats: Mapping[str, Any], loss: float | torch.Tensor | None = None) -> int:
        """Read the window's statistics; return the number of micro-batches for the next.

        Args:
            stats: what :func:`gradkit.per_example.track` (with ``"variance"``) collected over
                the window: a non-empty mapping of parameter names to statistics.
            loss: the window's mean loss (a positive number; ``rule="cabs"`` only).

        A window whose statistics cannot move the estimate (every gradient 0, non-finite
        values; for CABS any non-finite estimate) leaves the smoothed estimate as it was; it is
        still logged in :attr:`history`.
        """
        from gradkit.per_example import ParamStats
        from gradkit.per_example._derived import _ratio, cabs_estimate, ema, noise_parts

        call = "AdaptiveBatchSize.update(stats, loss)"
        if (
            not isinstance(stats, Mapping)
            or not stats
            or not all(isinstance(v, ParamStats) for v in stats.values())
        ):
            raise TypeError(
                message(
                    call,
                    "stats",
                    "the non-empty statistics of gradkit.per_example.track(model, 'variance') "
                    "over the window",
                    describe(stats)
                    if not isinstance(stats, Mapping)
                    else f"{len(stats)} entries" + ("" if stats else " (nothing was tracked)"),
                    "pass the object `with track(...) as stats` gave, after the window's backward",
                )
            )
        if self.rule == "cabs":
            if loss is None:
                raise ValueError(
                    message(
                        call,
                        "loss",
                        "the window's loss (rule='cabs')",
                        "None",
                        "pass loss=...",
                    )
                )
            if (
                isinstance(loss, bool)
                or not isinstance(loss, (numbers.Real, torch.Tensor))
                or (isinstance(loss, torch.Tensor) and loss.numel() != 1)
            ):
                raise TypeError(
                    message(
                        call,
                        "loss",
                        "the window's loss as a number or a one-element tensor",
                        describe(loss),
                        "pass loss=float(mean_loss)",
                    )
                )
            assert self.lr is not None
            estimate = cabs_estimate(stats, self.lr, loss, None, call)
            if math.isfinite(estimate):
                self._ema = ema(self._ema, estimate, self.smoothing)
        else:
            trace, g2 = noise_parts(stats, None, call)
            estimate = _ratio(trace, g2)
            if math.isfinite(trace) and math.isfinite(g2) and (trace or g2):
                old = self._parts or (None, None)
                self._parts = (
                    ema(old[0], trace, self.smoothing),
                    ema(old[1], g2, self.smoothing),
                )
                self._ema = _ratio(*self._parts)
        target = self._ema if self._ema is not None else float(self.micro_batch_size)
        if math.isfinite(target):
            wanted = math.ceil(max(target, 1.0) / self.micro_batch_size)
        else:  # noise without a resolved signal: a window too small to measure it
            wanted = 2 * self.num_micro
        self.num_micro = min(max(wanted, self.min_micro), self.max_micro)
        self.history.append(
            {
                "step": float(len(self.history) + 1),
                "estimate": estimate,
                "smoothed": target,
                "num_micro": float(self.num_micro),
                "batch_size": float(self.num_micro * self.micro_batch_size),
            }
        )
        return self.num_micro

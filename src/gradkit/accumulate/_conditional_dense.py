"""Dense :class:`ConditionalAccumulator`: TensorFlow's ``tf.ConditionalAccumulator`` on
PyTorch tensors, thread-safe, with the traps fixed (no default ``local_step``, drops counted)."""

from __future__ import annotations

from typing import Any

import torch

from gradkit._errors import message
from gradkit._validate import check_choice
from gradkit.accumulate._conditional_base import AccumulatorCore
from gradkit.accumulate._conditional_checks import (
    MISSING,
    accumulation_dtype,
    as_tensor,
    check_device,
    check_dtype,
    check_grad_dtype,
    check_local_step,
    check_num_required,
    check_shape,
    check_timeout,
    fmt_shape,
)

__all__ = ["ConditionalAccumulator", "Configured", "compatible"]


def compatible(shape: tuple[int, ...], partial: tuple[int | None, ...] | None) -> bool:
    """Same rank and every known dim equal (``None`` = unknown rank or dim)."""
    if partial is None:
        return True
    return len(shape) == len(partial) and all(
        p is None or p == s for s, p in zip(shape, partial, strict=True)
    )


class Configured(AccumulatorCore):
    """Shape, dtype, device and reduction of an accumulator, its repr and its config checks."""

    _REDUCTIONS: tuple[str, ...] = ("mean", "sum")

    def __init__(
        self,
        shape: Any = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        call = f"{self._NAME}(shape, dtype, device, reduction)"
        self._shape = check_shape(shape, call)
        self._dtype = check_dtype(dtype, call)
        self._acc_dtype = accumulation_dtype(self._dtype)
        self._device = check_device(device, call)
        self._reduction = check_choice(reduction, self._REDUCTIONS, call, "reduction")

    # ---- configuration
    @property
    def shape(self) -> tuple[int | None, ...] | None:
        """The partial shape given to the constructor (``None``: unknown rank)."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the results."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Where the aggregate lives."""
        return self._device

    @property
    def reduction(self) -> str:
        """How ``take_grad`` reduces the accumulated gradients."""
        return self._reduction

    def __repr__(self) -> str:
        return (
            f"{self._NAME}(shape={fmt_shape(self._shape)}, dtype={self._dtype}, "
            f"reduction={self._reduction!r}, num_accumulated={self._counter}, "
            f"global_step={self._global_step}, num_dropped={self._num_dropped})"
        )

    def _config(self) -> dict[str, Any]:
        return {
            "kind": self._NAME,
            "shape": None if self._shape is None else list(self._shape),
            "dtype": str(self._dtype).removeprefix("torch."),
            "reduction": self._reduction,
        }

    def _check_config(self, state: Any, call: str) -> None:
        if not isinstance(state, dict):
            raise TypeError(message(call, "state", "a dict", state, "pass a state_dict()"))
        for key, want in self._config().items():
            if state.get(key) != want:
                raise ValueError(
                    message(
                        call,
                        f"state[{key!r}]",
                        repr(want),
                        repr(state.get(key)),
                        "load a state saved from an accumulator with the same configuration",
                    )
                )


class ConditionalAccumulator(Configured):
    r"""Accumulate gradients from many producers; hand out their mean once enough arrived.

    A gradient applied with ``local_step`` is accepted if ``local_step >= global_step`` (else
    dropped and counted in ``num_dropped``). ``take_grad(num_required)`` waits (FIFO) until
    ``c = num_accumulated >= num_required``, then returns

    .. math:: \text{mean} = \frac1c \sum_{i=1}^{c} g_i \quad (\text{or the sum}),

    over *all* ``c`` gradients accepted since the last take (``c`` may exceed
    ``num_required``), resets the counter and advances ``global_step`` by 1.

    Args:
        shape: partial shape of the gradients: ``None`` (any; the first accepted gradient
            fixes the shape until the next take) or a sequence of ints and ``None``
            (unknown dims). A gradient must match it, and while ``num_accumulated > 0`` it
            must match the accumulated ones exactly.
        dtype: floating or complex dtype of the results. Gradients must have this dtype or
            one that converts to it without loss (``float16`` into ``float32``); narrowing
            (``float64`` into ``float32``), integer and bool gradients raise ``TypeError``.
            Half precision is summed in float32.
        device: where the aggregate lives; gradients are copied there.
        reduction: ``"mean"`` (TensorFlow's ``MEAN``) or ``"sum"``.

    ``num_accumulated``, ``global_step`` and ``num_dropped`` are read-only properties (not
    methods, unlike TensorFlow's ``num_accumulated()``). All methods are thread-safe: one lock
    guards the state; ``apply_grad`` never blocks on a take.

    Examples:
        >>> import torch
        >>> from gradkit.accumulate import ConditionalAccumulator
        >>> acc = ConditionalAccumulator(shape=(2,))
        >>> acc.apply_grad(torch.tensor([1.0, 10.0]), local_step=0)
        True
        >>> acc.apply_grad(torch.tensor([3.0, 30.0]), local_step=0)
        True
        >>> acc.take_grad(1)  # the mean of both, though 1 was required
        tensor([ 2., 20.])
        >>> acc.global_step, acc.num_accumulated
        (1, 0)
        >>> acc.apply_grad(torch.tensor([5.0, 50.0]), local_step=0)  # stale: dropped
        False
        >>> acc.num_dropped
        1

    Warning:
        TensorFlow's ``local_step`` defaults to 0, so after the first take (global step 1)
        every gradient applied without a step is silently dropped; here ``local_step`` is
        required. A stale gradient is dropped *before* it is validated (TensorFlow's order),
        so a stale gradient of the wrong shape or dtype raises nothing.
    """

    _NAME = "ConditionalAccumulator"
    _sum: torch.Tensor | None = None  # the window's sum (None: empty)

    # ---- apply / take
    def apply_grad(self, grad: torch.Tensor, local_step: Any = MISSING) -> bool:
        """Add ``grad`` unless it is stale (``local_step < global_step``).

        Args:
            grad: dense tensor; copied, so later changes to it do not reach the aggregate.
            local_step: required; the number of takes that had happened when ``grad`` was
                computed (usually the ``global_step`` the producer last read).

        Returns:
            ``True`` if accepted, ``False`` if dropped as stale (counted in ``num_dropped``).

        Raises:
            TypeError: ``local_step`` missing or not an int, ``grad`` not a dense tensor, or a
                dtype that does not convert losslessly (non-stale gradients only).
            ValueError: shape mismatch (non-stale gradients only); nothing is added.
            AccumulatorClosed: after :meth:`close`.
        """
        step = check_local_step(local_step, f"{self._NAME}.apply_grad(grad, local_step)")
        call = f"{self._NAME}.apply_grad(grad, local_step={step})"
        g = as_tensor(grad, call, "grad")
        if g.layout != torch.strided:
            raise TypeError(
                message(
                    call,
                    "grad",
                    "a dense (strided) tensor",
                    f"a tensor with layout {g.layout}",
                    "use SparseConditionalAccumulator for sparse gradients, or grad.to_dense()",
                )
            )
        return self._accept(call, step, lambda: self._add_locked(g.detach(), call))

    def _add_locked(self, g: torch.Tensor, call: str) -> None:
        shape = tuple(g.shape)
        if not compatible(shape, self._shape):
            raise ValueError(
                message(
                    call,
                    "grad",
                    f"shape {fmt_shape(self._shape)} (the accumulator's shape)",
                    f"shape {fmt_shape(shape)}",
                    "shape mismatch: pass a gradient of the accumulator's shape; nothing was added",
                )
            )
        if self._sum is not None and shape != tuple(self._sum.shape):
            raise ValueError(
                message(
                    call,
                    "grad",
                    f"shape {fmt_shape(tuple(self._sum.shape))} (the shape of the "
                    f"{self._counter} gradient(s) accumulated since the last take)",
                    f"shape {fmt_shape(shape)}",
                    "shape mismatch: the first gradient after a take fixes the shape until the "
                    "next take; nothing was added",
                )
            )
        check_grad_dtype(g.dtype, self._dtype, call, "grad")
        if self._sum is None:
            self._sum = torch.empty(shape, dtype=self._acc_dtype, device=self._device).copy_(g)
        else:
            self._sum.add_(g.to(self._device))

    def _pop_locked(self) -> tuple[torch.Tensor | None, int]:
        total, self._sum = self._sum, None
        return total, self._counter

    def take_grad(self, num_required: Any, *, timeout: Any = None) -> torch.Tensor:
        """Wait until ``num_accumulated >= num_required``, then return the reduction of *all*
        accumulated gradients (a fresh tensor of ``dtype``), reset the counter and advance
        ``global_step`` by 1.

        Takes are served in arrival order: a take waits behind earlier ones even if its own
        ``num_required`` is met.

        Args:
            num_required: int >= 1, else ``ValueError`` (nothing consumed).
            timeout: seconds to wait (``None``: forever).

        Raises:
            TakeTimeout: nothing was consumed; the message says how many gradients arrived.
            TakeCancelled: :meth:`cancel_pending` was called while waiting.
            AccumulatorClosed: :meth:`close` was called before or while waiting.
        """
        call = f"{self._NAME}.take_grad(num_required={num_required!r})"
        n = check_num_required(num_required, call)
        t = check_timeout(timeout, call)
        total, count = self._take(call, n, t)
        assert total is not None  # a served take has count >= num_required >= 1
        if self._reduction == "mean":
            total.div_(count)
        return total.to(self._dtype)

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Configuration, aggregate (or ``None``), counter, global step and dropped count, as
        plain values and tensors (``torch.load(..., weights_only=True)`` reads them).
        Waiting takes are not part of the state."""
        with self._cond:
            return {
                **self._config(),
                **self._core_state(),
                "aggregate": None if self._sum is None else self._sum.clone(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the configuration must be the same). Waiting takes that
        the restored counter satisfies are served."""
        call = f"{self._NAME}.load_state_dict(state)"
        self._check_config(state, call)
        aggregate = state.get("aggregate")
        counter = state.get("counter")
        if (aggregate is None) != (counter == 0) or (
            aggregate is not None
            and (
                not isinstance(aggregate, torch.Tensor)
                or not compatible(tuple(aggregate.shape), self._shape)
            )
        ):
            raise ValueError(
                message(
                    call,
                    "state['aggregate']",
                    f"None when the counter is 0, else a tensor of shape {fmt_shape(self._shape)}",
                    aggregate if aggregate is not None else "None",
                    f"pass the state_dict() of a {self._NAME}",
                )
            )
        with self._cond:
            self._load_core_state(state, call)
            self._sum = (
                None if aggregate is None else aggregate.to(self._device, self._acc_dtype).clone()
            )
            self._flush_locked()


ConditionalAccumulator.__module__ = "gradkit.accumulate"

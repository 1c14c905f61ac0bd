"""The state machine shared by the conditional accumulators: one lock, one counter, one global
step, a FIFO queue of waiting takes (TensorFlow's ``conditional_accumulator_base.cc``).

Life of a gradient: ``apply`` takes the lock, drops the gradient if it is stale
(``local_step < global_step``, counted in ``num_dropped``), validates it, adds it into the
running aggregate, increments the counter and serves the head of the take queue if it is
satisfied. A served take advances the global step by 1, resets the counter and hands the whole
aggregate to the waiting thread, which finishes the reduction outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from gradkit._errors import GradkitError, message
from gradkit.accumulate._conditional_checks import as_int

__all__ = ["AccumulatorClosed", "TakeCancelled", "TakeTimeout"]

logger = logging.getLogger(__name__)

_PUBLIC = "gradkit.accumulate"


class TakeCancelled(GradkitError, RuntimeError):
    """A waiting ``take_grad`` was cancelled (``cancel_pending()`` or ``close()``) before it
    was served. A cancelled take never consumes gradients (TensorFlow: ``CancelledError``
    "TakeGrad operation was cancelled")."""


class AccumulatorClosed(TakeCancelled):
    """The accumulator was closed: waiting and later ``take_grad`` calls, and later
    ``apply_grad`` calls, raise this (like ``queue.Queue.shutdown``)."""


class TakeTimeout(GradkitError, TimeoutError):
    """``take_grad`` waited ``timeout`` seconds without ``num_required`` gradients arriving.

    Attributes: ``num_required``, ``num_accumulated`` (what had arrived), ``timeout``.
    The waiting take left the queue without consuming anything.
    """

    def __init__(
        self, text: str, *, num_required: int = 0, num_accumulated: int = 0, timeout: float = 0.0
    ) -> None:
        super().__init__(text)
        self.num_required = num_required
        self.num_accumulated = num_accumulated
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args, self.__dict__)


for _cls in (TakeCancelled, AccumulatorClosed, TakeTimeout):
    _cls.__module__ = _PUBLIC


# ------------------------------------------------------------------------------ state machine
class _Attempt:
    """One waiting take: served (``payload``) or failed (``error``)."""

    __slots__ = ("done", "error", "num_required", "payload")

    def __init__(self, num_required: int) -> None:
        self.num_required = num_required
        self.done = False
        self.payload: Any = None
        self.error: BaseException | None = None


class AccumulatorCore:
    """Counter, global step, dropped count, closed flag and the FIFO of waiting takes, under
    one lock. Subclasses implement ``_pop_locked`` (hand over and reset the aggregate)."""

    _NAME = "ConditionalAccumulator"

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Attempt] = deque()
        self._counter = 0
        self._global_step = 0
        self._num_dropped = 0
        self._closed = False

    # ---- read-only state
    @property
    def num_accumulated(self) -> int:
        """Gradients accepted since the last take (TensorFlow's ``num_accumulated()``)."""
        with self._cond:
            return self._counter

    @property
    def global_step(self) -> int:
        """Takes served so far (plus ``set_global_step``); gradients with
        ``local_step < global_step`` are stale."""
        with self._cond:
            return self._global_step

    @property
    def num_dropped(self) -> int:
        """Stale gradients dropped so far (TensorFlow drops them without a trace)."""
        with self._cond:
            return self._num_dropped

    @property
    def num_waiting(self) -> int:
        """Takes currently waiting in the FIFO queue."""
        with self._cond:
            return len(self._queue)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        with self._cond:
            return self._closed

    # ---- control
    def set_global_step(self, step: Any) -> None:
        """Set the global step; from then on gradients with ``local_step < step`` are dropped.

        Lowering it warns (as TensorFlow logs) and still sets it. The aggregate and counter
        are kept.
        """
        call = f"{self._NAME}.set_global_step(step)"
        new = as_int(step, call, "step", "an int")
        with self._cond:
            old = self._global_step
            self._global_step = new
        if new < old:
            warnings.warn(
                f"{call}: lowering the global step from {old} to {new}; gradients with "
                f"local_step >= {new} are accepted again",
                UserWarning,
                stacklevel=2,
            )

    def cancel_pending(self) -> int:
        """Cancel every waiting take (each raises :class:`TakeCancelled`); nothing is consumed
        and the accumulator stays usable. Returns how many takes were cancelled."""
        return self._fail_pending(TakeCancelled, "cancelled by cancel_pending()")

    def close(self) -> None:
        """Cancel waiting takes and refuse later takes and applies with
        :class:`AccumulatorClosed`. Reading the state (``state_dict``) still works."""
        with self._cond:
            self._closed = True
        self._fail_pending(AccumulatorClosed, "the accumulator was closed")

    def _fail_pending(self, kind: type[TakeCancelled], why: str) -> int:
        with self._cond:
            n = len(self._queue)
            for attempt in self._queue:
                attempt.error = kind(
                    f"{self._NAME}.take_grad(num_required={attempt.num_required}): {why} "
                    f"while waiting ({self._counter} gradients accumulated); nothing was "
                    "consumed"
                )
                attempt.done = True
            self._queue.clear()
            self._cond.notify_all()
        return n

    def _raise_closed(self, call: str) -> None:
        raise AccumulatorClosed(
            f"{call}: the accumulator was closed; create a new one (load_state_dict(state) "
            "restores a saved state)"
        )

    # ---- apply and take
    def _accept(self, call: str, local_step: int, add: Callable[[], None]) -> bool:
        """Staleness test first (TensorFlow's order), then ``add`` (validates, then adds)."""
        with self._cond:
            if self._closed:
                self._raise_closed(call)
            if local_step < self._global_step:
                self._num_dropped += 1
                logger.debug(
                    "%s: dropped a stale gradient (local_step %d < global_step %d)",
                    call,
                    local_step,
                    self._global_step,
                )
                return False
            add()
            self._counter += 1
            self._flush_locked()
        return True

    def _take(self, call: str, num_required: int, timeout: float | None) -> Any:
        """Queue a take, wait until it is served (FIFO), return the popped aggregate."""
        attempt = _Attempt(num_required)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._closed:
                self._raise_closed(call)
            self._queue.append(attempt)
            self._flush_locked()
            while not attempt.done:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    ahead = self._queue.index(attempt)
                    self._queue.remove(attempt)
                    self._flush_locked()
                    raise TakeTimeout(
                        f"{call}: timed out after {timeout:g} s waiting for {num_required} "
                        f"gradient(s); {self._counter} accumulated"
                        + (f", {ahead} earlier take(s) still waiting ahead (FIFO)" if ahead else "")
                        + "; nothing was consumed; apply more gradients, lower num_required or "
                        "raise the timeout",
                        num_required=num_required,
                        num_accumulated=self._counter,
                        timeout=float(timeout or 0.0),
                    )
                self._cond.wait(remaining)
        if attempt.error is not None:
            raise attempt.error
        return attempt.payload

    def _flush_locked(self) -> None:
        """Serve the head of the queue while it is satisfied (TensorFlow's ``TryAttemptLocked``
        looks at the head only: a later, smaller take waits behind it)."""
        served = False
        while self._queue and self._counter >= self._queue[0].num_required:
            attempt = self._queue.popleft()
            attempt.payload = self._pop_locked()
            attempt.done = True
            self._global_step += 1
            self._counter = 0
            served = True
        if served:
            self._cond.notify_all()

    def _pop_locked(self) -> Any:
        raise NotImplementedError

    # ---- checkpoints
    def _core_state(self) -> dict[str, Any]:
        return {
            "counter": self._counter,
            "global_step": self._global_step,
            "num_dropped": self._num_dropped,
        }

    def _load_core_state(self, state: dict[str, Any], call: str) -> None:
        for key in ("counter", "global_step", "num_dropped"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    message(call, f"state[{key!r}]", "an int", repr(value), "pass a state_dict()")
                )
        self._counter = state["counter"]
        self._global_step = state["global_step"]
        self._num_dropped = state["num_dropped"]

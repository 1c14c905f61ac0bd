"""Helpers for the conditional-accumulator tests: background threads whose joins time out, so
a hang fails the test quickly instead of stalling the suite."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

JOIN = 5.0  # seconds any background call may take before the test fails


class Background:
    """Run ``fn(*args, **kwargs)`` in a daemon thread; ``result()`` joins with a timeout."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        try:
            self.value = fn(*args, **kwargs)
        except BaseException as err:
            self.error = err

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float = JOIN) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"background call still running after {timeout} s (a hang?)")

    def result(self, timeout: float = JOIN) -> Any:
        self.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self, timeout: float = JOIN) -> BaseException | None:
        self.join(timeout)
        return self.error


def wait_until(predicate: Callable[[], bool], timeout: float = JOIN, what: str = "") -> None:
    """Poll ``predicate`` every millisecond; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s: {what}")
        time.sleep(0.001)

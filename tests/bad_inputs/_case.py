"""One row of the bad-input table: a misuse and what gradkit must answer.

A row either names the exception a call must raise and the words its message must contain
(``raises``/``words``), or, with ``raises=None``, runs a call whose ``run`` itself checks the
result against an oracle (and raises ``AssertionError`` when it differs). ``unchanged`` names
state that a failing call must leave as it was: a callable returning tensors (weights,
optimizer state, accumulated gradients) read before and after the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    """A misuse of one public entry point.

    Attributes:
        id: short unique name, ``package.call.what`` (the pytest id).
        run: the call; with ``raises=None`` it checks its own result against an oracle.
        raises: the exception type the call must raise, or ``None`` when it must succeed.
        words: fragments (case-insensitive) the message must contain: the argument or module
            it names, what was wrong, what to do. ``{device}`` in a fragment stands for the
            device the test runs on (``cpu``, ``cuda:0``).
        unchanged: for a failing call, returns the tensors that must be bit-for-bit the same
            after the call as before it.
    """

    id: str
    run: Callable[[], object]
    raises: type[BaseException] | None = None
    words: Sequence[str] = ()
    unchanged: Callable[[], Sequence[torch.Tensor]] | None = None


class Built(NamedTuple):
    """A model and an operator built from it (by a cached builder a row calls at test time)."""

    model: nn.Module
    op: Any

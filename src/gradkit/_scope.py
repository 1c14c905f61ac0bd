"""The torch state a command or a benchmark runs in: a thread count, restored afterwards with
torch's global random state (``gradkit demo``, ``gradkit hyperclean``, ``gradkit bench``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torch_scope"]


@contextmanager
def torch_scope(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (``None``: as it is); the thread
    count and the global RNG are restored afterwards, also when the block raises.

    Examples:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with torch_scope(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise ValueError(f"torch_scope(threads): expected None or an int >= 1, got {threads!r}")
    before = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

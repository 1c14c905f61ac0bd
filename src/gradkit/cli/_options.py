"""Checks of ``gradkit``'s options that argparse does not make by itself: counts with an
upper bound, seeds, and output folders (tried before anything runs)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

__all__ = ["MAX_EPOCHS", "MAX_STEPS", "MAX_THREADS", "bench_out", "count", "out_problem", "seed"]

#: Upper bounds of the counting options: generous, but they keep a typo (an extra zero or
#: three) from starting a run of days or one that fills the memory.
MAX_EPOCHS, MAX_STEPS, MAX_THREADS = 1000, 100_000, 1024


def count(high: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[1, high]``.

    Examples:
        >>> count(10)("3")
        3
        >>> count(10)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected a whole number from 1 to 10, got '0'
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from 1 to {high:,}, got {text!r}"
            )
        return value

    return parse


def seed(text: str) -> int:
    """An argparse ``type`` for a seed in ``[0, 2**32)`` (what numpy and torch accept).

    Examples:
        >>> seed("7")
        7
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer seed from 0 to 2**32 - 1, got {text!r}"
        ) from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(
            f"expected an integer seed from 0 to 2**32 - 1, got {text!r}"
        )
    return value


def out_problem(out: str, what: str = "run folders") -> str | None:
    """Why ``out`` cannot hold ``what`` (None if it can, or can be created).

    The nearest existing folder on the way to ``out`` must take a new folder: that is tried
    (a temporary folder, removed at once), since permission bits do not tell for root, for
    read-only file systems or for ``/proc``.

    Examples:
        >>> out_problem("")
        "expected a folder path, got ''; pass a folder you can write to, e.g. --out runs"
    """
    fix = "pass a folder you can write to"
    if not out.strip() or "\x00" in out:
        return f"expected a folder path, got {out!r}; {fix}, e.g. --out runs"
    path = Path(out)
    try:
        existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    except OSError as err:  # e.g. a name too long for the file system
        return f"expected a usable folder path, got {out!r} ({err.strerror or err}); {fix}"
    if not existing.is_dir():
        return (
            f"expected a folder, but {str(existing)!r} is a file; pass another folder or "
            "remove the file"
        )
    try:
        Path(tempfile.mkdtemp(prefix=".gradkit-", dir=existing)).rmdir()
    except OSError as err:
        return (
            f"expected a folder that can hold {what}, got {out!r} (no new folder can be made "
            f"in {str(existing)!r}: {err.strerror or err}); {fix}"
        )
    return None


def bench_out(rest: Sequence[str]) -> str | None:
    """The ``--out`` given to the benchmark runner, if any (its other options are its own)."""
    peek = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    peek.add_argument("--out")
    try:
        known, _ = peek.parse_known_args(list(rest))
    except argparse.ArgumentError:
        return None  # e.g. --out without a value: the runner's parser says so
    return cast(str | None, known.out)

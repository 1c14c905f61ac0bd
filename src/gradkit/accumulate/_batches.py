"""Batches as the loader gives them (a tensor, or a tuple/list/dict of tensors with the
examples along dimension 0, or along ``batch_dim`` for a sequence-first batch): counting their
examples and splitting them into micro-batches.

Index legend: ``n`` examples of the batch, ``k`` micro-batches, ``*`` per-example dims.
Every tensor of a batch is ``[n, *]`` (``[T, n, *]`` with ``batch_dim=1``) with the same
``n``. A list of ``n`` plain values (strings, numbers, ``None``: no tensor or container among
them) holds one value per example, as ``default_collate`` makes a string field, and is split
with the tensors. Other leaves are shared by every micro-batch (a tuple of plain values is,
whatever its length). Arrays that are not tensors (NumPy's) are refused: shared, their
examples would reach every micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from gradkit._errors import describe, message
from gradkit._validate import check_int

__all__ = ["batch_size", "slice_batch", "split_batch"]

_SPLIT = "split_batch(batch, ...)"
_EXPECTED = "a tensor, or a tuple, list or dict of tensors with the examples along dimension 0"


def _all_leaves(batch: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``batch`` (tensors, and anything not a tuple, list or dict) with its
    path."""
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _all_leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            yield from _all_leaves(value, f"{path}[{i}]")
    else:
        yield path, batch


def _leaves(batch: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    return ((p, t) for p, t in _all_leaves(batch, path) if isinstance(t, torch.Tensor))


def _arrays(batch: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The leaves of ``batch`` that are arrays but not tensors (NumPy arrays and the like, with
    at least one dimension): slicing does not reach them."""
    for p, leaf in _all_leaves(batch, path):
        array = hasattr(leaf, "__array__") and getattr(leaf, "ndim", 0) >= 1
        if array and not isinstance(leaf, torch.Tensor):
            yield p, leaf


def batch_size(batch: Any, call: str = _SPLIT, batch_dim: int = 0) -> int:
    """The number of examples ``n`` of ``batch``: dimension ``batch_dim`` of its tensors, which
    must agree.

    Examples:
        >>> import torch
        >>> batch_size({"x": torch.zeros(5, 3), "y": torch.zeros(5)})
        5
        >>> batch_size((torch.zeros(5, 3), torch.zeros(4)))
        Traceback (most recent call last):
        ...
        ValueError: split_batch(batch, ...): batch: expected tensors with the same number of ...
    """
    for path, array in _arrays(batch, "batch"):
        raise TypeError(
            message(
                call,
                path,
                "tensors (split by example) or leaves shared by every micro-batch (strings, "
                "numbers, None)",
                f"a {type(array).__name__} of shape {tuple(array.shape)}, which every "
                "micro-batch would get whole",
                "convert it with torch.as_tensor so that each micro-batch gets its own examples",
            )
        )
    leaves = list(_leaves(batch, "batch"))
    if not leaves:
        raise TypeError(
            message(
                call, "batch", _EXPECTED, describe(batch), "pass the batch as the loader gives it"
            )
        )
    for path, t in leaves:
        if t.dim() <= batch_dim:
            fix = (
                "give every tensor of the batch a leading examples dimension (t[None] for one "
                "example)"
                if batch_dim == 0
                else "split a batch whose tensors hold the examples along different dimensions "
                "by hand, giving each micro-step its count (acc.micro_step(count=...))"
            )
            raise ValueError(
                message(
                    call,
                    path,
                    f"a tensor with the examples along dimension {batch_dim} (batch_dim)",
                    f"a {t.dim()}-dimensional tensor of shape {tuple(t.shape)}",
                    fix,
                )
            )
    sizes = {path: int(t.shape[batch_dim]) for path, t in leaves}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{p}: {n}" for p, n in sizes.items())
        raise ValueError(
            message(
                call,
                "batch",
                f"tensors with the same number of examples (dimension {batch_dim})",
                listed,
                "pass inputs and targets of the same length; slicing them together would pair "
                "examples with the wrong targets and leave some micro-batches empty (a "
                "sequence-first batch, [T, N, ...], holds them along dimension 1: pass "
                "batch_dim=1)",
            )
        )
    return next(iter(sizes.values()))


def _per_example(value: Any, n: int) -> bool:
    """Whether ``value`` is a list of ``n`` plain values (one per example: see the module
    docstring)."""
    return (
        isinstance(value, list)
        and len(value) == n
        and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in value)
    )


def slice_batch(batch: Any, start: int, stop: int, n: int | None = None, batch_dim: int = 0) -> Any:
    """Examples ``start:stop`` of every tensor of ``batch`` (along ``batch_dim``) and of its
    lists of ``n`` plain values (other leaves shared); ``n``: the batch's examples
    (:func:`batch_size` if None)."""
    if n is None:
        n = batch_size(batch, batch_dim=batch_dim)
    if isinstance(batch, torch.Tensor):
        return batch.narrow(batch_dim, start, stop - start)
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop, n, batch_dim) for k, v in batch.items()}
    if _per_example(batch, n):
        return batch[start:stop]
    if isinstance(batch, (tuple, list)):
        parts = [slice_batch(v, start, stop, n, batch_dim) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple: by field
            return type(batch)(*parts)
        return type(batch)(parts)
    return batch  # non-tensor leaves are shared by every micro-batch


def split_batch(
    batch: Any,
    *,
    micro_batch_size: int | None = None,
    num_micro_batches: int | None = None,
    batch_dim: int = 0,
) -> list[Any]:
    """Split a batch into micro-batches: of ``micro_batch_size`` examples (the last may be
    shorter), or ``num_micro_batches`` parts whose sizes differ by at most one.

    Every tensor of the batch must have the same number of examples ``n`` (dimension 0). A
    list of ``n`` plain values (strings, numbers, ``None``), as ``default_collate`` makes a
    string field, is split with them; other non-tensor leaves are shared by every micro-batch.
    No micro-batch is empty: ``num_micro_batches > n`` gives ``n`` micro-batches of one
    example, and an empty batch gives ``[]``.

    Args:
        batch: a tensor ``[n, *]``, or a tuple/list/dict of them (nested is fine).
        micro_batch_size: examples per micro-batch (a positive int), or
        num_micro_batches: the number of micro-batches (a positive int).
        batch_dim: the dimension of every tensor that holds the examples: 1 for a
            sequence-first batch (``[T, N, ...]``, as ``nn.LSTM`` and ``nn.Transformer`` take
            by default), which split along dimension 0 would give micro-batches of time steps.

    Returns:
        the micro-batches, each of the batch's structure.

    Examples:
        >>> import torch
        >>> [m.shape[0] for m in split_batch(torch.zeros(10, 3), micro_batch_size=4)]
        [4, 4, 2]
        >>> [m.shape[0] for m in split_batch(torch.zeros(10, 3), num_micro_batches=4)]
        [3, 3, 2, 2]
        >>> [m[1].shape[0] for m in split_batch((torch.zeros(5), torch.ones(5)),
        ...                                     num_micro_batches=2)]
        [3, 2]
        >>> [m["text"] for m in split_batch({"x": torch.zeros(3, 2), "text": ["a", "b", "c"]},
        ...                                 micro_batch_size=2)]
        [['a', 'b'], ['c']]
        >>> [m.shape for m in split_batch(torch.zeros(7, 5, 3), micro_batch_size=2, batch_dim=1)]
        [torch.Size([7, 2, 3]), torch.Size([7, 2, 3]), torch.Size([7, 1, 3])]
    """
    dim = check_int(batch_dim, _SPLIT, "batch_dim", low=0, example=1)
    if (micro_batch_size is None) == (num_micro_batches is None):
        raise ValueError(
            message(
                _SPLIT,
                "micro_batch_size / num_micro_batches",
                "exactly one of them",
                f"{micro_batch_size!r} / {num_micro_batches!r}",
                "pass e.g. micro_batch_size=8",
            )
        )
    if micro_batch_size is not None:
        size = check_int(micro_batch_size, _SPLIT, "micro_batch_size", low=1, example=8)
        n = batch_size(batch, batch_dim=dim)
        return [slice_batch(batch, s, min(s + size, n), n, dim) for s in range(0, n, size)]
    parts = check_int(num_micro_batches, _SPLIT, "num_micro_batches", low=1, example=4)
    n = batch_size(batch, batch_dim=dim)
    k = min(parts, n)
    out, start = [], 0
    for i in range(k):
        stop = start + n // k + (1 if i < n % k else 0)
        out.append(slice_batch(batch, start, stop, n, dim))
        start = stop
    return out

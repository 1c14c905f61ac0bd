"""Row-sparse gradient helpers for :class:`SparseConditionalAccumulator`: validation in
TensorFlow's order and wording, coalescing, merging, and rows of a sparse COO tensor.

Index legend: ``n`` rows of one gradient, ``m`` rows of the aggregate, ``*`` the row shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from gradkit._errors import message
from gradkit.accumulate._conditional_checks import Shape, check_grad_dtype, fmt_shape

__all__ = ["check_slices", "coalesce", "merge", "normalize_dense_shape", "rows_of_coo"]


def normalize_dense_shape(value: Any, call: str) -> tuple[int, ...] | None:
    """``dense_shape`` as a tuple of ints >= 0: a sequence, ``torch.Size`` or a 1-D integer
    tensor (int32 is fine); ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise TypeError(
                message(
                    call,
                    "dense_shape",
                    "a 1-D integer tensor or a sequence of ints",
                    value,
                    "pass e.g. dense_shape=(num_rows, *values.shape[1:])",
                )
            )
        value = value.tolist()
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in value)
        or any(d < 0 for d in value)
    ):
        raise TypeError(
            message(
                call,
                "dense_shape",
                "a sequence of ints >= 0",
                repr(value),
                "pass e.g. dense_shape=(num_rows, *values.shape[1:])",
            )
        )
    return tuple(int(d) for d in value)


def check_slices(
    indices: torch.Tensor,
    values: torch.Tensor,
    dense_shape: tuple[int, ...] | None,
    shape: Shape | None,
    current: tuple[int, ...] | None,
    dtype: torch.dtype,
    call: str,
) -> None:
    """Validate one gradient against the accumulator's partial ``shape`` (leading dims) and,
    while the window is not empty, against the ``current`` aggregate's values shape."""
    fix = "nothing was added"
    if indices.dim() != 1:
        raise ValueError(
            message(
                call,
                "indices",
                "a vector (1-D) of row indices",
                f"shape {fmt_shape(tuple(indices.shape))}",
                f"indices should be vector; wrap a single index as torch.tensor([i]); {fix}",
            )
        )
    if indices.dtype not in (torch.int32, torch.int64):  # uint8 would read as a mask elsewhere
        raise TypeError(
            message(call, "indices", "an int32 or int64 tensor", indices, f"cast it; {fix}")
        )
    if values.dim() == 0:
        raise ValueError(
            message(
                call,
                "values",
                "rank >= 1: [len(indices), *row_shape]",
                "a 0-dimensional tensor",
                f"values cannot be 0-dimensional; pass one row per index, e.g. indices "
                f"torch.tensor([0]) and values torch.tensor([1.0]); {fix}",
            )
        )
    n = indices.shape[0]
    if values.shape[0] != n:
        raise ValueError(
            message(
                call,
                "values",
                f"{n} rows (one per index)",
                f"{values.shape[0]} rows (shape {fmt_shape(tuple(values.shape))})",
                f"pass as many rows of values as indices; {fix}",
            )
        )
    rank = 0 if shape is None else len(shape)
    if dense_shape is not None:
        if len(dense_shape) < rank:
            raise ValueError(
                message(
                    call,
                    "dense_shape",
                    f"rank at least {rank} (the accumulator's shape is {fmt_shape(shape)})",
                    f"rank {len(dense_shape)}: {fmt_shape(dense_shape)}",
                    f"pass the dense gradient's full shape; {fix}",
                )
            )
        for i, want in enumerate(shape or ()):
            if want is not None and dense_shape[i] != want:
                raise ValueError(
                    message(
                        call,
                        "dense_shape",
                        f"dim {i} to be {want} (the accumulator's shape is {fmt_shape(shape)})",
                        f"{dense_shape[i]} in {fmt_shape(dense_shape)}",
                        f"shape mismatch; {fix}",
                    )
                )
    if n:
        low, high = int(indices.min().item()), int(indices.max().item())
        if low < 0:
            raise ValueError(
                message(
                    call,
                    "indices",
                    "row indices >= 0",
                    f"index {low}",
                    f"pass non-negative row indices (TensorFlow does not check them); {fix}",
                )
            )
        limits = [
            (d, what)
            for d, what in (
                (shape[0] if shape else None, "the accumulator's shape[0]"),
                (dense_shape[0] if dense_shape else None, "dense_shape[0]"),
            )
            if d is not None
        ]
        for limit, what in limits:
            if high >= limit:
                raise ValueError(
                    message(
                        call,
                        "indices",
                        f"row indices < {limit} ({what})",
                        f"index {high}",
                        f"the index exceeds the limit of dim 0; {fix}",
                    )
                )
    got = tuple(values.shape)
    if current is None:
        if len(got) < rank:
            raise ValueError(
                message(
                    call,
                    "values",
                    f"rank at least {rank} (the accumulator's shape is {fmt_shape(shape)})",
                    f"rank {len(got)}: shape {fmt_shape(got)}",
                    f"shape mismatch; {fix}",
                )
            )
        for i in range(1, rank):
            want = shape[i] if shape else None
            if want is not None and got[i] != want:
                raise ValueError(
                    message(
                        call,
                        "values",
                        f"dim {i} to be {want} (the accumulator's shape is {fmt_shape(shape)})",
                        f"{got[i]} in shape {fmt_shape(got)}",
                        f"shape mismatch; {fix}",
                    )
                )
    elif len(got) != len(current) or got[1:] != current[1:]:
        raise ValueError(
            message(
                call,
                "values",
                f"rows of shape {fmt_shape(current[1:])} (those accumulated since the last take)",
                f"rows of shape {fmt_shape(got[1:])}",
                f"shape mismatch: the first gradient after a take fixes the row shape until the "
                f"next take; {fix}",
            )
        )
    if dense_shape is not None and (len(dense_shape) != len(got) or dense_shape[1:] != got[1:]):
        raise ValueError(
            message(
                call,
                "dense_shape",
                f"rank {len(got)} with dims 1.. equal to values.shape[1:] = {fmt_shape(got[1:])}",
                fmt_shape(dense_shape),
                f"pass the dense gradient's shape; {fix}",
            )
        )
    check_grad_dtype(values.dtype, dtype, call, "values")


def coalesce(
    indices: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique rows ``[n']`` and their summed values ``[n', *]`` (fresh tensors)."""
    idx = indices.to(device=device, dtype=torch.int64)
    rows, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    summed = torch.zeros((rows.shape[0], *values.shape[1:]), dtype=dtype, device=device)
    summed.index_add_(0, inverse, values.to(device=device, dtype=dtype))
    return rows, summed


def merge(
    aggregate: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grad: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add coalesced ``grad = (rows, values)`` into ``aggregate = (rows, values, counts)``; each
    row of ``grad`` adds 1 to its count."""
    (rows_a, values_a, counts_a), (rows_b, values_b) = aggregate, grad
    rows, inverse = torch.unique(torch.cat([rows_a, rows_b]), sorted=True, return_inverse=True)
    values = values_a.new_zeros((rows.shape[0], *values_a.shape[1:]))
    values.index_add_(0, inverse, torch.cat([values_a, values_b]))
    counts = counts_a.new_zeros(rows.shape)
    counts.index_add_(0, inverse, torch.cat([counts_a, torch.ones_like(rows_b)]))
    return rows, values, counts


def rows_of_coo(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [n], values [n, *shape[1:]])`` of a sparse COO tensor: its rows (first dim)
    that hold entries, duplicates summed. ``sparse_dim > 1`` densifies within those rows."""
    g = g.coalesce()
    idx, vals = g.indices(), g.values()
    if g.sparse_dim() == 1:
        return idx[0], vals
    rows, inverse = torch.unique(idx[0], sorted=True, return_inverse=True)
    out = vals.new_zeros((rows.shape[0], *g.shape[1:]))
    out.index_put_((inverse, *idx[1:]), vals, accumulate=True)
    return rows, out

"""One tolerance policy by dtype, and a comparison that reports every mismatch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["assert_close", "tolerances"]

_RTOL = {
    torch.float64: 1e-10,
    torch.complex128: 1e-10,
    torch.float32: 1e-5,
    torch.complex64: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
_ATOL = {
    torch.float64: 1e-12,
    torch.complex128: 1e-12,
    torch.float32: 1e-6,
    torch.complex64: 1e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-3,
}


def tolerances(dtype: torch.dtype, *, long_reduction: bool = False) -> tuple[float, float]:
    """``(rtol, atol)`` for results computed in ``dtype``.

    float64: rtol 1e-10; float32: rtol 1e-5 (1e-4 for long reductions); bf16/fp16: rtol 1e-2.

    Examples:
        >>> import torch
        >>> tolerances(torch.float64)
        (1e-10, 1e-12)
        >>> tolerances(torch.float32, long_reduction=True)
        (0.0001, 1e-05)
    """
    if dtype not in _RTOL:
        raise ValueError(
            f"tolerances(dtype): dtype: expected a floating or complex dtype, got "
            f"{dtype}; compare integer results exactly"
        )
    rtol, atol = _RTOL[dtype], _ATOL[dtype]
    if long_reduction and dtype in (torch.float32, torch.complex64):
        rtol, atol = 1e-4, 1e-5
    return rtol, atol


def _tensor(value: Any) -> torch.Tensor:
    """``value`` as a tensor; a tensor as it is (``torch.as_tensor`` would move it to the
    default device)."""
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value, device="cpu")


def _flatten(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [item for k, v in value.items() for item in _flatten(v, f"{prefix}[{k!r}]")]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, torch.Tensor)):
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{prefix}[{i}]")]
    return [(prefix, value)]


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    long_reduction: bool = False,
    name: str = "result",
) -> None:
    """Compare (nested) tensors with the dtype's tolerance and report *every* mismatch.

    Structures (dicts, lists, tuples) must match; ``None`` must meet ``None``.

    Examples:
        >>> import torch
        >>> assert_close({"w": torch.ones(2)}, {"w": torch.ones(2)})
        >>> assert_close([torch.ones(2), torch.zeros(1)], [torch.ones(2), torch.ones(1)])
        Traceback (most recent call last):
        ...
        AssertionError: 1 of 2 entries differ:
          result[1]: max abs diff 1 at index (0,) (rtol 1e-05, atol 1e-06); 1 of 1 elements off
    """
    got, want = _flatten(actual, name), _flatten(expected, name)
    if [k for k, _ in got] != [k for k, _ in want]:
        raise AssertionError(f"structures differ: {[k for k, _ in got]} vs {[k for k, _ in want]}")
    problems = []
    for (key, a), (_, e) in zip(got, want, strict=True):
        if a is None or e is None:
            if a is not e:
                problems.append(f"  {key}: {a!r} vs {e!r}")
            continue
        a_t, e_t = _tensor(a), _tensor(e)
        if a_t.is_sparse:
            a_t = a_t.to_dense()
        if e_t.is_sparse:
            e_t = e_t.to_dense()
        if a_t.shape != e_t.shape:
            problems.append(f"  {key}: shape {tuple(a_t.shape)} vs {tuple(e_t.shape)}")
            continue
        dtype = a_t.dtype if a_t.is_floating_point() or a_t.is_complex() else torch.float64
        r, t = tolerances(dtype, long_reduction=long_reduction)
        r, t = rtol if rtol is not None else r, atol if atol is not None else t
        e_t = e_t.to(a_t.dtype)
        bad = ~torch.isclose(a_t, e_t, rtol=r, atol=t, equal_nan=True)
        if bad.any():
            diff = (a_t - e_t).abs()
            diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
            idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.dim() else ()
            problems.append(
                f"  {key}: max abs diff {diff.max().item():.3g} at index {idx} "
                f"(rtol {r:g}, atol {t:g}); {int(bad.sum())} of {bad.numel()} "
                "elements off"
            )
    if problems:
        raise AssertionError(
            f"{len(problems)} of {len(got)} entries differ:\n" + "\n".join(problems)
        )

"""The once-per-window work of :meth:`~gradkit.accumulate.Accumulator.step`, as functions:
the all-reduce over ranks, the exact division by the window's count, and the clipping.

Exactness rule: a gradient is scaled in its own dtype by a Python float (a double), so no
float32 factor ever reaches a float64 gradient. Only float32/float16/bfloat16 gradients take
the fused AMP pass (division and inf/NaN check in one kernel, with a float32 factor).

Index legend: ``P`` parameters of the optimizer, ``M`` elements of one dtype group.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from gradkit._sharded import is_dtensor, local

__all__ = [
    "all_reduce_grads",
    "all_reduce_tally",
    "clip_",
    "divide_",
    "float64_compensation",
    "scale_",
    "sharded_norm",
    "total_norm",
]

_FUSED = (torch.float16, torch.bfloat16, torch.float32)
_WIDE = (torch.float64, torch.complex128)


# ------------------------------------------------------------------------------ across ranks
def all_reduce_tally(values: list[float], device: torch.device, group: Any) -> list[float]:
    """Sum a few float64 numbers (count, flags) over the ranks of ``group``."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return [float(v) for v in t.tolist()]


def all_reduce_grads(params: list[torch.Tensor], present: list[bool], group: Any) -> int:
    """Sum the gradients of ``params`` over the ranks: one flat buffer ``[M]`` and one
    all-reduce per (device, dtype) group. ``present[i]``: some rank has a gradient for
    ``params[i]`` (the layout must be the same on every rank: a rank without one sends zeros
    and receives the sum). Returns the number of all-reduces."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p, here in zip(params, present, strict=True):
        if here:
            groups[(p.device, p.dtype)].append(p)
    for (device, dtype), ps in groups.items():
        flat = torch.cat(
            [
                p.grad.reshape(-1)
                if p.grad is not None
                else torch.zeros(p.numel(), dtype=dtype, device=device)
                for p in ps
            ]
        )
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in ps:
            part = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
    return len(groups)


# ------------------------------------------------------------------------------- the scaling
def float64_compensation(scaler: Any) -> float:
    """AMP unscales with ``float32(1 / scale)``; a float64 gradient divided beforehand by this
    factor ends up divided by the scale exactly (1.0 for power-of-two scales)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return 1.0
    scale = float(scaler.get_scale())
    inv32 = float(torch.tensor(scale, dtype=torch.float64, device="cpu").reciprocal().float())
    return scale * inv32


def divide_(grads: list[torch.Tensor], count: float | None, *, check: bool, wide: float) -> bool:
    """Divide every gradient in place by ``count`` (``None``: no division) and, with ``check``,
    return whether all are finite. float64/complex128 gradients are divided by
    ``count * wide`` in their own precision; float32 and half gradients take AMP's fused
    divide-and-check kernel (a float32 factor)."""
    divisor = 1.0 if count is None else count
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    sparse: list[torch.Tensor] = []
    for g in grads:
        (sparse if g.is_sparse else groups[(g.device, g.dtype)]).append(g)
    finite = True
    for (device, dtype), gs in groups.items():
        if check and dtype in _FUSED:
            # float32 whatever the default dtype: the kernel refuses float64 ones, and a
            # failure here would leave the groups before it divided already
            found = torch.zeros(1, device=device, dtype=torch.float32)
            inv = torch.full((1,), 1.0 / divisor, device=device, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
            finite = finite and bool(found.item() == 0)
            continue
        d = divisor * (wide if dtype in _WIDE else 1.0)
        if d != 1.0:
            torch._foreach_div_(gs, d)
        if check:
            finite = finite and bool(torch.stack([torch.isfinite(g).all() for g in gs]).all())
    for g in sparse:
        d = divisor * (wide if g.dtype in _WIDE else 1.0)
        if d != 1.0:
            g.div_(d)
        if check:
            finite = finite and bool(torch.isfinite(g.coalesce().values()).all())
    return finite


def total_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm of all gradients together, each tensor's norm in its own dtype and their
    combination in float64."""
    norms: list[torch.Tensor] = []
    dense: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.is_sparse:
            norms.append(torch.linalg.vector_norm(g.coalesce().values()))
        else:
            dense[(g.device, g.dtype)].append(g)
    for (_, dtype), gs in dense.items():
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        norms.extend(torch._foreach_norm(gs, 2, dtype=wide))  # half norms overflow at 65504
    if not norms:
        return 0.0
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float64).abs() for n in norms])
    return float(torch.linalg.vector_norm(stacked))


def clip_(grads: list[torch.Tensor], max_norm: float) -> float:
    r"""Scale the gradients in place by :math:`\min(1, \text{max\_norm} / \|g\|)` (a double,
    no epsilon: the clipped norm is ``max_norm`` to rounding); return :math:`\|g\|` before
    clipping. A non-finite norm leaves the gradients as they are."""
    norm = total_norm(grads)
    scale_(grads, norm, max_norm)
    return norm


def scale_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Clip ``grads``, whose total norm is ``norm``, to ``max_norm`` in place."""
    if math.isfinite(norm) and norm > max_norm:
        factor = max_norm / norm
        dense = [g for g in grads if not g.is_sparse]
        if dense:
            torch._foreach_mul_(dense, factor)
        for g in grads:
            if g.is_sparse:
                g.mul_(factor)


def sharded_norm(
    params: list[torch.Tensor], finite: bool, max_norm: float | None, group: Any
) -> tuple[bool, float | None]:
    """Whether every rank's gradients are finite, and (with ``max_norm``) the norm of the whole
    gradient: the squared norms of this rank's shards summed over the ranks (one all-reduce of
    two numbers, with the finiteness flag), plus those of the replicated gradients."""
    shards = [local(p.grad) for p in params if p.grad is not None and is_dtensor(p.grad)]
    whole = [p.grad for p in params if p.grad is not None and not is_dtensor(p.grad)]
    # the gradients' device: NCCL refuses CPU tensors (a rank may hold no shard)
    device = next((g.device for g in [*shards, *whole]), torch.device("cpu"))
    squares = total_norm(shards) ** 2 if max_norm is not None else 0.0
    t = torch.tensor([0.0 if finite else 1.0, squares], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    bad, total = (float(v) for v in t.tolist())
    if max_norm is None:
        return bad == 0, None
    return bad == 0, math.sqrt(total + total_norm(whole) ** 2)

"""Merging accumulated statistics across torch.distributed ranks."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradkit._errors import GradkitError, message

if TYPE_CHECKING:
    from gradkit.per_example._stats import PowerSums, Want


def _gather_rows(
    parts: list[torch.Tensor], template: torch.Size, acc: PowerSums, group: Any
) -> list[torch.Tensor]:
    """All-gather variable-length ``[n_r, *template]`` blocks of ``acc`` in rank order, on
    its parameter's device (NCCL takes CUDA tensors only)."""
    dtype, device = acc.dtype, acc.device
    local = torch.cat(parts) if parts else acc.zeros(0, *template)
    world = dist.get_world_size(group)
    size = torch.tensor([local.shape[0]], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *template), dtype=dtype, device=device)
    padded[: local.shape[0]] = local
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded.contiguous(), group=group)
    return [o[: int(s.item())] for o, s in zip(out, sizes, strict=True)]


def all_reduce_accs(accs: list[PowerSums], want: Want, group: Any) -> None:
    """Sum counts and power sums over ranks; gather norms and individual gradients.

    Every rank makes the same collective calls whatever it saw (a rank without examples
    contributes zeros), so no rank waits forever on another. Every tensor a collective takes
    lives on the tracked parameters' device (NCCL refuses CPU tensors).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise GradkitError(
            message(
                "stats.all_reduce(group)",
                "group",
                "a process group of an initialized torch.distributed",
                "torch.distributed not initialized",
                "call torch.distributed.init_process_group first (every rank)",
            )
        )
    # the same tracked shapes and quantities on every rank, or every rank raises (no hang)
    layout = repr(([tuple(a.shape) for a in accs], sorted(want.quantities), want.moments))
    device = accs[0].device if accs else torch.device("cpu")
    mine = torch.tensor([len(accs), zlib.crc32(layout.encode())], dtype=torch.long, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(other, mine) for other in every):
        raise GradkitError(
            message(
                "stats.all_reduce(group)",
                "stats",
                "the same tracked parameters (shapes) and quantities on every rank",
                "ranks that differ",
                "call track() with the same model and arguments on every rank",
            )
        )
    for acc in accs:
        n = torch.tensor([acc.n], dtype=torch.long, device=acc.device)
        dist.all_reduce(n, group=group)
        powers = ([1] if want.mean else []) + list(want.powers)
        for p in powers:
            if p not in acc.sums:
                acc.sums[p] = acc.zeros(*acc.shape)
            dist.all_reduce(acc.sums[p], group=group)
        if "batch_l2" in want.quantities:
            acc.l2 = [torch.cat(_gather_rows(acc.l2, torch.Size(), acc, group))]
        if "batch_grad" in want.quantities:
            acc.grads = [torch.cat(_gather_rows(acc.grads, acc.shape, acc, group))]
        acc.n = int(n.item())

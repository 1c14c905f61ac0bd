"""Storage for per-example gradients (``batch_grad``), for the running sums a block accumulates
(:meth:`._stats.PowerSums.storage`) and for the statistics read from a block (``mean``,
``second_moment``, ``variance``, ``moment(p)``), reused from one ``track()`` block to the next,
on the CPU.

``batch_grad`` holds ``N x params`` numbers: 274 MB for a 535k-parameter MLP at batch 128. A
fresh CPU tensor that large is mapped by the operating system page by page as it is first
written, and unmapped when freed, so a step that materializes it pays about as much for page
faults as for the products (90 ms against 30 ms for that MLP). Reusing the storage of the
previous step removes that cost.

The statistics a step reads are parameter-sized (1.6 MB for that MLP's first weight). glibc
serves those from its heap, but gives the heap's free top back to the system once it exceeds a
threshold, and a loop that reads a statistic and drops it frees exactly such a top at the end of
every step: the next step's read then faults its pages in again (about 750 faults, 0.3 ms per
step on that MLP at batch 128, an eighth of the plain step). Results from :data:`_MIN_BYTES`
up are therefore pooled as well, a few per parameter and statistic.

A buffer is reused only when nothing but this pool refers to its storage (no tensor, view or
NumPy array of the user's): the storage's use count says so exactly, so results the user still
holds are never overwritten. Each parameter keeps at most two buffers per kind, which covers
the usual loop where the previous step's results are still bound while the next step runs
(``with track(...) as stats`` rebinds ``stats`` only after the block's tracker exists). The
buffers live as long as their parameter; :func:`release_buffers` frees them earlier. GPU
tensors are not pooled: the CUDA caching allocator already reuses device memory.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["batch_grad_buffer", "pool_of", "release_buffers", "result_buffer"]

_KEEP = 2  # buffers per parameter and kind
_MIN_BYTES = 128 * 2**10
"""glibc's smallest mmap threshold: smaller blocks come from its bins and are not pooled.
Pooling pays from there on, in time if not in faults: the per-example gradients of a small
model's Linear 256 -> 64 at batch 32 (2 MiB) are written in 122 us into the storage of the
previous step, in 199 us into a block fresh from the heap."""
_POOL: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> {kind: [buffers]}


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """The use count of the storage of ``t``, and the Python references to its storage object
    (torch may keep one object per storage: a storage object the user holds adds no use, but
    references); ``(-1, -1)`` for storage shared with another process (a tensor sent to one
    is moved to shared memory) or no longer of the size of ``t`` (``resize_``)."""
    storage = t.untyped_storage()
    if storage.is_shared() or storage.nbytes() != t.numel() * t.element_size():
        return -1, -1
    return int(torch._C._storage_Use_Count(storage._cdata)), sys.getrefcount(storage)


_HAS_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")
_ALONE = (
    _holders(torch.empty(1, device="cpu")) if _HAS_USE_COUNT else (-1, -1)
)  # one tensor, nothing else
_LOCK = threading.Lock()  # threads reading statistics take buffers one at a time


def _free(t: torch.Tensor) -> bool:
    """Whether nothing but the pool's own tensor refers to the storage of ``t``: no tensor,
    view, storage object or array of the user's in this process, none in another, and the
    storage still of its size (see :func:`_holders`)."""
    return _holders(t) == _ALONE


def pool_of(owner: torch.Tensor) -> dict[str, list[torch.Tensor]] | None:
    """The buffers kept for ``owner`` (a parameter), by kind, or None where nothing is pooled
    (not on the CPU, or a torch without storage use counts). A caller that takes several
    buffers looks it up once (the ``pool`` of :func:`batch_grad_buffer` and
    :func:`result_buffer`: a function giving it, called only for a buffer large enough)."""
    if not owner.is_cpu or not _HAS_USE_COUNT:
        return None
    with _LOCK:
        kinds: dict[str, list[torch.Tensor]] = _POOL.setdefault(owner, {})
        return kinds


Pool = Callable[[], "dict[str, list[torch.Tensor]] | None"]


def _reused(
    owner: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kind: str,
    min_bytes: int,
    pool: Pool | None,
) -> torch.Tensor | None:
    if math.prod(shape) * dtype.itemsize < min_bytes:
        return None
    kinds = pool_of(owner) if pool is None else pool()
    if kinds is None:
        return None
    if torch.is_inference_mode_enabled():  # its tensors are inference tensors: never kept
        return None
    with _LOCK:  # free, then taken: no other thread in between
        return _take(kinds, owner, shape, dtype, kind)


def _take(
    kinds: dict[str, list[torch.Tensor]],
    owner: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kind: str,
) -> torch.Tensor:
    kept = kinds.get(kind, [])
    for buf in kept:
        if buf.shape == shape and buf.dtype == dtype and _free(buf):
            return buf.detach()  # a new tensor on the storage: it counts as a use while alive
    # drop free buffers of another shape first, then the oldest (still held by the user: it is
    # theirs now, the pool only forgets it)
    kept = [b for b in kept if not _free(b)][-(_KEEP - 1) :]
    buf = torch.empty(shape, dtype=dtype, device=owner.device)
    kinds[kind] = [*kept, buf]
    return buf.detach()


def batch_grad_buffer(
    owner: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    pool: Pool | None = None,
) -> torch.Tensor | None:
    """An uninitialized ``shape`` tensor of ``dtype`` for the per-example gradients of
    ``owner`` (a parameter), reused when possible; None where nothing is pooled (not on the
    CPU, under :data:`_MIN_BYTES`, or a torch without storage use counts): the caller
    allocates as before."""
    return _reused(owner, shape, dtype, "batch_grad", _MIN_BYTES, pool)


def result_buffer(
    owner: torch.Tensor,
    dtype: torch.dtype,
    kind: str,
    pool: Pool | None = None,
) -> torch.Tensor | None:
    """An uninitialized tensor shaped like ``owner`` (a parameter) for the statistic ``kind``
    read from a block, reused when possible; None where nothing is pooled (as
    :func:`batch_grad_buffer`, under :data:`_MIN_BYTES`)."""
    return _reused(owner, tuple(owner.shape), dtype, kind, _MIN_BYTES, pool)


def release_buffers() -> None:
    """Free the CPU storage kept for the per-example gradients (``batch_grad``) and the
    statistics read (``mean``, ``variance``, ...) of every parameter, for the next ``track()``
    block to reuse.

    Results still held stay valid (they keep their own storage alive); the next block
    allocates afresh. Call it when a model that was tracked lives on but will not be tracked
    again; otherwise the storage is freed with its parameter.

    Example:
        >>> import torch
        >>> from gradkit.per_example import release_buffers, track
        >>> model = torch.nn.Linear(3, 2)
        >>> with track(model, "batch_grad") as stats:
        ...     model(torch.randn(4, 3)).sum().backward()
        >>> grads = stats["weight"].batch_grad
        >>> release_buffers()
        >>> grads.shape
        torch.Size([4, 2, 3])
    """
    with _LOCK:
        for kinds in _POOL.values():  # also those a running block looked up (pool_of)
            kinds.clear()
        _POOL.clear()

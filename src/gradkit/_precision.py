"""The CUDA backends' switches gradkit reads and sets around its own work: TF32 (whether a
layer's float32 products run in it, and gradkit's own products in full float32 whatever the
user's setting) and cuDNN for re-running or differentiating an RNN."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Autocast", "autocast_as", "autocast_state", "full_float32", "tf32", "without_cudnn_rnn"]

# torch >= 2.9 sets TF32 per backend and operator (fp32_precision: "tf32", "ieee" or "none",
# the latter following its parent); its legacy allow_tf32 flags raise when read after that API
# was used, so the new one is read and set where it exists
_NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(
    torch.backends.cudnn, "conv"
)


def tf32(module: nn.Module | None) -> bool:
    """Whether the layer's float32 products on CUDA may run in TF32: a convolution's or an
    RNN's by cuDNN's settings (on by default), any layer's matmuls by cuBLAS's (off by default).
    A module under the fallback is read by what its subtree holds."""
    subtree = list(module.modules()) if module is not None else []
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in subtree)
    rnn = any(isinstance(m, nn.RNNBase) for m in subtree)
    if not _NEW_TF32_API:
        cudnn_tf32 = (conv or rnn) and torch.backends.cudnn.allow_tf32
        return bool(cudnn_tf32 or torch.backends.cuda.matmul.allow_tf32)
    cudnn: Any = torch.backends.cudnn  # its per-operator switches are made at run time
    chains = [[torch.backends.cuda.matmul]]
    chains += [[cudnn.conv, cudnn]] if conv else []
    chains += [[cudnn.rnn, cudnn]] if rnn else []
    return any(_switched_on(chain) for chain in chains)


def _switched_on(chain: list[Any]) -> bool:
    """Whether the first ``fp32_precision`` set along ``chain`` (then torch's global one) is
    TF32 ("none" defers to the next)."""
    for switch in (*chain, torch.backends):
        value = getattr(switch, "fp32_precision", "none")
        if value != "none":
            return bool(value == "tf32")
    return False


@contextlib.contextmanager
def full_float32(cuda: bool) -> Iterator[None]:
    """gradkit's own products on CUDA in full float32, whatever TF32 the user's layers run in
    (restored after: the backward's next nodes are the user's)."""
    if not cuda:
        yield
        return
    if _NEW_TF32_API:
        cudnn: Any = torch.backends.cudnn
        switches = [torch.backends.cuda.matmul, cudnn.conv, cudnn.rnn]
        saved = [switch.fp32_precision for switch in switches]
        for switch in switches:
            switch.fp32_precision = "ieee"
        try:
            yield
        finally:
            for switch, value in zip(switches, saved, strict=True):
                switch.fp32_precision = value
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextlib.contextmanager
def without_cudnn_rnn(module: nn.Module) -> Iterator[None]:
    """cuDNN off while ``module`` holds an RNN: re-run functionally (the vmap fallback), cuDNN's
    RNN flattens its weights through their data pointers, which torch.func's tensors do not have
    ("Cannot access data pointer of Tensor that doesn't have storage"); and cuDNN's RNN backward
    runs in training mode only. The native CUDA kernels give the same numbers."""
    if not torch.backends.cudnn.enabled or not any(
        isinstance(m, nn.RNNBase) for m in module.modules()
    ):
        yield
        return
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = True


Autocast = tuple[tuple[str, torch.dtype], ...]
"""The autocast regions a call ran in: ``(device type, dtype)`` per enabled one."""

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> Autocast:
    """The autocast regions enabled now (none: ``()``)."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def autocast_as(state: Autocast) -> Iterator[None]:
    """Re-enter the autocast regions of ``state`` (a call recomputed outside them, as the
    fallback's per-example re-runs in the backward pass, computes in the dtypes it saw)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield

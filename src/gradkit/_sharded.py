"""PyTorch's fully sharded data parallelism as gradkit sees it: FSDP2 modules (``fully_shard``,
parameters as ``DTensor`` shards) are supported; FSDP1 (``FullyShardedDataParallel``, flat
parameters) is refused with a pointer to FSDP2, never left to crash inside a hook or a
collective.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from gradkit._errors import GradkitError

__all__ = ["fsdp2_modules", "is_dtensor", "local", "refuse_fsdp1"]


def _loaded(*names: str) -> type | None:
    """The first of ``module:attribute`` already imported, else None. Never imports: a model
    that uses FSDP or DTensors has imported them, and importing torch.distributed.fsdp for
    nothing starts state that can abort a gloo process at exit."""
    for name in names:
        module, attr = name.split(":")
        found = getattr(sys.modules.get(module), attr, None)
        if isinstance(found, type):
            return found
    return None


def _dtensor_type() -> type | None:
    return _loaded("torch.distributed.tensor:DTensor", "torch.distributed._tensor:DTensor")


def _fsdp2_type() -> type | None:
    return _loaded(
        "torch.distributed.fsdp:FSDPModule", "torch.distributed._composable.fsdp:FSDPModule"
    )


def _fsdp1_type() -> type | None:
    return _loaded("torch.distributed.fsdp:FullyShardedDataParallel")


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a sharded parameter or gradient)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (the tensor it holds: in-place changes reach the
    ``DTensor``), or ``t`` itself."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        shard: torch.Tensor = cast(Any, t).to_local()
    return shard


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` (``fully_shard`` applied), outermost first."""
    cls = _fsdp2_type()
    if cls is None:
        return []
    inner = getattr(model, "_orig_mod", model)
    return [m for m in cast(nn.Module, inner).modules() if isinstance(m, cls)]


def refuse_fsdp1(
    model: nn.Module, call: str, modules: Mapping[str, nn.Module] | None = None
) -> None:
    """Raise for a model wrapped (anywhere) in FSDP1's ``FullyShardedDataParallel``: its
    parameters are flat local shards, not the module's own shapes. ``modules``: the model's
    ``named_modules()`` if the caller has them (one walk of a large model fewer)."""
    cls = _fsdp1_type()
    if cls is None:
        return
    inner = getattr(model, "_orig_mod", model)
    named = modules.items() if modules is not None and inner is model else inner.named_modules()
    for name, m in named:
        if isinstance(m, cls):
            where = f"the module {name!r}" if name else "the model"
            raise GradkitError(
                f"{call}: {where} is wrapped in FullyShardedDataParallel (FSDP1), whose "
                "parameters are flat local shards, not the module's own tensors; gradkit "
                "supports FSDP2: shard the model with torch.distributed.fsdp.fully_shard "
                "(per layer, then the root) instead"
            )

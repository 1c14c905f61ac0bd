"""How :func:`gradkit.hyper.reverse` spends a memory budget: the graphs of the last steps (no
replay), stored states for the rest (one replay each), or checkpoints (one more recompute).

A kept step graph costs what autograd saves for it (measured once, on the first step, by
counting the distinct storages its saved tensors hold); a stored state costs ``|s|`` elements.
The plan keeps as many graphs as fit beside the stored states of the other steps, and falls
back to the cheapest checkpoint stride that fits when even the states do not.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = ["AUTO_SHARE", "MemoryBudgetWarning", "Plan", "available_bytes", "budget_bytes", "plan"]

AUTO_SHARE = 8
"""``memory_budget="auto"`` is the memory available on the parameters' device divided by this."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class MemoryBudgetWarning(UserWarning):
    """A memory budget below what the leanest plan (square-root checkpointing) needs."""


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` now: CUDA's free memory, the host's ``MemAvailable``, or None
    where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, OSError, ValueError):
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None  # pragma: no cover - no way to read it


def budget_bytes(value: Any, device: torch.device, call: str) -> int | None:
    """``memory_budget`` in bytes: ``None`` (no budget), ``"auto"``, a number of bytes, or a
    string with a unit (``"2GB"``, ``"512MiB"``)."""
    if value is None:
        return None
    fix = "pass e.g. memory_budget='2GB', 2e9 (bytes), 'auto' or None"
    expected = "None, 'auto', a number of bytes >= 0, or a size such as '2GB' or '512MiB'"
    if isinstance(value, str):
        if value == "auto":
            free = available_bytes(device)
            return None if free is None else free // AUTO_SHARE
        m = _SIZE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(message(call, "memory_budget", expected, repr(value), fix))
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(message(call, "memory_budget", expected, describe(value), fix))
    if not math.isfinite(value) and value > 0:
        return 2**62  # unlimited
    if not value >= 0:
        raise ValueError(message(call, "memory_budget", expected, repr(value), fix))
    return int(value)


@dataclass(frozen=True)
class Plan:
    """``graphs``: the last steps whose graphs are kept; ``stride``: every ``stride``-th of the
    other steps' states is stored (1: all); ``bytes``: what the plan holds at most."""

    graphs: int
    stride: int
    bytes: int


def _checkpoint_bytes(span: int, stride: int, state: int) -> int:
    return (-(-span // stride) + stride - 1) * state


def plan(budget: int, span: int, state: int, graph: int, call: str) -> Plan:
    """The fastest way to differentiate ``span`` steps within ``budget`` bytes, a step's graph
    costing ``graph`` bytes and a stored state ``state`` bytes."""
    graph = max(graph, state)
    if span * graph <= budget:
        return Plan(span, 1, span * graph)
    if span * state <= budget:
        kept = (budget - span * state) // max(graph - state, 1)
        kept = min(int(kept), span - 1)
        return Plan(kept, 1, kept * graph + (span - kept) * state)
    for stride in range(2, span + 1):
        if _checkpoint_bytes(span, stride, state) <= budget:
            return Plan(0, stride, _checkpoint_bytes(span, stride, state))
        if stride * stride > span:  # past the minimum: larger strides need more
            break
    stride = max(1, math.ceil(math.sqrt(span)))
    need = _checkpoint_bytes(span, stride, state)
    warnings.warn(
        message(
            call,
            "memory_budget",
            f"at least {need / 1e6:.3g} MB (square-root checkpointing of {span} states of "
            f"{state / 1e6:.3g} MB)",
            f"{budget / 1e6:.3g} MB",
            "raise the budget; the call goes on with square-root checkpointing",
        ),
        MemoryBudgetWarning,
        stacklevel=4,
    )
    return Plan(0, stride, need)


@contextlib.contextmanager
def saved_bytes() -> Iterator[dict[int, int]]:
    """Count the distinct storages autograd saves while the block builds a graph:
    ``{storage address: bytes}``."""
    found: dict[int, int] = {}
    held: list[torch.Tensor] = []  # alive while counting: no address is reused for another

    def pack(x: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError, NotImplementedError):
            storage = x.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
            held.append(x)
        # detached: a saved output packed as itself would hold its own node, a reference
        # cycle that only a backward pass without retain_graph breaks
        return x.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield found
    held.clear()

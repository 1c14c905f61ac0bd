"""Timing for side-by-side benchmarks: fixed thread count, warmup, interleaved repeats, medians.

Several callables are timed *round-robin*: every round runs each of them once (as one sample of
``number`` calls), in an order shuffled from round to round, so that load drift on a shared
machine hits all of them alike. Each sample runs with the garbage collector off, as ``timeit``
does. Results are plain dicts (JSON-ready), times in milliseconds per call.
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["machine_info", "peak_device_bytes", "quantile", "time_interleaved"]

_CALIBRATE_BELOW_S = 1.0


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` with linear interpolation (``q`` in [0, 1])."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile(values): values: expected at least one value, got none")
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _sample(fn: Callable[[], Any], number: int, device: torch.device | None = None) -> float:
    """Seconds per call over ``number`` back-to-back calls, with the GC off.

    On a CUDA ``device`` the calls start after a synchronize and are timed by CUDA events
    recorded around them: the time until the device has finished their work, not until the
    host has queued it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            for _ in range(number):
                fn()
            end_event.record()
            end_event.synchronize()
            return start_event.elapsed_time(end_event) / 1e3 / number
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - start) / number
    finally:
        if enabled:
            gc.enable()


def peak_device_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes of device memory ``fn()`` allocates at its peak beyond what was allocated before
    (``torch.cuda.max_memory_allocated``); None on the CPU, whose peak is measured in a
    subprocess instead."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    del out
    return torch.cuda.max_memory_allocated(device) - before


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    min_sample_s: float = 0.0,
    rewarm_s: float = 0.05,
    call_s: Mapping[str, float] | None = None,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict[str, dict[str, Any]]:
    """Time several callables round-robin and summarize each by its median.

    Every round times each callable once, in an order shuffled from round to round (seeded):
    load drift hits all callables alike, and no callable always runs after the same one.
    That matters: a call that leaves caches and allocator state cold (a forward-mode
    Jacobian, a full garbage collection, a large matmul) slows down the next few calls of
    whatever runs next, for several calls. So a cheap callable also gets one untimed call right
    before each of its samples, and the garbage collector is run once before timing, never
    between rounds.

    Args:
        fns: name -> callable taking no argument (its result is discarded).
        repeats: rounds, i.e. samples per callable.
        warmup: untimed calls of each callable before timing.
        min_sample_s: each sample repeats a callable ``number`` times so that it lasts at least
            this long, which keeps timer resolution and per-sample jitter small for
            sub-millisecond calls.
        rewarm_s: callables whose one call takes at most this long ("cheap") get the untimed
            call before each sample (0 turns it off).
        call_s: seconds of one earlier, possibly cold, call of some callables (e.g. the call
            that checked its result). Calibration uses the last warmup call, else this one if
            it took over a second, else one more call; cheap callables take the fastest of
            that and two more calls.
        seed: seed of the order shuffle.
        device: where the callables compute; on CUDA each sample is timed with events after a
            synchronize (see :func:`_sample`).

    Returns:
        name -> ``{"median_ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "repeats", "number",
        "samples_ms"}``; ``samples_ms[r]`` is the time per call in round ``r``, so samples of
        different callables with the same index were taken side by side.
    """
    if repeats < 1:
        raise ValueError(f"time_interleaved: repeats: expected >= 1, got {repeats}")
    names = list(fns)
    gc.collect()
    once = dict(call_s or {})
    for name in names:
        for _ in range(warmup):
            once[name] = _sample(fns[name], 1, device)
    if min_sample_s > 0 or rewarm_s > 0:
        for name in names:  # calibrate on warm calls, the fastest of three for cheap ones
            if name not in once or (warmup == 0 and once[name] <= _CALIBRATE_BELOW_S):
                once[name] = _sample(fns[name], 1, device)
            if once[name] <= rewarm_s:
                once[name] = min(
                    once[name], _sample(fns[name], 1, device), _sample(fns[name], 1, device)
                )
    numbers = dict.fromkeys(names, 1)
    for name, t in once.items():
        if min_sample_s > 0 and t > 0 and name in numbers:
            numbers[name] = max(1, math.ceil(min_sample_s / t))
    rewarm = {name: name in once and once[name] <= rewarm_s for name in names}
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            if rewarm[name]:
                fns[name]()
            samples[name].append(_sample(fns[name], numbers[name], device) * 1e3)
    return {
        name: {
            "median_ms": statistics.median(s),
            "q1_ms": quantile(s, 0.25),
            "q3_ms": quantile(s, 0.75),
            "min_ms": min(s),
            "max_ms": max(s),
            "repeats": repeats,
            "number": numbers[name],
            "samples_ms": s,
        }
        for name, s in samples.items()
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(threads: int, device: torch.device | None = None) -> dict[str, Any]:
    """What the numbers were measured on: versions, CPU, threads, the device (with its name and
    CUDA version on a GPU) and the date (UTC)."""
    import numpy

    from gradkit import __version__

    get_capability = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gradkit": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_capability": get_capability() if get_capability is not None else None,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": str(device or "cpu"),
        "device_name": (
            torch.cuda.get_device_name(device)
            if device is not None and device.type == "cuda"
            else None
        ),
        "cuda": torch.version.cuda,
    }

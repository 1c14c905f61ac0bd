"""A benchmark case: several ways to compute one quantity, timed side by side and cross-checked.

Every method is called once first (timed apart as ``first_call_ms``); that call is the first
warmup, calibrates how many calls make one sample, and gives the result that is
compared with the case's reference result (max abs diff and the dtype's tolerance from
:func:`gradkit.testing.tolerances`). Then all methods are timed round-robin
(:func:`~gradkit._bench._timing.time_interleaved`) and reported as ratios to the case's baseline,
the fastest of one or more named methods.
"""

from __future__ import annotations

import contextlib
import io
import math
import operator
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradkit._bench._timing import peak_device_bytes, quantile, time_interleaved
from gradkit.testing import tolerances

__all__ = ["Case", "Method", "Settings", "Target", "flat", "quiet", "run_case"]

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}


def flat(value: Any) -> torch.Tensor:
    """All tensors in ``value`` (a tensor or nested tuples/lists of them) as one flat vector."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)
    return torch.cat([flat(v) for v in value])


@contextlib.contextmanager
def quiet(*, stderr: bool = False) -> Iterator[None]:
    """Silence warnings inside the block (peers' deprecated hooks and the like), for these calls
    only; ``stderr``: also swallow what is printed there (e.g. a peer's import-time notes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if stderr:
            with contextlib.redirect_stderr(io.StringIO()):
                yield
        else:
            yield


@dataclass(frozen=True)
class Method:
    """One way to compute the case's quantity.

    ``value`` maps what ``fn`` returns to a flat tensor compared with the reference result;
    None for methods timed for scale only (a forward pass, a gradient). ``units`` > 1 reports
    the ratio per unit (e.g. per column of a matrix product); ``value`` then returns the first
    unit's result.
    """

    key: str
    label: str
    fn: Callable[[], Any]
    value: Callable[[Any], torch.Tensor] | None = flat
    units: int = 1


@dataclass(frozen=True)
class Target:
    """``median(numerator) / min(median(d) for d in denominator)`` (per unit) against ``value``.

    ``value=None`` reports the ratio without a target.
    """

    name: str
    numerator: str
    denominator: tuple[str, ...]
    op: str = "<="
    value: float | None = None


@dataclass(frozen=True)
class Settings:
    """How long to time: rounds, extra warmup calls, and the minimum duration of one sample."""

    repeats: int
    warmup: int = 1
    min_sample_s: float = 0.02


@dataclass
class Case:
    """Methods computing one quantity; ``baseline`` names the ratio denominator (the fastest
    of those methods), ``reference`` the method whose result the others are checked against
    (or ``reference_value`` gives that result, as ``(label, tensor)``)."""

    key: str
    title: str
    setup: dict[str, Any]
    methods: list[Method]
    baseline: tuple[str, ...]
    reference: str | None
    dtype: torch.dtype
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repeats_scale: float = 1.0
    reference_value: tuple[str, torch.Tensor] | None = None
    extras: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None


def _mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def _fastest(timings: dict[str, dict[str, Any]], keys: Sequence[str]) -> str:
    return min(keys, key=lambda k: timings[k]["median_ms"])


def _agreement(
    case: Case, values: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    rtol, atol = tolerances(case.dtype, long_reduction=case.dtype != torch.float64)
    if case.reference_value is not None:
        ref_label, ref = case.reference_value
    elif case.reference is not None:
        ref_label = next(m.label for m in case.methods if m.key == case.reference)
        ref = values[case.reference]
    else:
        return {"reference": None}, {}
    ref = ref.detach().reshape(-1)
    per_method: dict[str, dict[str, Any]] = {}
    for key, v in values.items():
        if v.shape != ref.shape:  # reported as a mismatch, never compared partially
            per_method[key] = {"max_abs_diff": None, "agree": False}
            continue
        diff = float((v.to(ref.dtype) - ref).abs().max()) if v.numel() else 0.0
        per_method[key] = {
            "max_abs_diff": diff if math.isfinite(diff) else None,
            "agree": bool(torch.allclose(v.to(ref.dtype), ref, rtol=rtol, atol=atol)),
        }
    summary = {
        "reference": ref_label,
        "rtol": rtol,
        "atol": atol,
        "max_abs_reference": float(ref.abs().max()) if ref.numel() else 0.0,
        "all_agree": all(p["agree"] for p in per_method.values()),
    }
    return summary, per_method


def run_case(case: Case, settings: Settings, device: torch.device | None = None) -> dict[str, Any]:
    """Run ``case``: results and agreement first, then interleaved timing; a JSON-ready dict.

    On a CUDA ``device`` the samples are timed with CUDA events, and each method's peak device
    memory (``torch.cuda.max_memory_allocated`` beyond what was allocated before its call) is
    reported as ``peak_mib``.
    """
    device = device or torch.device("cpu")
    values: dict[str, torch.Tensor] = {}
    first_s: dict[str, float] = {}
    for m in case.methods:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = m.fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first_s[m.key] = time.perf_counter() - start
        if m.value is not None:
            values[m.key] = m.value(out).detach().clone()
        del out
    extras = case.extras(values) if case.extras is not None else {}
    agreement, per_method = _agreement(case, values)
    del values
    peak = {m.key: peak_device_bytes(m.fn, device) for m in case.methods}

    repeats = max(1, math.floor(settings.repeats * case.repeats_scale + 1e-9))
    fns = {m.key: m.fn for m in case.methods}
    timings = time_interleaved(
        fns,
        repeats=repeats,
        warmup=max(0, settings.warmup - 1),
        min_sample_s=settings.min_sample_s,
        call_s=first_s,
        device=device,
    )
    base_key = _fastest(timings, case.baseline)
    base_ms = timings[base_key]["median_ms"]
    # paired with the baseline the ratios divide by (the per-round fastest of several candidates
    # made an IQR that could exclude the ratio it stands beside: 0.97 against 0.98-0.99)
    base_samples = timings[base_key]["samples_ms"]
    methods = []
    for m in case.methods:
        t = timings[m.key]
        paired = [s / m.units / b for s, b in zip(t["samples_ms"], base_samples, strict=True)]
        methods.append(
            {
                "key": m.key,
                "label": m.label,
                **{k: t[k] for k in ("median_ms", "q1_ms", "q3_ms", "min_ms", "max_ms")},
                "first_call_ms": first_s[m.key] * 1e3,
                "repeats": t["repeats"],
                "calls_per_sample": t["number"],
                "samples_ms": t["samples_ms"],
                "units": m.units,
                "ratio": t["median_ms"] / m.units / base_ms,
                "paired_ratio_q1": quantile(paired, 0.25),
                "paired_ratio_q3": quantile(paired, 0.75),
                "peak_mib": _mib(peak[m.key]),
                **per_method.get(m.key, {"max_abs_diff": None, "agree": None}),
            }
        )
    labels = {m.key: m.label for m in case.methods}
    per_unit = {m.key: timings[m.key]["median_ms"] / m.units for m in case.methods}
    targets = []
    for tg in case.targets:
        denom_key = min(tg.denominator, key=per_unit.__getitem__)
        ratio = per_unit[tg.numerator] / per_unit[denom_key]
        targets.append(
            {
                "name": tg.name,
                "numerator": labels[tg.numerator],
                "denominator": labels[denom_key],
                "ratio": ratio,
                "op": tg.op,
                "target": tg.value,
                "pass": None if tg.value is None else _OPS[tg.op](ratio, tg.value),
            }
        )
    return {
        "key": case.key,
        "title": case.title,
        "setup": case.setup,
        "baseline": {
            "candidates": [labels[k] for k in case.baseline],
            "chosen": labels[base_key],
            "median_ms": base_ms,
        },
        "methods": methods,
        "agreement": agreement,
        "targets": targets,
        "extras": extras,
        "notes": case.notes,
    }

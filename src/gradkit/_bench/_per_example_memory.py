"""Peak memory of the ``per_example`` suite's variance (``--memory``): one subprocess per
variant builds model, data and every peer's wrapper, computes the variance once and reports its
peak RSS; the extra memory is that over the median of three processes that only build."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from gradkit._bench._case import quiet
from gradkit._bench._memory import peak_rss_bytes, run_child
from gradkit._bench._per_example_problems import MODELS, SMOKE_BATCH, make_problem
from gradkit._bench._per_example_runner import Runner, error_of

__all__ = ["add_memory", "measure_memory", "memory_child"]

_MEMORY_GOALS: dict[str, float | None] = {
    "mlp": 2.0,
    "seq": None,
    "3c3d": 2.5,
    "cnn": None,
    "gpt2": None,
}
_MEMORY_VARIANTS = ("plain", "gradkit", "backpack", "opacus", "torch_func")
_REPEATED = ("baseline", "plain", "gradkit")  # measured in several processes (the goal's terms)


def memory_child(argv: list[str]) -> None:
    """Subprocess entry: ``KEY VARIANT THREADS SEED BATCH`` (BATCH 0: the full size). Builds the
    problem and every wrapper, computes VARIANT's variance once (``baseline``: nothing) and
    prints ``{"peak_mib": ...}`` (or ``{"skipped": true}``: a peer not installed) as JSON."""
    key, variant, threads, seed, batch = argv
    torch.set_num_threads(int(threads))
    with quiet():
        runner = Runner(make_problem(key, int(seed), int(batch) or None))
        fns = runner.variants("variance")
        if variant != "baseline" and variant not in fns:
            print(json.dumps({"skipped": True}))
            return
        if variant != "baseline":
            error = error_of(fns[variant].fn)
            if error is not None:  # the timed cases report it
                print(json.dumps({"skipped": True, "error": error}))
                return
    print(json.dumps({"peak_mib": peak_rss_bytes() / 2**20}))


def _run_child(key: str, variant: str, threads: int, seed: int, batch: int) -> float | None:
    args = [key, variant, str(threads), str(seed), str(batch)]
    what = f"per_example memory {key}/{variant}"
    result = run_child("gradkit._bench._per_example_memory", args, threads, what)
    return None if result.get("skipped") else float(result["peak_mib"])


def measure_memory(
    key: str,
    *,
    threads: int = 1,
    seed: int = 0,
    batch: int = 0,
    processes: int = 3,
    variants: tuple[str, ...] = _MEMORY_VARIANTS,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Peak memory of one variance computation on model ``key`` for each variant, as MiB over
    the median peak of processes that only build (model, data, every wrapper).

    Baseline, plain and gradkit take the median of ``processes`` processes, peers one.
    Returns ``{"baseline_mib", "processes", "extra_mib": {variant: MiB}}`` (peers that are not
    installed are left out).
    """
    peaks: dict[str, list[float]] = {}
    for variant in ("baseline", *variants):
        runs = processes if variant in _REPEATED else 1
        got = [_run_child(key, variant, threads, seed, batch) for _ in range(runs)]
        if all(g is not None for g in got):
            peaks[variant] = [g for g in got if g is not None]
    baseline = statistics.median(peaks.pop("baseline"))
    extra = {v: statistics.median(ps) - baseline for v, ps in peaks.items()}
    if log is not None:
        for v, mib in extra.items():
            log(f"[per_example] memory {key}/{v}: +{mib:.1f} MiB")
    return {"baseline_mib": baseline, "processes": processes, "extra_mib": extra}


def add_memory(
    cases: list[dict[str, Any]],
    *,
    threads: int,
    seed: int,
    mode: str,
    log: Callable[[str], None] | None = None,
) -> None:
    """Measure the variance's peak memory per model and attach it to the ``<model>_variance``
    case results: ``memory`` (JSON), a note with a table, and a target for gradkit. Full runs
    measure every variant; quick and smoke runs plain and gradkit, in one process each."""
    for i, key in enumerate(MODELS):  # the seeds of build_cases
        case = next((c for c in cases if c["key"] == f"{key}_variance"), None)
        if case is None:
            continue
        mem = measure_memory(
            key,
            threads=threads,
            seed=seed + i,
            batch=SMOKE_BATCH[key] if mode == "smoke" else 0,
            processes=3 if mode == "full" else 1,
            variants=_MEMORY_VARIANTS if mode == "full" else ("plain", "gradkit"),
            log=log,
        )
        case["memory"] = mem
        _memory_report(case, key, mem)


def _memory_report(case: dict[str, Any], key: str, mem: dict[str, Any]) -> None:
    extra = mem["extra_mib"]
    plain = extra.get("plain")
    labels = {m["key"]: m["label"] for m in case["methods"]}
    k = mem["processes"]
    lines = [
        f"Peak memory of one variance computation: the peak RSS (VmHWM) of a process that "
        f"builds model, data and every wrapper and computes it once, over the median peak of "
        f"{k} processes that only build ({mem['baseline_mib']:.0f} MiB); plain and gradkit: "
        f"median of {k} processes, peers: one. Differences under ~10 MiB are noise.",
        "",
        "| method | peak extra MiB | x plain |",
        "|---|---:|---:|",
    ]
    for variant, mib in extra.items():
        times = f"{mib / plain:.2f}" if plain and plain > 0 else "-"
        lines.append(f"| `{labels.get(variant, variant)}` | {mib:.1f} | {times} |")
    case["notes"].append("\n".join(lines))
    if plain is None or "gradkit" not in extra:
        return
    goal = _MEMORY_GOALS[key]
    ratio = extra["gradkit"] / plain if plain > 0 else float("inf")
    case["targets"].append(
        {
            "name": "gradkit variance peak extra memory / plain's",
            "numerator": labels["gradkit"],
            "denominator": labels["plain"],
            "ratio": ratio,
            "op": "<=",
            "target": goal,
            "pass": None if goal is None else ratio <= goal,
        }
    )

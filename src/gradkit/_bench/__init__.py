"""Benchmarks of gradkit against its peers, side by side in one process (``gradkit bench``).

``main(argv)`` runs the chosen suites with a fixed thread count, writes ``<out>/<suite>.json``
(machine, settings, absolute medians, ratios, agreement, targets) and ``<out>/<suite>.md``
(ratios and a PASS/FAIL summary) and prints the markdown. The exit status is 0 when every
result agrees numerically with its reference, 1 otherwise; timing and memory targets never
change it (machines are noisy: read the report).

Suites, one module each:

* ``per_example``: gradkit.per_example against BackPACK, Opacus and torch.func (with memory on,
  the peak memory of the variance too, one subprocess per variant);
* ``func``: gradkit.func against torch.func and torch.autograd.functional;
* ``accumulate``: :class:`~gradkit.accumulate.Accumulator` against a hand-written accumulation
  loop on the demo CNN, and one micro-step's activation memory;
* ``hyper``: hypergradients against ``higher`` and TorchOpt (time and peak memory);
* ``curvature``: curvature products, estimators and diagonals against hand-written autograd,
  torch.func, BackPACK and curvlinops.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gradkit._bench import accumulate, curvature, func, hyper, monitor, per_example
from gradkit._bench._case import Case, Settings, run_case
from gradkit._bench._report import render_markdown, summary_rows, write_outputs
from gradkit._bench._timing import machine_info
from gradkit._precision import full_float32
from gradkit._scope import torch_scope

__all__ = ["SUITES", "bench_device", "main", "run_suite"]

SUITES: dict[str, Callable[[], list[Case]]] = {
    "func": func.build_cases,
    "per_example": per_example.build_cases,
    "accumulate": accumulate.build_cases,
    "curvature": curvature.build_cases,
    "hyper": hyper.build_cases,
    "monitor": monitor.build_cases,
}
# suites whose builder takes the mode (e.g. smaller batches in smoke runs)
_BY_MODE: dict[str, Callable[[str], list[Case]]] = {
    "per_example": per_example.build_cases,
    "hyper": hyper.build_cases,
}
# suites that run a chosen subset of their models (--models)
_BY_MODELS: dict[str, Callable[[str, Sequence[str]], list[Case]]] = {
    "per_example": per_example.build_cases,
}
# suites that measure peak memory in subprocesses when asked (--memory)
_MEMORY: dict[str, Callable[..., None]] = {
    "per_example": per_example.add_memory,
    "hyper": hyper.add_memory,
}

_MODES = {
    "full": Settings(repeats=31, warmup=2, min_sample_s=0.05),
    "quick": Settings(repeats=5, warmup=1, min_sample_s=0.005),
    "smoke": Settings(repeats=1, warmup=1, min_sample_s=0.0),
}


def run_suite(
    name: str,
    *,
    mode: str = "full",
    threads: int = 1,
    seed: int = 0,
    memory: bool = False,
    models: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run one suite and return its results as a JSON-ready dict (nothing is written).

    ``memory``: also measure peak memory where the suite does (in subprocesses, after timing;
    on CUDA every method's peak device memory is measured in process instead).
    ``models``: only these models (suites of ``_BY_MODELS``; None: all).
    ``device``: where the models and data live (torch's default device while the cases are
    built, not while they are timed); on CUDA, times come from CUDA events after a
    synchronize.
    """
    device = bench_device(device)
    if models is not None and name not in _BY_MODELS:
        raise ValueError(
            f"run_suite({name!r}): models: expected None for this suite (only "
            f"{', '.join(_BY_MODELS)} choose models), got {list(models)}; leave it out."
        )
    settings = _MODES[mode]
    started = time.perf_counter()
    # models and data are built on the device (torch's default device while building); the
    # timing runs outside that mode, which costs about 1 us per torch call (and on the CPU,
    # the default anyway, it is not entered at all)
    build = torch.device(device) if device.type != "cpu" else contextlib.nullcontext()
    # every method's float32 products in full float32 on CUDA: cuDNN's TF32 default would put
    # the references and the methods 1e-4 to 1e-3 apart, past the float32 agreement tolerance
    with torch_scope(threads), full_float32(device.type == "cuda"):
        torch.manual_seed(seed)
        with build:
            if models is not None:
                cases = _BY_MODELS[name](mode, models)
            else:
                cases = _BY_MODE[name](mode) if name in _BY_MODE else SUITES[name]()
        results = []
        for case in cases:
            if log is not None:
                log(f"[{name}] {case.key} ...")
            t0 = time.perf_counter()
            results.append(run_case(case, settings, device))
            if log is not None:
                log(f"[{name}] {case.key} done in {time.perf_counter() - t0:.1f} s")
        del cases
    memory = memory and name in _MEMORY and device.type == "cpu"
    if memory:
        _MEMORY[name](results, threads=threads, seed=seed, mode=mode, log=log)
    result: dict[str, Any] = {
        "suite": name,
        "machine": machine_info(threads, device),
        "config": {
            "mode": mode,
            "repeats": settings.repeats,
            "warmup": settings.warmup,
            "min_sample_s": settings.min_sample_s,
            "seed": seed,
            "threads": threads,
            "memory": memory,
            "models": None if models is None else list(models),
        },
        "cases": results,
    }
    rows = summary_rows(result)
    judged = [r for r in rows if r["status"] in ("PASS", "FAIL")]
    result["summary"] = {
        "targets_passed": sum(r["status"] == "PASS" for r in judged),
        "targets_total": len(judged),
        "all_agree": all(c["agreement"].get("all_agree", True) for c in results),
        "seconds": time.perf_counter() - started,
    }
    return result


def bench_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``: the CPU, or a CUDA device that is there."""
    try:
        out = torch.device(device)
    except RuntimeError as err:
        raise ValueError(
            f"gradkit bench: --device: expected 'cpu' or 'cuda[:N]', got {device!r} ({err})"
        ) from None
    if out.type not in ("cpu", "cuda"):
        raise ValueError(f"gradkit bench: --device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"gradkit bench: --device: got {device!r}, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); install a CUDA build of torch, or leave --device out"
        )
    if out.type == "cuda" and out.index is None:
        out = torch.device("cuda", torch.cuda.current_device())
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradkit bench",
        description="gradkit against its peers, side by side in one process: interleaved "
        "medians, reported as ratios, with numerical agreement checks.",
    )
    p.add_argument(
        "--suite", choices=["all", *SUITES], default="all", help="which suite to run (default: all)"
    )
    p.add_argument(
        "--quick", action="store_true", help="few repeats (a smoke run for CI; ratios are noisier)"
    )
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads for the run (default: 1)"
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per_example suite: also measure the peak memory of the variance, one subprocess "
        "per variant (default: on in full runs, off with --quick)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=per_example.MODELS,
        metavar="MODEL",
        help="per_example suite: only these models, of "
        f"{', '.join(per_example.MODELS)} (default: all)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where models and data live: cpu (default) or cuda[:N]; on CUDA, times come from "
        "CUDA events after a synchronize and each method's peak device memory is reported",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results"),
        help="folder for <suite>.json and <suite>.md (default: benchmarks/results)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; see ``gradkit bench --help``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads: expected a positive int, got {args.threads}")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    names = list(SUITES) if args.suite == "all" else [args.suite]
    if args.models is not None and names != ["per_example"]:
        parser.error(f"--models: expected --suite per_example, got --suite {args.suite}")
    try:
        device = bench_device(args.device)
    except ValueError as err:
        parser.error(str(err).removeprefix("gradkit bench: "))

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    ok = True
    for name in names:
        memory = mode == "full" if args.memory is None else args.memory
        result = run_suite(
            name,
            mode=mode,
            threads=args.threads,
            memory=memory,
            models=args.models,
            device=device,
            log=log,
        )
        json_path, md_path = write_outputs(result, args.out)
        print(render_markdown(result))
        print(f"Wrote {json_path} and {md_path}")
        ok = ok and result["summary"]["all_agree"]
    return 0 if ok else 1

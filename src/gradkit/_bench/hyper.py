"""The ``hyper`` suite: gradkit.hyper's hypergradient engines against the plain unrolled graph
(torch autograd, what ``higher`` and TorchOpt keep) and those peers when installed.

Problem (hypergrad.md section 4 and issue 5's goal table): data hyper-cleaning on scikit-learn's
digits, 1000 training examples with half of the labels replaced by a wrong class, 500 clean
validation examples, MLP 64-256-10 (ReLU, 19,210 parameters), full batch, heavy-ball SGD in
``torch.optim.SGD``'s convention (lr 0.1, momentum 0.9), inner loss ``mean(w * CE)``, outer
loss the validation cross-entropy after T steps, float32. T is 1000 in full runs, 200 in quick
runs and 10 in smoke runs.

Cases:

* ``hyper_weights``: the hypergradient with respect to the 1000 per-example weights: the
  unrolled graph (baseline and reference), ``reverse`` at four memory budgets (None: every
  state stored; 8 GB: every step's graph kept; 1 GB: the last steps' graphs and the other
  states; 20 MB: checkpoints), ``reverse`` with ``checkpoint_every="sqrt"``, ``higher`` and
  TorchOpt (functional API) when importable.
* ``hyper_lr_momentum``: the hypergradient with respect to (lr, momentum): the unrolled graph,
  ``reverse`` (stored states; every graph kept) and ``forward`` (one run carrying both
  directions).

Peak memory (``--memory``): one subprocess per method builds the problem, runs the method once
with T = 2 (warm-up), then once with T; its extra memory is the rise of its resident
high-water mark (``VmHWM``) over the warm-up's. Goals (issue 5): reverse <= 1.2 T |s| + 20 MB,
checkpointed reverse <= 60 MB, forward <= 20 MB at T and at T / 5, reverse at 10 T < 2 GB
(``|s|`` = 2 x 19,210 float32 = 153,680 bytes: weights and momentum). MB = 10^6 bytes.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from typing import Any

import torch

from gradkit._bench._case import Case, Method, Target
from gradkit._bench._hyper_problem import CASES, LR, MOMENTUM, N_TRAIN, N_VAL, Problem, installed
from gradkit._bench._memory import peak_rss_bytes, run_child

__all__ = ["STEPS", "add_memory", "build_cases", "measure", "memory_child"]

STEPS = {"full": 1000, "quick": 200, "smoke": 10}
LONG = 10  # the long-horizon memory check runs LONG x T steps
MB = 1e6


def _setup(problem: Problem, steps: int, what: str) -> dict[str, Any]:
    return {
        "data": f"digits, {N_TRAIN} training examples (half the labels wrong), {N_VAL} validation",
        "model": "MLP 64-256-10 (ReLU), 19,210 parameters, full batch",
        "inner": f"heavy-ball SGD (torch.optim.SGD convention), lr {LR}, momentum {MOMENTUM}",
        "T": steps,
        "hyperparameters": what,
        "state_bytes_per_step": problem.state_bytes,
        "dtype": "float32",
    }


def build_cases(mode: str = "full") -> list[Case]:
    """The two cases at the mode's T (full 1000, quick 200, smoke 10); the problem is drawn from
    ``torch.initial_seed()``. Peers that are not installed are skipped with a note."""
    steps = STEPS.get(mode, STEPS["full"])
    problem = Problem.make(torch.initial_seed() % 2**31)
    cases = []
    for key, (names, methods) in CASES.items():
        available = {k: v for k, v in methods.items() if installed(k)}
        skipped = [k for k in methods if k not in available]
        what = "1000 per-example weights" if names == ("w",) else "(lr, momentum)"
        targets = [
            Target(
                "gradkit reverse, stored states / plain unroll", "reverse", ("unroll",), "<=", 1.5
            ),
            Target(
                "gradkit reverse, every graph kept / plain unroll",
                "reverse_graphs",
                ("unroll",),
                "<=",
                1.35,
            ),
        ]
        if key == "hyper_weights":
            targets.append(
                Target(
                    "gradkit reverse checkpointed / plain unroll",
                    "reverse_ckpt",
                    ("unroll",),
                    "<=",
                    2.0,
                )
            )
        else:
            targets.append(
                Target(
                    "gradkit forward / gradkit reverse, stored states",
                    "forward",
                    ("reverse",),
                    "<=",
                    1.5,
                )
            )
        notes = [
            "Times of one hypergradient through T steps (the forward pass, the backward pass or "
            "the tangent passes, and the outer loss); the unrolled graph is what higher and "
            "TorchOpt keep. Peak memory comes from --memory runs (one subprocess per method)."
        ]
        if skipped:
            notes.append(f"Not installed, skipped: {', '.join(skipped)}.")

        def make_fn(
            fn: Callable[..., torch.Tensor], names: tuple[str, ...] = names
        ) -> Callable[[], torch.Tensor]:
            return lambda: fn(problem, steps, names)

        cases.append(
            Case(
                key=key,
                title=f"Hypergradient w.r.t. {what} through T = {steps} steps "
                "(hyper-cleaning on digits)",
                setup=_setup(problem, steps, what),
                methods=[Method(k, label, make_fn(fn)) for k, (label, fn) in available.items()],
                baseline=("unroll",),
                reference="unroll",
                dtype=torch.float32,
                targets=targets,
                notes=notes,
                repeats_scale=0.1 if mode == "full" else 0.4,
            )
        )
    return cases


# -- peak memory, one subprocess per method ----------------------------------------------------


def memory_child(argv: list[str]) -> None:
    """Subprocess entry: ``CASE METHOD STEPS THREADS SEED``. Builds the problem, runs METHOD with
    T = 2 (warm-up), then with STEPS; prints ``{"extra_bytes": ...}`` as JSON (or
    ``{"skipped": true}`` for a peer that is not installed)."""
    case, method, steps, threads, seed = argv
    torch.set_num_threads(int(threads))
    names, methods = CASES[case]
    if not installed(method):
        print(json.dumps({"skipped": True}))
        return
    fn = methods[method][1]
    problem = Problem.make(int(seed))
    out = fn(problem, 2, names)
    del out
    gc.collect()
    before = peak_rss_bytes()
    out = fn(problem, int(steps), names)
    after = peak_rss_bytes()
    print(json.dumps({"extra_bytes": after - before, "finite": bool(torch.isfinite(out).all())}))


def measure(case: str, method: str, steps: int, *, threads: int = 1, seed: int = 0) -> float | None:
    """Extra peak memory (MB) of one hypergradient by ``method`` in a fresh process (None: a
    peer that is not installed)."""
    args = [case, method, str(steps), str(threads), str(seed)]
    what = f"hyper memory {case}/{method} (T={steps})"
    result = run_child("gradkit._bench.hyper", args, threads, what)
    return None if result.get("skipped") else float(result["extra_bytes"]) / MB


def add_memory(
    cases: list[dict[str, Any]],
    *,
    threads: int,
    seed: int,
    mode: str,
    log: Callable[[str], None] | None = None,
) -> None:
    """Measure the extra peak memory of every method (full runs: also reverse at 10 T) and
    attach it to the case results: ``memory`` (JSON), a note with a table, and the goals as
    targets (``extra / goal <= 1``)."""
    steps = STEPS.get(mode, STEPS["full"])
    problem = Problem.make(seed)
    for case in cases:
        key = case["key"]
        if key not in CASES:
            continue
        _, methods = CASES[key]
        rows: dict[str, float] = {}
        for method in methods:
            value = measure(key, method, steps, threads=threads, seed=seed)
            if value is not None:
                rows[f"{method} (T={steps})"] = value
                if log is not None:
                    log(f"[hyper] memory {key}/{method} T={steps}: +{value:.1f} MB")
        goals: list[tuple[str, str, float]] = []  # (name, row of the table, goal in MB)
        if key == "hyper_weights":
            goal = (1.2 * steps * problem.state_bytes + 20 * MB) / MB
            goals.append(
                ("reverse extra memory / (1.2 T state + 20 MB)", f"reverse (T={steps})", goal)
            )
            goals.append(
                ("checkpointed reverse extra memory / 60 MB", f"reverse_ckpt (T={steps})", 60.0)
            )
            if mode == "full":
                long = LONG * steps
                value = measure(key, "reverse", long, threads=threads, seed=seed)
                if value is not None:
                    rows[f"reverse (T={long})"] = value
                    if log is not None:
                        log(f"[hyper] memory {key}/reverse T={long}: +{value:.1f} MB")
                    goals.append(
                        (
                            f"reverse at T={long} extra memory / 2000 MB",
                            f"reverse (T={long})",
                            2000.0,
                        )
                    )
        else:
            short = max(2, steps // 5)
            value = measure(key, "forward", short, threads=threads, seed=seed)
            if value is not None:
                rows[f"forward (T={short})"] = value
            goals.append(("forward extra memory / 20 MB", f"forward (T={steps})", 20.0))
            goals.append(
                (f"forward extra memory at T={short} / 20 MB", f"forward (T={short})", 20.0)
            )
        case["memory"] = {"extra_mb": rows, "state_bytes_per_step": problem.state_bytes}
        lines = [
            "Extra peak memory of one hypergradient: the rise of a fresh process's resident "
            "high-water mark (VmHWM) over a T = 2 warm-up of the same method; MB = 10^6 bytes. "
            f"State: {problem.state_bytes:,} bytes per step (weights + momentum).",
            "",
            "| method | extra MB |",
            "|---|---:|",
        ]
        lines += [f"| {row} | {value:.1f} |" for row, value in rows.items()]
        case["notes"].append("\n".join(lines))
        for name, row, goal in goals:
            if row not in rows:
                continue
            ratio = rows[row] / goal
            case["targets"].append(
                {
                    "name": f"{name} (goal {goal:.0f} MB)" if "state" in name else name,
                    "numerator": row,
                    "denominator": f"{goal:.1f} MB",
                    "ratio": ratio,
                    "op": "<=",
                    "target": 1.0,
                    "pass": ratio <= 1.0,
                }
            )

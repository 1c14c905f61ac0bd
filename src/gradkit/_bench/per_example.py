"""The ``per_example`` suite: gradkit.per_example against BackPACK, Opacus and torch.func.

Models and peers follow moments.md sections 5 and 6 (CPU, 1 thread; every
row also has the target "gradkit / the fastest peer <= 1"):

* ``mlp``: MLP 784-512-256-10 (ReLU), batch 128, cross entropy (mean);
* ``seq``: ``Linear(256, 256)`` on ``[32, 64, 256]`` then ``Flatten``, MSE (sum);
* ``3c3d``: the DeepOBS 3c3d CNN on ``[64, 3, 32, 32]``, cross entropy (mean);
* ``cnn``: the CNN of ``gradkit demo`` (two 3x3 convolutions, two linear layers, 18,346
  parameters) on 32 of the bundled digits ``[32, 1, 8, 8]``, cross entropy (mean): the small
  model whose cost is per-layer overhead;
* ``gpt2``: a Hugging Face ``GPT2LMHeadModel`` of about 1.0M parameters (4 layers, width 128,
  tied head) on token ids ``[16, 64]``, called as ``model(input_ids=x).logits`` (the model
  broadcasts its ``[1, T]`` position ids over the batch), mean token cross entropy; variance and
  per-example norms only. Skipped with a note when ``transformers`` is not installed;
* ``compiled``: the demo CNN under ``torch.compile`` (inductor; ``aot_eager`` in smoke runs),
  variance + per-example norms in one tracked step against the plain compiled step, the eager
  steps beside them (no peer: none of them tracks a compiled model).

For each model and each of variance, second moment, per-example squared norms (``batch_l2``,
summed over parameters) and per-example gradients (``batch_grad``), every method runs one forward
and one backward pass and reads its result; ratios are to the plain forward and
``loss.backward()`` (no extension) timed side by side. Statistics are of the individual gradients
``g_i = d l_i / d theta``, which every timed call returns: BackPACK gives those of ``g_i / N``
under a mean loss (and the sum of ``g_i^2`` for the second moment), so its timed call rescales
them, one multiply per result, as its users must. Results are compared with the reference
(torch.func per-example gradients in float32, reduced in float64). Peers that are not
installed are skipped with a note; a peer that raises or returns malformed results on a model
(on GPT-2: BackPACK skips Conv1D and LayerNorm, Opacus returns one position-embedding gradient
for the whole batch and its ghost clipping refuses tied weights) is left out of that case with
a note saying what it raised and where. If gradkit raises, its result counts as a mismatch
(NaN): the run then exits 1, and its goal is not judged.

Peak memory of the variance (``--memory``): one subprocess per variant builds model, data and
every peer's wrapper, computes the variance once and reports its peak RSS; the extra memory is
that over the median of three processes that only build (moments.md section 5.2).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

import gradkit
from gradkit._bench._case import Case, Method, Target
from gradkit._bench._per_example_compiled import compiled_case
from gradkit._bench._per_example_memory import add_memory, measure_memory, memory_child
from gradkit._bench._per_example_problems import (
    MODELS,
    QUANTITIES,
    SMOKE_BATCH,
    WORDS,
    Problem,
    make_problem,
    quantities,
)
from gradkit._bench._per_example_runner import Runner, Variant, error_of, parts, reference, relative
from gradkit.per_example.rules import _conv

__all__ = [
    "MODELS",
    "QUANTITIES",
    "add_memory",
    "build_cases",
    "measure_memory",
    "memory_child",
    "quantities",
]

_PEERS = {
    "backpack": "BackPACK",
    "opacus": "Opacus",
    "torch_func": "torch.func",
    "hand": "The hand-written reference",
}
_TITLES = {
    "variance": "Variance of the individual gradients",
    "second_moment": "Second moment of the individual gradients",
    "batch_l2": "Per-example squared gradient norms (summed over parameters)",
    "batch_grad": "Per-example gradients",
}
_GOALS = {  # ratio to plain forward + backward (CPU, 1 thread)
    ("mlp", "variance"): 1.5,
    ("mlp", "second_moment"): 1.45,
    ("mlp", "batch_l2"): 1.2,
    ("mlp", "batch_grad"): 10.0,
    ("seq", "variance"): 1.35,
    ("seq", "second_moment"): 1.3,
    ("seq", "batch_l2"): 1.3,
    ("seq", "batch_grad"): 1.15,
    ("3c3d", "variance"): 3.0,
    ("3c3d", "batch_l2"): 1.4,
    ("3c3d", "batch_grad"): 1.6,
    ("cnn", "variance"): 1.6,
    ("cnn", "batch_l2"): 1.6,
    ("gpt2", "variance"): 1.5,
    ("gpt2", "batch_l2"): 1.3,
}
_HAND_NOTE = (
    "The hand-written method is a reference, not a peer: the quantity's products written for "
    "exactly this model (each tracked layer's input kept and its output's gradient retained, "
    "then the products; per-example gradients written into buffers kept across calls), with "
    "autograd's own weight gradient and none of gradkit's hooks, checks and bookkeeping. "
    "gradkit / hand-written is the price of those, less what gradkit's fused weight gradient "
    "(one product fewer where per-example gradients are materialized anyway) saves; a goal "
    "below the hand-written method's ratio to plain is out of reach of any code running the "
    "same products on this machine."
)
_PEER_SKIP_QUICK = "Peers are timed in full runs only (a --quick run times plain and gradkit)."


def _case(runner: Runner, quantity: str, grads: list[torch.Tensor], mode: str) -> Case:
    p = runner.problem
    variants = runner.variants(quantity)
    ref = reference(quantity, grads)
    # the variance's float32 rounding error scales with the second moment, not with itself
    scaled_by = reference("second_moment", grads) if quantity == "variance" else ref
    scales = [float(t.abs().max()) or 1.0 for t in parts(scaled_by)]

    expected = relative(ref, scales)

    def value(v: Variant) -> Callable[[Any], torch.Tensor]:
        return lambda r: relative(v.value(r), scales)

    notes = [
        "Differences are relative: every parameter's result (the norms: the whole vector) is "
        "divided by the largest magnitude of its reference before comparing; the variance by "
        "the largest second moment, as its rounding error in float32 (E[g^2] - E[g]^2, in "
        "every method) scales with it."
    ]
    notes += p.notes + runner.notes
    goal = _GOALS.get((p.key, quantity))
    failed = False
    methods = [Method("plain", variants["plain"].label, variants["plain"].fn, None)]
    for key, v in variants.items():
        if key == "plain":
            continue
        error = error_of(v.fn)  # one call before the case runs: does the method run at all?
        if error is None and key == "gradkit":
            settled = _settle(v.fn)
            if settled:
                notes.append(
                    f"gradkit times its two ways of computing a convolution's per-example "
                    f"gradients on the first tracked steps' own blocks, one layer shape at a "
                    f"time, and keeps the faster: {settled} steps ran before the timed rounds, "
                    "which time the steady state a training run spends its steps in."
                )
        if error is None:
            methods.append(Method(key, v.label, v.fn, value(v)))
        elif key == "gradkit":
            methods.append(Method(key, v.label, _guarded(v.fn), _nan_if_failed(value(v), expected)))
            notes.append(
                f"gradkit raised {error}. Its result counts as a mismatch (NaN), its time is "
                f"that until the error, and its goal ({goal}) is not judged."
            )
            goal, failed = None, True
        else:
            notes.append(
                f"{_PEERS[key]} fails on this model here (left out of this case): `{v.label}` "
                f"raised {error}."
            )
    targets = [Target(f"gradkit {WORDS[quantity]} / plain", "gradkit", ("plain",), "<=", goal)]
    kept = {m.key for m in methods}
    peers = tuple(m.key for m in methods if m.key not in ("plain", "gradkit", "hand"))
    if peers and not failed:
        targets.append(Target("gradkit / the fastest peer", "gradkit", peers, "<=", 1.0))
    if "hand" in kept and not failed:
        targets.append(Target("gradkit / hand-written (no goal)", "gradkit", ("hand",)))
        notes.append(_HAND_NOTE)
    if mode == "quick":
        notes.append(_PEER_SKIP_QUICK)
    rescaled = p.reduction == "mean" or quantity == "second_moment"
    if "backpack" in kept and rescaled:
        notes.append(
            "BackPACK gives the statistics of g_i / N under a mean loss (and the sum, not the "
            "mean, of g_i^2); its timed call rescales them to those of g_i, as every method "
            "returns the statistic of g_i and a BackPACK user needs that pass too (one "
            "multiply per parameter-shaped result)."
        )
    if quantity == "batch_l2" and "opacus" in kept and p.key == "3c3d":
        notes.append(
            "Opacus ghost norms cover Linear layers; its conv layers materialize per-example "
            "gradients and take their norms."
        )
    return Case(
        key=f"{p.key}_{quantity}",
        title=f"{_TITLES[quantity]}: {p.name}, batch {p.n}",
        setup={**p.setup(), "quantity": quantity},
        methods=methods,
        baseline=("plain",),
        reference=None,
        reference_value=(
            "torch.func vmap(grad) per-example gradients ("
            + ("float32" if p.x.device.type == "cpu" else "float64 on the device")
            + "), reduced in float64",
            expected,
        ),
        dtype=torch.float32,
        targets=targets,
        notes=notes,
        # the slowest cases (every method materializes [N, *param] of a large model): 12
        # rounds in full runs; the small models' per-example gradients take all 31 (12 left
        # their medians within the rounds' noise of the peers': 4 s of the run each)
        repeats_scale=0.4 if quantity == "batch_grad" and p.key in _SLOW_GRADS else 1.0,
    )


_SETTLE_STEPS = 64

_SLOW_GRADS = ("mlp", "3c3d")
"""Models whose per-example gradients take long to time (tens of seconds per case)."""


def _settle(fn: Callable[[], Any]) -> int:
    """Call gradkit's step ``fn`` until no convolution shape is being timed (at most
    :data:`_SETTLE_STEPS` calls); the number of calls."""
    calls = 0
    while _conv._TRIALS and calls < _SETTLE_STEPS:
        fn()
        calls += 1
    return calls


def _guarded(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, returning None where it raises (a method that failed its first call)."""

    def call() -> Any:
        try:
            return fn()
        except Exception:  # already reported in the case's notes
            return None

    return call


def _nan_if_failed(
    value: Callable[[Any], torch.Tensor], expected: torch.Tensor
) -> Callable[[Any], torch.Tensor]:
    """``value``, or NaN of the reference's shape for a failed call: never agrees."""
    return lambda r: torch.full_like(expected, float("nan")) if r is None else value(r)


_NEEDS = {"gpt2": "transformers"}  # models that need an optional package


def build_cases(mode: str = "full", models: Sequence[str] = MODELS) -> list[Case]:
    """The cases of ``models`` (model and data of each model seeded from
    ``torch.initial_seed()`` and its place in :data:`MODELS`): full sizes with every
    installed peer; ``quick`` times plain and gradkit only; ``smoke`` (tests) uses a few
    examples per batch. A model whose package is not installed is skipped with a note in the
    other cases; ValueError if no case is left."""
    unknown = [k for k in models if k not in MODELS]
    if unknown:
        raise ValueError(
            f"per_example.build_cases: models: expected names of {MODELS}, got {unknown}; "
            "pass some of those names."
        )
    seed = torch.initial_seed()
    cases: list[Case] = []
    skipped: list[str] = []
    for key in models:
        if key == "compiled":
            cases.append(compiled_case(mode, seed + MODELS.index(key)))
            continue
        batch = SMOKE_BATCH[key] if mode == "smoke" else None
        try:
            problem = make_problem(key, seed + MODELS.index(key), batch)
        except ImportError as error:
            if key not in _NEEDS:
                raise
            skipped.append(
                f"The `{key}` cases are skipped: {_NEEDS[key]} is not installed "
                f"({type(error).__name__}: {error}; `pip install {_NEEDS[key]}`)."
            )
            continue
        runner = Runner(problem, peers=mode != "quick")
        if _leaks(problem):
            runner.notes.append(_LEAK_NOTE)
        grads = runner.reference_grads()
        for quantity in quantities(key):
            cases.append(_case(runner, quantity, grads, mode))
        del grads
    if not cases:
        raise ValueError(f"per_example suite: no case left to run. {' '.join(skipped)}")
    for case in cases:
        case.notes.extend(skipped)
    return cases


def _leaks(p: Problem) -> bool:
    """:func:`_tracker_outlives_block`, False where gradkit raises (its cases report that)."""
    try:
        return _tracker_outlives_block(p)
    except Exception:
        p.model.zero_grad(set_to_none=True)
        return False


_LEAK_NOTE = (
    "Leak: here gradkit's tracker outlives its `with` block, even after gc.collect() (a "
    "reference cycle through the autograd graph), so every call keeps its statistics and "
    "captured inputs and memory grows from call to call; later calls slow down."
)


def _tracker_outlives_block(p: Problem) -> bool:
    """Whether the tracker of one ``track`` block is still alive after the block, the results
    and a full garbage collection."""
    p.model.zero_grad(set_to_none=True)
    with gradkit.per_example.track(p.model, "variance", loss_reduction=p.reduction) as stats:
        p.loss(p.model).backward()
    ref = weakref.ref(stats)
    del stats
    gc.collect()
    p.model.zero_grad(set_to_none=True)
    return ref() is not None


# -- peak memory of the variance, one subprocess per variant -------------------------------------

"""The ``per_example`` suite: gradkit.per_example against BackPACK, Opacus and torch.func.

Models, peers and goals follow moments.md sections 5 and 6 (CPU, 1 thread):

* ``mlp``: MLP 784-512-256-10 (ReLU), batch 128, cross entropy (mean);
* ``seq``: ``Linear(256, 256)`` on ``[32, 64, 256]`` then ``Flatten``, MSE (sum);
* ``3c3d``: the DeepOBS 3c3d CNN on ``[64, 3, 32, 32]``, cross entropy (mean);
* ``gpt2``: a Hugging Face ``GPT2LMHeadModel`` of about 1.0M parameters (4 layers, width 128,
  tied head) on token ids ``[16, 64]``, called as ``model(input_ids=x).logits`` (the model
  broadcasts its ``[1, T]`` position ids over the batch), mean token cross entropy; variance and
  per-example norms only. Skipped with a note when ``transformers`` is not installed.

For each model and each of variance, second moment, per-example squared norms (``batch_l2``,
summed over parameters) and per-example gradients (``batch_grad``), every method runs one forward
and one backward pass and reads its result; ratios are to the plain forward and
``loss.backward()`` (no extension) timed side by side. Statistics are of the individual gradients
``g_i = d l_i / d theta``: BackPACK gives those of ``g_i / N`` under a mean loss, rescaled outside
the timed call before the comparison with the reference (torch.func per-example gradients in
float32, reduced in float64). Peers that are not installed are skipped with a note; a peer that
raises or returns malformed results on a model (on GPT-2: BackPACK skips Conv1D and LayerNorm,
Opacus returns one position-embedding gradient for the whole batch and its ghost clipping refuses
tied weights) is left out of that case with a note saying what it raised and where. If gradkit
raises, its result counts as a mismatch (NaN): the run then exits 1, and its goal is not judged.

Peak memory of the variance (``--memory``): one subprocess per variant builds model, data and
every peer's wrapper, computes the variance once and reports its peak RSS; the extra memory is
that over the median of three processes that only build (moments.md section 5.2).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import gradkit
from gradkit._bench._case import Case, Method, Target, flat
from gradkit._bench._models import deepobs_3c3d, gpt2_lm, relu_mlp, seq_linear

__all__ = ["MODELS", "QUANTITIES", "add_memory", "build_cases", "memory_child", "quantities"]

MODELS = ("mlp", "seq", "3c3d", "gpt2")
QUANTITIES = ("variance", "second_moment", "batch_l2", "batch_grad")
_QUANTITIES_OF = {"gpt2": ("variance", "batch_l2")}  # models that run only some quantities
_PEERS = {"backpack": "BackPACK", "opacus": "Opacus", "torch_func": "torch.func"}
_WORDS = {
    "variance": "variance",
    "second_moment": "second moment",
    "batch_l2": "per-example squared norms",
    "batch_grad": "per-example gradients",
}
_TITLES = {
    "variance": "Variance of the individual gradients",
    "second_moment": "Second moment of the individual gradients",
    "batch_l2": "Per-example squared gradient norms (summed over parameters)",
    "batch_grad": "Per-example gradients",
}
_GOALS = {  # ratio to plain forward + backward (moments.md 6.1, as set for this suite)
    ("mlp", "variance"): 1.5,
    ("mlp", "batch_l2"): 1.2,
    ("seq", "variance"): 1.5,
    ("seq", "second_moment"): 1.4,
    ("seq", "batch_l2"): 1.3,
    ("3c3d", "variance"): 3.0,
    ("3c3d", "batch_l2"): 1.5,
    ("3c3d", "batch_grad"): 2.5,
    ("gpt2", "variance"): 1.5,
    ("gpt2", "batch_l2"): 1.3,
}
_MEMORY_GOALS: dict[str, float | None] = {"mlp": 2.0, "seq": None, "3c3d": 2.5, "gpt2": None}
_SMOKE_BATCH = {"mlp": 8, "seq": 4, "3c3d": 4, "gpt2": 4}
_PEER_SKIP_QUICK = "Peers are timed in full runs only (a --quick run times plain and gradkit)."


def quantities(key: str) -> tuple[str, ...]:
    """The quantities the suite computes on model ``key``, in report order."""
    return _QUANTITIES_OF.get(key, QUANTITIES)


def _positional(f: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = f(x)
    return out


def _logits(f: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM called as its users do: ``f(input_ids=x).logits``."""
    out: torch.Tensor = f(input_ids=x).logits
    return out


@dataclass
class _Problem:
    """A model, a batch and its loss; ``reduction`` is how the loss combines the examples.

    ``call(f, x)`` is the output of the model (or of anything called like it, e.g. a wrapper or
    a ``functional_call``) on ``x``.
    """

    key: str
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    reduction: str
    loss_name: str
    call: Callable[[Callable[..., Any], torch.Tensor], torch.Tensor] = _positional
    notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.x.shape[0]

    def loss(self, module: nn.Module) -> torch.Tensor:
        return self.loss_fn(self.call(module, self.x), self.y)

    def setup(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "input": "x".join(str(s) for s in self.x.shape),
            "loss": self.loss_name,
            "dtype": "float32",
        }


def _mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y, reduction="sum")


def _token_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all ``N * T`` tokens of ``logits [N, T, V]`` and ``y [N, T]``:
    the mean over examples of each sequence's mean (every sequence has ``T`` tokens)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


_GPT2_NOTE = (
    "GPT-2 is called as `model(input_ids=x).logits`: the model builds its position ids as "
    "[1, T] and broadcasts them over the batch, so the position embedding is shared by all "
    "examples in one call. Loss: mean cross entropy of the next token over all N * T "
    "positions (tokens drawn uniformly), i.e. the mean over examples of each sequence's mean."
)


def _problem(key: str, seed: int, batch: int | None = None) -> _Problem:
    """The model and data of ``key``, drawn from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    if key == "mlp":
        n = batch or 128
        return _Problem(
            key,
            "MLP 784-512-256-10 (ReLU)",
            relu_mlp((784, 512, 256, 10)),
            torch.randn(n, 784),
            torch.randint(0, 10, (n,)),
            F.cross_entropy,
            "mean",
            "cross entropy (mean)",
        )
    if key == "seq":
        n = batch or 32
        return _Problem(
            key,
            "Linear 256->256 on sequences of 64, then Flatten",
            seq_linear(256),
            torch.randn(n, 64, 256),
            torch.randn(n, 64 * 256),
            _mse_sum,
            "sum",
            "MSE (sum)",
        )
    if key == "3c3d":
        n = batch or 64
        return _Problem(
            key,
            "DeepOBS 3c3d CNN",
            deepobs_3c3d(),
            torch.randn(n, 3, 32, 32),
            torch.randint(0, 10, (n,)),
            F.cross_entropy,
            "mean",
            "cross entropy (mean)",
        )
    if key == "gpt2":
        n, length, vocab = batch or 16, 64, 1536
        model = gpt2_lm(vocab_size=vocab, n_positions=length)
        tokens = torch.randint(0, vocab, (n, length + 1))
        return _Problem(
            key,
            "GPT-2 (Hugging Face GPT2LMHeadModel, 4 layers, width 128, 4 heads, vocabulary "
            f"{vocab}, tied head) on token ids of length {length}",
            model,
            tokens[:, :-1],
            tokens[:, 1:],
            _token_cross_entropy,
            "mean",
            "next-token cross entropy (mean over tokens)",
            call=_logits,
            notes=[_GPT2_NOTE],
        )
    raise ValueError(f"per_example suite: key: expected one of {MODELS}, got {key!r}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the warnings peers emit (deprecated hooks and the like), for their calls only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _reduce(quantity: str, grads: list[torch.Tensor]) -> Any:
    """The quantity from materialized per-example gradients ``[N, *shape]`` (eager, naive)."""
    if quantity == "variance":
        return [g.square().mean(0) - g.mean(0).square() for g in grads]
    if quantity == "second_moment":
        return [g.square().mean(0) for g in grads]
    if quantity == "batch_l2":
        return torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0)
    return grads


def _reference(quantity: str, grads: list[torch.Tensor]) -> Any:
    """The quantity from float32 per-example gradients, reduced in float64 (two-pass variance)."""
    if quantity == "batch_grad":
        return grads
    if quantity == "variance":
        return [(g.double() - g.double().mean(0)).square().mean(0) for g in grads]
    if quantity == "second_moment":
        return [g.double().square().mean(0) for g in grads]
    return torch.stack([g.flatten(1).double().square().sum(1) for g in grads]).sum(0)


def _raised(error: BaseException) -> str:
    """What ``error`` is and where it was raised (its innermost frame), on one line."""
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        path = frame.filename.replace(os.sep, "/")
        for root in ("site-packages/", "/src/"):
            if root in path:
                path = path.rsplit(root, 1)[1]
                break
        where = f" in {path}:{frame.lineno} ({frame.name})"
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}{where}: {text}"


def _error_of(fn: Callable[[], Any]) -> str | None:
    """None if ``fn()`` returns; else what it raised and where (see :func:`_raised`)."""
    try:
        out = fn()
        del out
    except Exception as error:  # reported in the case, never swallowed
        return _raised(error)
    return None


def _unset(model: nn.Module, attr: str, got: list[Any]) -> str:
    """Which parameters BackPACK left without ``attr`` (``got[i]`` None), and their modules."""
    owners: dict[int, str] = {}
    for m in model.modules():
        for q in m.parameters(recurse=False):
            owners.setdefault(id(q), type(m).__name__)
    named = list(model.named_parameters())
    missing = [(n, owners[id(q)]) for (n, q), g in zip(named, got, strict=True) if g is None]
    kinds = ", ".join(sorted({kind for _, kind in missing}))
    return (
        f"it set `{attr}` on {len(got) - len(missing)} of {len(got)} parameters and ignored "
        f"those of modules it has no extension for: {kinds} (e.g. {missing[0][0]})"
    )


def _parts(result: Any) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _relative(result: Any, scales: list[float]) -> torch.Tensor:
    """One flat vector: each parameter's result (``batch_l2``: the whole vector) divided by the
    largest magnitude of its reference, so that differences are relative to that scale."""
    return flat([t / s for t, s in zip(_parts(result), scales, strict=True)])


def _backpack() -> Any:
    try:
        with _quiet():
            import backpack
            import backpack.extensions
    except ImportError:
        return None
    return backpack


def _opacus() -> Any:
    try:
        with _quiet():
            import opacus
            import opacus.grad_sample
    except ImportError:
        return None
    return opacus


_BACKPACK = {  # quantity -> (extension, field on the parameter)
    "variance": ("Variance", "variance"),
    "second_moment": ("SumGradSquared", "sum_grad_squared"),
    "batch_l2": ("BatchL2Grad", "batch_l2"),
    "batch_grad": ("BatchGrad", "grad_batch"),
}


def _same(result: Any) -> Any:
    return result


@dataclass
class _Variant:
    """``fn`` computes the quantity; ``value`` maps its result to those of ``g_i``: one tensor
    per parameter, or the ``[N]`` norms."""

    label: str
    fn: Callable[[], Any]
    value: Callable[[Any], Any] = _same


@dataclass
class _Runner:
    """Every way to compute each quantity on one problem, as calls of no argument; the peers'
    wrappers are built once, on deep copies with the same weights."""

    problem: _Problem
    peers: bool = True
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.problem
        self.names = [n for n, _ in p.model.named_parameters()]
        self.bp: Any = _backpack() if self.peers else None
        self.op: Any = _opacus() if self.peers else None
        if self.peers and self.bp is None:
            self.notes.append(
                "BackPACK is not installed (`pip install --no-deps backpack-for-pytorch "
                "einops unfoldNd`): skipped."
            )
        if self.peers and self.op is None:
            self.notes.append("Opacus is not installed (`pip install opacus`): skipped.")
        self.bp_model: Any = None
        self.gsm: Any = None
        self.ghost: Any = None
        if self.bp is not None:
            self.bp_model = self._wrap("BackPACK", "extend(model)", self.bp.extend)
        if self.op is not None:
            gs = self.op.grad_sample
            self.gsm = self._wrap(
                "Opacus",
                f'GradSampleModule(model, loss_reduction="{p.reduction}")',
                lambda m: gs.GradSampleModule(m, loss_reduction=p.reduction),
            )
            self.ghost = self._wrap(
                "Opacus",
                "GradSampleModuleFastGradientClipping(model, use_ghost_clipping=True)",
                lambda m: gs.GradSampleModuleFastGradientClipping(
                    m, loss_reduction=p.reduction, max_grad_norm=1.0, use_ghost_clipping=True
                ),
            )
        params = {k: v.detach() for k, v in p.model.named_parameters()}

        def loss_one(ps: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> Any:
            def f(*args: Any, **kwargs: Any) -> Any:
                return functional_call(p.model, ps, args, kwargs)

            return p.loss_fn(p.call(f, xi[None]), yi[None])

        per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def func_grads() -> list[torch.Tensor]:
            with _quiet():  # e.g. vmap's note on ops without a batching rule (attention)
                return list(per_example(params, p.x, p.y).values())

        self.func_grads: Callable[[], list[torch.Tensor]] = func_grads

    def _wrap(self, peer: str, call: str, wrap: Callable[[nn.Module], Any]) -> Any:
        """``wrap`` of a deep copy of the model (same weights), or None with a note if it
        raises: the peer refuses the model there."""
        try:
            with _quiet():
                return wrap(copy.deepcopy(self.problem.model))
        except Exception as error:  # reported in every case of the model
            self.notes.append(
                f"{peer} refuses this model: `{call}` raised {_raised(error)}; its variants "
                "that need it are left out."
            )
            return None

    def plain(self) -> None:
        p = self.problem
        p.model.zero_grad(set_to_none=True)
        p.loss(p.model).backward()

    def variants(self, quantity: str) -> dict[str, _Variant]:
        """key -> variant computing ``quantity`` (plain first, the reference-free timer)."""
        p = self.problem
        out = {"plain": _Variant("plain forward + loss.backward()", self.plain)}

        def gradkit_fn() -> Any:
            p.model.zero_grad(set_to_none=True)
            with gradkit.per_example.track(p.model, quantity, loss_reduction=p.reduction) as stats:
                p.loss(p.model).backward()
            if quantity == "batch_l2":
                return stats.batch_l2()
            return [getattr(stats[name], quantity) for name in self.names]

        reduction = "" if p.reduction == "mean" else ', loss_reduction="sum"'
        out["gradkit"] = _Variant(
            f'gradkit.per_example.track(model, "{quantity}"{reduction})', gradkit_fn
        )
        if self.bp_model is not None:
            out["backpack"] = self._backpack_variant(quantity)
        out.update(self._opacus_variants(quantity))
        if self.peers:
            naive = "" if quantity == "batch_grad" else f" + naive {_WORDS[quantity]}"
            out["torch_func"] = _Variant(
                f"torch.func vmap(grad) per-example grads{naive}",
                lambda: _reduce(quantity, self.func_grads()),
            )
        return out

    def _backpack_variant(self, quantity: str) -> _Variant:
        p, bp = self.problem, self.bp
        ext_name, attr = _BACKPACK[quantity]
        ext = getattr(bp.extensions, ext_name)
        n = p.n
        # statistics of g_i / N under a mean loss: back to those of g_i
        power = {"variance": 2, "second_moment": 1, "batch_l2": 2, "batch_grad": 1}[quantity]
        if p.reduction == "mean":
            scale = float(n) ** power
        else:
            scale = 1.0 / n if quantity == "second_moment" else 1.0

        def fn() -> Any:
            with _quiet():
                self.bp_model.zero_grad(set_to_none=True)
                with bp.backpack(ext()):
                    p.loss(self.bp_model).backward()
            got: list[Any] = [getattr(q, attr, None) for q in self.bp_model.parameters()]
            if any(g is None for g in got):  # modules it has no extension for: left alone
                raise RuntimeError(_unset(self.bp_model, attr, got))
            return torch.stack(got).sum(0) if quantity == "batch_l2" else got

        def value(r: Any) -> Any:
            return r * scale if isinstance(r, torch.Tensor) else [t * scale for t in r]

        return _Variant(f"BackPACK extend + {ext_name}()", fn, value)

    def _opacus_variants(self, quantity: str) -> dict[str, _Variant]:
        p = self.problem

        def grad_samples() -> list[torch.Tensor]:
            with _quiet():
                self.gsm.zero_grad(set_to_none=True)
                p.loss(self.gsm).backward()
            got = [q.grad_sample for q in self.gsm.parameters()]
            for name, q, g in zip(self.names, self.gsm.parameters(), got, strict=True):
                if g is None or g.shape != (p.n, *q.shape):
                    raise RuntimeError(
                        f"grad_sample of {name}: expected shape {(p.n, *q.shape)} (one "
                        f"gradient per example), got {None if g is None else tuple(g.shape)}"
                    )
            return got

        if quantity == "batch_l2":
            if self.ghost is None:
                return {}

            def ghost() -> torch.Tensor:
                with _quiet():
                    self.ghost.zero_grad(set_to_none=True)
                    p.loss(self.ghost).backward()
                    return self.ghost.get_norm_sample()

            return {
                "opacus": _Variant(
                    "Opacus GradSampleModuleFastGradientClipping ghost norms",
                    ghost,
                    lambda r: r.square(),
                )
            }
        if self.gsm is None:
            return {}
        naive = "" if quantity == "batch_grad" else f" + naive {_WORDS[quantity]}"
        return {
            "opacus": _Variant(
                f"Opacus GradSampleModule grad_sample{naive}",
                lambda: _reduce(quantity, grad_samples()),
            )
        }


def _case(runner: _Runner, quantity: str, grads: list[torch.Tensor], mode: str) -> Case:
    p = runner.problem
    variants = runner.variants(quantity)
    ref = _reference(quantity, grads)
    scales = [float(t.abs().max()) or 1.0 for t in _parts(ref)]

    expected = _relative(ref, scales)

    def value(v: _Variant) -> Callable[[Any], torch.Tensor]:
        return lambda r: _relative(v.value(r), scales)

    notes = [
        "Differences are relative: every parameter's result (the norms: the whole vector) is "
        "divided by the largest magnitude of its reference before comparing. The variance is "
        "compared so too, as its rounding error in float32 scales with the second moment."
    ]
    notes += p.notes + runner.notes
    goal = _GOALS.get((p.key, quantity))
    methods = [Method("plain", variants["plain"].label, variants["plain"].fn, None)]
    for key, v in variants.items():
        if key == "plain":
            continue
        error = _error_of(v.fn)  # one call before the case runs: does the method run at all?
        if error is None:
            methods.append(Method(key, v.label, v.fn, value(v)))
        elif key == "gradkit":
            methods.append(Method(key, v.label, _guarded(v.fn), _nan_if_failed(value(v), expected)))
            notes.append(
                f"gradkit raised {error}. Its result counts as a mismatch (NaN), its time is "
                f"that until the error, and its goal ({goal}) is not judged."
            )
            goal = None
        else:
            notes.append(
                f"{_PEERS[key]} fails on this model here (left out of this case): `{v.label}` "
                f"raised {error}."
            )
    targets = [Target(f"gradkit {_WORDS[quantity]} / plain", "gradkit", ("plain",), "<=", goal)]
    if mode == "quick":
        notes.append(_PEER_SKIP_QUICK)
    kept = {m.key for m in methods}
    if "backpack" in kept and p.reduction == "mean":
        notes.append(
            "BackPACK gives the statistics of g_i / N under a mean loss; its results are "
            "rescaled to those of g_i outside the timed call."
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
            "torch.func vmap(grad) per-example gradients (float32), reduced in float64",
            expected,
        ),
        dtype=torch.float32,
        targets=targets,
        notes=notes,
        # the slowest cases (every method materializes [N, *param]): 12 rounds in full runs
        repeats_scale=0.4 if quantity == "batch_grad" else 1.0,
    )


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
        batch = _SMOKE_BATCH[key] if mode == "smoke" else None
        try:
            problem = _problem(key, seed + MODELS.index(key), batch)
        except ImportError as error:
            if key not in _NEEDS:
                raise
            skipped.append(
                f"The `{key}` cases are skipped: {_NEEDS[key]} is not installed "
                f"({type(error).__name__}: {error}; `pip install {_NEEDS[key]}`)."
            )
            continue
        runner = _Runner(problem, peers=mode != "quick")
        if _leaks(problem):
            runner.notes.append(_LEAK_NOTE)
        grads = runner.func_grads()
        for quantity in quantities(key):
            cases.append(_case(runner, quantity, grads, mode))
        del grads
    if not cases:
        raise ValueError(f"per_example suite: no case left to run. {' '.join(skipped)}")
    for case in cases:
        case.notes.extend(skipped)
    return cases


def _leaks(p: _Problem) -> bool:
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


def _tracker_outlives_block(p: _Problem) -> bool:
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

_MEMORY_VARIANTS = ("plain", "gradkit", "backpack", "opacus", "torch_func")
_REPEATED = ("baseline", "plain", "gradkit")  # measured in several processes (the goal's terms)


def _peak_rss_mib() -> float:
    """This process's resident high-water mark: ``VmHWM`` where /proc has it (on Linux,
    ``ru_maxrss`` also counts the parent's RSS at fork time), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes / KiB


def memory_child(argv: list[str]) -> None:
    """Subprocess entry: ``KEY VARIANT THREADS SEED BATCH`` (BATCH 0: the full size). Builds the
    problem and every wrapper, computes VARIANT's variance once (``baseline``: nothing) and
    prints ``{"peak_mib": ...}`` (or ``{"skipped": true}``: a peer not installed) as JSON."""
    key, variant, threads, seed, batch = argv
    torch.set_num_threads(int(threads))
    with _quiet():
        runner = _Runner(_problem(key, int(seed), int(batch) or None))
        fns = runner.variants("variance")
        if variant != "baseline" and variant not in fns:
            print(json.dumps({"skipped": True}))
            return
        if variant != "baseline":
            error = _error_of(fns[variant].fn)
            if error is not None:  # the timed cases report it
                print(json.dumps({"skipped": True, "error": error}))
                return
    print(json.dumps({"peak_mib": _peak_rss_mib()}))


def _run_child(key: str, variant: str, threads: int, seed: int, batch: int) -> float | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    code = "import sys; from gradkit._bench.per_example import memory_child; "
    code += "memory_child(sys.argv[1:])"
    args = [key, variant, str(threads), str(seed), str(batch)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"per_example memory: the subprocess for {key}/{variant} failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
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
            batch=_SMOKE_BATCH[key] if mode == "smoke" else 0,
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

"""How the ``per_example`` suite runs each method on one problem: gradkit, BackPACK, Opacus
and torch.func, with the naive reductions and the reference they are compared with."""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradkit
from gradkit._bench._case import flat, quiet
from gradkit._bench._per_example_hand import hand_written
from gradkit._bench._per_example_problems import WORDS, Problem

__all__ = ["Runner", "Variant", "error_of", "parts", "reference", "relative"]


def _reduce(quantity: str, grads: list[torch.Tensor]) -> Any:
    """The quantity from materialized per-example gradients ``[N, *shape]`` (eager, naive)."""
    if quantity == "variance":
        return [g.square().mean(0) - g.mean(0).square() for g in grads]
    if quantity == "second_moment":
        return [g.square().mean(0) for g in grads]
    if quantity == "batch_l2":
        return torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0)
    return grads


def reference(quantity: str, grads: list[torch.Tensor]) -> Any:
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


def error_of(fn: Callable[[], Any]) -> str | None:
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


def parts(result: Any) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


def relative(result: Any, scales: list[float]) -> torch.Tensor:
    """One flat vector: each parameter's result (``batch_l2``: the whole vector) divided by the
    largest magnitude of its reference, so that differences are relative to that scale."""
    return flat([t / s for t, s in zip(parts(result), scales, strict=True)])


def _backpack() -> Any:
    try:
        with quiet():
            import backpack
            import backpack.extensions
    except ImportError:
        return None
    return backpack


def _opacus() -> Any:
    try:
        with quiet():
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
class Variant:
    """``fn`` computes the quantity; ``value`` maps its result to those of ``g_i``: one tensor
    per parameter, or the ``[N]`` norms."""

    label: str
    fn: Callable[[], Any]
    value: Callable[[Any], Any] = _same


def _vmap_grads(
    p: Problem, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], list[torch.Tensor]]:
    """torch.func's per-example gradients of ``p``'s loss for ``model`` on ``(x, y)``, as a call
    (the torch.func method times it)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(ps: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> Any:
        def f(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, ps, args, kwargs)

        return p.loss_fn(p.call(f, xi[None]), yi[None])

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def grads() -> list[torch.Tensor]:
        with quiet():  # e.g. vmap's note on ops without a batching rule (attention)
            return list(per_example(params, x, y).values())

    return grads


@dataclass
class Runner:
    """Every way to compute each quantity on one problem, as calls of no argument; the peers'
    wrappers are built once, on deep copies with the same weights."""

    problem: Problem
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
        self.func_grads = _vmap_grads(p, p.model, p.x, p.y)

    def reference_grads(self) -> list[torch.Tensor]:
        """The per-example gradients the methods are checked against: torch.func's, in float32
        on the CPU; on CUDA in float64 (cuDNN's float32 weight gradient of a vmapped
        convolution was 5e-3 off on an H200, where gradkit's were 6e-7)."""
        p = self.problem
        if p.x.device.type == "cpu":
            return self.func_grads()
        x = p.x.double() if p.x.is_floating_point() else p.x
        y = p.y.double() if p.y.is_floating_point() else p.y
        return _vmap_grads(p, copy.deepcopy(p.model).double(), x, y)()

    def _wrap(self, peer: str, call: str, wrap: Callable[[nn.Module], Any]) -> Any:
        """``wrap`` of a deep copy of the model (same weights), or None with a note if it
        raises: the peer refuses the model there."""
        try:
            with quiet():
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

    def variants(self, quantity: str) -> dict[str, Variant]:
        """key -> variant computing ``quantity`` (plain first, the reference-free timer)."""
        p = self.problem
        out = {"plain": Variant("plain forward + loss.backward()", self.plain)}

        def gradkit_fn() -> Any:
            p.model.zero_grad(set_to_none=True)
            with gradkit.per_example.track(p.model, quantity, loss_reduction=p.reduction) as stats:
                p.loss(p.model).backward()
            if quantity == "batch_l2":
                return stats.batch_l2()
            return [getattr(stats[name], quantity) for name in self.names]

        reduction = "" if p.reduction == "mean" else ', loss_reduction="sum"'
        out["gradkit"] = Variant(
            f'gradkit.per_example.track(model, "{quantity}"{reduction})', gradkit_fn
        )
        if self.bp_model is not None:
            out["backpack"] = self._backpack_variant(quantity)
        out.update(self._opacus_variants(quantity))
        if self.peers:
            hand = hand_written(p, quantity)
            if hand is not None:  # a reference, not a peer (see _per_example_hand)
                out["hand"] = Variant(*hand)
            naive = "" if quantity == "batch_grad" else f" + naive {WORDS[quantity]}"
            out["torch_func"] = Variant(
                f"torch.func vmap(grad) per-example grads{naive}",
                lambda: _reduce(quantity, self.func_grads()),
            )
        return out

    def _backpack_variant(self, quantity: str) -> Variant:
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
            with quiet():
                self.bp_model.zero_grad(set_to_none=True)
                with bp.backpack(ext()):
                    p.loss(self.bp_model).backward()
            got: list[Any] = [getattr(q, attr, None) for q in self.bp_model.parameters()]
            if any(g is None for g in got):  # modules it has no extension for: left alone
                raise RuntimeError(_unset(self.bp_model, attr, got))
            # the statistic of g_i, as every method gives it (a BackPACK user needs this pass)
            if quantity == "batch_l2":
                return torch.stack(got).sum(0) * scale
            return [t * scale for t in got] if scale != 1.0 else got

        return Variant(f"BackPACK extend + {ext_name}() + rescale to g_i", fn)

    def _opacus_variants(self, quantity: str) -> dict[str, Variant]:
        p = self.problem

        def grad_samples() -> list[torch.Tensor]:
            with quiet():
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
                with quiet():
                    self.ghost.zero_grad(set_to_none=True)
                    p.loss(self.ghost).backward()
                    return self.ghost.get_norm_sample()

            return {
                "opacus": Variant(
                    "Opacus GradSampleModuleFastGradientClipping ghost norms",
                    ghost,
                    lambda r: r.square(),
                )
            }
        if self.gsm is None:
            return {}
        naive = "" if quantity == "batch_grad" else f" + naive {WORDS[quantity]}"
        return {
            "opacus": Variant(
                f"Opacus GradSampleModule grad_sample{naive}",
                lambda: _reduce(quantity, grad_samples()),
            )
        }

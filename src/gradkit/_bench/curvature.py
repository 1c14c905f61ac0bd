"""The ``curvature`` suite: gradkit.curvature against hand-written autograd, torch.func, BackPACK
and curvlinops (when installed), side by side.

Models and goals follow curvature.md sections 3b-3d and 4.1 (CPU, 1 thread):

* products on an MLP 256-256-128-10 (tanh), batch 128, cross entropy, float32 (99,978
  parameters), as ratios to one gradient: HVP from scratch <= 2.5, each extra vector at the same
  point <= 1.5, GGN-vector product from scratch <= 2.2, operator construction <= 2 products;
* estimators on an MLP 16-48-24-3 (tanh), batch 64, cross entropy, float64 (2,067 parameters):
  trace from 100 products within 5 % (Hutch++), top-3 eigenvalues to 1e-5 relative in at most
  64 products, against the dense Hessian; timings as ratios to one gradient. Accuracy figures
  are in the case's extras (the relative errors are of one seeded run and, for the trace, the
  root mean square over 20 seeds).

curvlinops is optional (``pip install curvlinops-for-pytorch`` may replace torch: install it
with ``--no-deps`` next to ``linear_operator``, ``einconv`` and ``opt-einsum``); without it
its methods are skipped with a note.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import gradkit.curvature as gc
from gradkit._bench._case import Case, Method, Target
from gradkit._bench._curvature_estimators import estimator_case
from gradkit._bench._curvature_problem import BP_NOTE, Problem, curvlinops_methods, load_backpack
from gradkit._bench._models import mlp_name, warm_up
from gradkit.func import module_ggnvp

__all__ = ["build_cases"]

_SIZES = (256, 256, 128, 10)
_BATCH = 128
_COLUMNS = 8
_SMALL = (16, 48, 24, 3)
_SMALL_BATCH = 64


def _hvp_case(p: Problem) -> Case:
    H = gc.Hessian(p.model, F.cross_entropy, p.batch)
    V = torch.cat([p.v[:, None], torch.randn(p.n, _COLUMNS - 1)], dim=1)

    def double_backward() -> tuple[torch.Tensor, ...]:
        g = torch.autograd.grad(p.loss(), p.params, create_graph=True)
        return torch.autograd.grad(g, p.params, p.vs)

    methods = [
        Method("grad", "torch.autograd.grad(loss, params) (one gradient)", p.grad, None),
        Method(
            "hvp",
            "Hessian(model, loss_fn, batch) @ v (from scratch)",
            lambda: gc.Hessian(p.model, F.cross_entropy, p.batch) @ p.v,
        ),
        Method("extra", "H @ v, H prebuilt (each extra vector)", lambda: H @ p.v),
        Method(
            "matmat",
            f"H @ V, V with {_COLUMNS} columns (per column)",
            lambda: H @ V,
            lambda r: r[:, 0],
            units=_COLUMNS,
        ),
        Method(
            "build",
            "Hessian(model, loss_fn, batch) (construction)",
            lambda: gc.Hessian(p.model, F.cross_entropy, p.batch),
            None,
        ),
        Method(
            "double_backward", "hand-written double backward (autograd.grad twice)", double_backward
        ),
    ]
    notes = []
    bp = load_backpack()
    if bp is None:
        notes.append(BP_NOTE)
    else:
        hvp = bp.hessianfree.hvp.hessian_vector_product
        methods.append(
            Method(
                "backpack",
                "BackPACK hessian_vector_product (incl. forward)",
                lambda: hvp(p.loss(), p.params, p.vs),
            )
        )
    methods += curvlinops_methods(p, "HessianLinearOperator", notes)
    return Case(
        key="curvature_hvp",
        title=f"Hessian-vector products of the loss of an {mlp_name(_SIZES)} ({p.n} parameters)",
        setup=p.setup(),
        methods=methods,
        baseline=("grad",),
        reference="double_backward",
        dtype=p.x.dtype,
        targets=[
            Target("HVP from scratch / gradient", "hvp", ("grad",), "<=", 2.5),
            Target("each extra vector / gradient", "extra", ("grad",), "<=", 1.5),
            Target("construction / extra HVP", "build", ("extra",), "<=", 2.0),
        ],
        notes=notes,
        repeats_scale=1.5,
    )


def _ggn_case(p: Problem) -> Case:
    G = gc.GGN(p.model, F.cross_entropy, p.batch)

    def by_hand() -> tuple[torch.Tensor, ...]:
        out = p.model(p.x)
        u = torch.zeros_like(out, requires_grad=True)
        g = torch.autograd.grad(out, p.params, u, create_graph=True)
        (jv,) = torch.autograd.grad(g, u, p.vs)
        od = out.detach().requires_grad_(True)
        (r,) = torch.autograd.grad(F.cross_entropy(od, p.y), od, create_graph=True)
        (hjv,) = torch.autograd.grad(r, od, jv)
        return torch.autograd.grad(out, p.params, hjv)

    names = [n for n, _ in p.model.named_parameters()]
    primal = {n: t.detach() for n, t in zip(names, p.params, strict=True)}
    tangent = dict(zip(names, p.vs, strict=True))
    vdict = dict(tangent)

    def func_jvp_vjp() -> Any:
        def f(ps: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(p.model, ps, (p.x,))

        res = torch.func.jvp(f, (primal,), (tangent,))
        out, jv = res[0], res[1]
        od = out.detach().requires_grad_(True)
        (r,) = torch.autograd.grad(F.cross_entropy(od, p.y), od, create_graph=True)
        (hjv,) = torch.autograd.grad(r, od, jv)
        vjp_fn = torch.func.vjp(f, primal)[1]
        return [vjp_fn(hjv)[0][n] for n in names]

    methods = [
        Method("grad", "torch.autograd.grad(loss, params) (one gradient)", p.grad, None),
        Method(
            "ggnvp",
            "GGN(model, loss_fn, batch) @ v (from scratch)",
            lambda: gc.GGN(p.model, F.cross_entropy, p.batch) @ p.v,
        ),
        Method("extra", "G @ v, G prebuilt (each extra vector)", lambda: G @ p.v),
        Method(
            "module",
            "gradkit.func.module_ggnvp(model, loss_fn, batch, v) (one product, nothing kept)",
            lambda: list(module_ggnvp(p.model, F.cross_entropy, p.batch, vdict).values()),
        ),
        Method(
            "build",
            "GGN(model, loss_fn, batch) (construction)",
            lambda: gc.GGN(p.model, F.cross_entropy, p.batch),
            None,
        ),
        Method("by_hand", "hand-written autograd GGNVP (double-backward trick for J v)", by_hand),
        Method("func", "torch.func jvp + loss Hessian + vjp", func_jvp_vjp),
        Method(
            "fisher_mc",
            "Fisher(..., kind='mc') @ v (from scratch, 1 sample)",
            lambda: gc.Fisher(p.model, F.cross_entropy, p.batch) @ p.v,
            None,
        ),
        Method(
            "fisher_emp",
            "Fisher(..., kind='empirical') @ v (from scratch)",
            lambda: gc.Fisher(p.model, F.cross_entropy, p.batch, kind="empirical") @ p.v,
            None,
        ),
    ]
    notes = []
    bp = load_backpack()
    if bp is None:
        notes.append(BP_NOTE)
    else:
        ggnvp = bp.hessianfree.ggnvp.ggn_vector_product

        def backpack_ggnvp() -> Any:
            out = p.model(p.x)
            return ggnvp(F.cross_entropy(out, p.y), out, p.model, p.vs)

        methods.append(
            Method("backpack", "BackPACK ggn_vector_product (incl. forward)", backpack_ggnvp)
        )
    methods += curvlinops_methods(p, "GGNLinearOperator", notes)
    peers = tuple(m.key for m in methods if m.key in ("func", "backpack", "curvlinops"))
    return Case(
        key="curvature_ggnvp",
        title=f"GGN-vector products for the same {mlp_name(_SIZES)} and loss",
        setup=p.setup(),
        methods=methods,
        baseline=("grad",),
        reference="by_hand",
        dtype=p.x.dtype,
        targets=[
            Target("GGNVP from scratch / gradient", "ggnvp", ("grad",), "<=", 2.2),
            Target("one-shot GGNVP (module_ggnvp) / gradient", "module", ("grad",), "<=", 2.2),
            Target("module_ggnvp / the fastest peer", "module", peers, "<=", 1.0),
            Target("each extra vector / gradient", "extra", ("grad",)),
            Target("construction / extra GGNVP", "build", ("extra",), "<=", 2.0),
        ],
        notes=notes,
        repeats_scale=1.5,
    )


def build_cases() -> list[Case]:
    """All cases of the suite (models and data drawn from the current torch RNG state)."""
    warm_up()
    big = Problem(_SIZES, _BATCH, torch.float32)
    small = Problem(_SMALL, _SMALL_BATCH, torch.float64)
    return [_hvp_case(big), _ggn_case(big), estimator_case(small)]

"""The curvature suite's estimator case: stochastic and exact traces, Lanczos eigenvalues and
exact diagonals of a small float64 Hessian, timed as ratios to one gradient; their accuracy
against the dense Hessian (and the MC Fisher's against the GGN) goes into the case's extras."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradkit.curvature as gc
from gradkit._bench._case import Case, Method, Target, quiet
from gradkit._bench._curvature_problem import BP_NOTE, Problem, load_backpack
from gradkit._bench._models import mlp, mlp_name

__all__ = ["estimator_case"]

_PROBES = 100
_SEEDS = 20


class _Counted:
    """An operator that counts the vectors it is applied to."""

    def __init__(self, op: Any) -> None:
        self.op, self.shape, self.dtype, self.device = op, op.shape, op.dtype, op.device
        self.products = 0

    def __matmul__(self, V: torch.Tensor) -> torch.Tensor:
        self.products += 1 if V.dim() == 1 else V.shape[1]
        return self.op @ V


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _gen0() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _accuracy(p: Problem, H: Any, G: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, Any]]:
    def extras(_: dict[str, torch.Tensor]) -> dict[str, Any]:
        Hd, Gd = H.dense(), G.dense()
        exact = float(Hd.trace())
        evals = torch.linalg.eigvalsh(Hd)
        out: dict[str, Any] = {"exact trace": f"{exact:.6g}"}
        for method in ("hutch++", "hutchinson"):
            errs = [
                abs(
                    float(
                        gc.trace(
                            H, _PROBES, method=method, generator=torch.Generator().manual_seed(s)
                        ).value
                    )
                    - exact
                )
                / abs(exact)
                for s in range(_SEEDS)
            ]
            rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
            ok = "" if method != "hutch++" else (" PASS" if errs[0] <= 0.05 else " FAIL")
            out[f"trace {method} ({_PROBES} products) rel. error"] = (
                f"{errs[0]:.4f} (seed 0; target <= 0.05{ok}), RMS over {_SEEDS} seeds {rms:.4f}"
            )
        counted = _Counted(H)
        top = gc.eigenvalues(counted, k=3, generator=_gen0())
        ref = evals[-3:].flip(0)
        err = float(((top - ref).abs() / ref.abs()).max())
        ok = "PASS" if err <= 1e-5 and counted.products <= 64 else "FAIL"
        out["top-3 eigenvalues"] = (
            f"max rel. error {err:.1e} in {counted.products} products (target 1e-5 in <= 64: "
            f"{ok}); exact {', '.join(f'{float(e):.6f}' for e in ref)}"
        )
        with quiet():
            ghost = gc.eigenvalues(H, k=3, max_iter=64, tol=0.0, generator=_gen0())
        out["top-3 after 64 products (tol=0), ghosts"] = (
            f"{', '.join(f'{float(e):.6f}' for e in ghost)} "
            f"({'none' if len(set(ghost.tolist())) == 3 else 'DUPLICATE'})"
        )
        low = gc.eigenvalues(H, k=1, which="smallest", generator=_gen0())
        out["smallest eigenvalue"] = f"{float(low[0]):.6f} (exact {float(evals[0]):.6f})"
        for method in ("hutchinson", "hutch++"):
            d = gc.diagonal(H, _PROBES, method=method, generator=_gen0()).value
            out[f"Hessian diagonal, {method} ({_PROBES} products), rel. L2 error"] = round(
                _rel(d, Hd.diagonal()), 3
            )
        dh = gc.diagonal(H).value
        out["exact Hessian diagonal, max abs diff vs dense"] = float(
            (dh - Hd.diagonal()).abs().max()
        )
        te = float(gc.trace(H, method="exact").value)
        out["trace(H, method='exact') rel. error"] = abs(te - exact) / abs(exact)
        dg = gc.diagonal(G).value
        out["exact GGN diagonal, max abs diff vs dense"] = float((dg - Gd.diagonal()).abs().max())
        mc = gc.Fisher(p.model, F.cross_entropy, p.batch, samples=100, generator=_gen0()).dense()
        out["MC Fisher (100 samples), rel. Frobenius error vs GGN"] = round(_rel(mc, Gd), 4)
        return out

    return extras


def estimator_case(p: Problem) -> Case:
    """Traces, eigenvalues and diagonals of the Hessian of ``p``, timed as ratios to one gradient,
    with their accuracy against the dense Hessian in the case's extras."""
    H = gc.Hessian(p.model, F.cross_entropy, p.batch)
    G = gc.GGN(p.model, F.cross_entropy, p.batch)

    methods = [
        Method("grad", "torch.autograd.grad(loss, params) (one gradient)", p.grad, None),
        Method(
            "hutchpp",
            f"trace(H, {_PROBES}) (Hutch++)",
            lambda: gc.trace(H, _PROBES, generator=_gen0()),
            None,
        ),
        Method(
            "hutchinson",
            f"trace(H, {_PROBES}, method='hutchinson')",
            lambda: gc.trace(H, _PROBES, method="hutchinson", generator=_gen0()),
            None,
        ),
        Method(
            "trace_exact",
            "trace(H, method='exact') (sum of the exact diagonal)",
            lambda: gc.trace(H, method="exact"),
            None,
        ),
        Method(
            "eig", "eigenvalues(H, k=3)", lambda: gc.eigenvalues(H, k=3, generator=_gen0()), None
        ),
        Method(
            "diag_ggn",
            "diagonal(GGN(...)) (exact, MLP sweep; construction included)",
            lambda: gc.diagonal(gc.GGN(p.model, F.cross_entropy, p.batch)),
            None,
        ),
        Method(
            "diag_h",
            "diagonal(Hessian(...)) (exact, MLP sweep)",
            lambda: gc.diagonal(gc.Hessian(p.model, F.cross_entropy, p.batch)),
            None,
        ),
        Method(
            "dense",
            "Hessian(...).dense()",
            lambda: gc.Hessian(p.model, F.cross_entropy, p.batch).dense(),
            None,
        ),
    ]
    notes = [
        "Exact diagonals: the Hessian's by one sweep of per-example Hessian blocks (sequential "
        "MLPs; other models take P products with unit vectors); the GGN's by one sweep of the "
        "output factors (closed form for cross entropy) through the layers of a sequential MLP "
        "(other models: per-example gradients, one backward per factor). gradkit's GGN row "
        "includes building the operator (one forward: the graphs of its products are built "
        "at the first product, which a diagonal never takes), BackPACK's one forward and "
        "backward with its extension."
    ]
    bp = load_backpack()
    if bp is None:
        notes.append(BP_NOTE)
    else:
        ext = bp.extensions
        with quiet(stderr=True):
            bp_model = bp.extend(mlp(p.sizes, p.x.dtype))
            bp_model.load_state_dict(p.model.state_dict())
            bp_loss = bp.extend(nn.CrossEntropyLoss())

        def bp_diag(extension: Any) -> Callable[[], Any]:
            def run() -> Any:
                with quiet(stderr=True), bp.backpack(extension()):
                    bp_loss(bp_model(p.x), p.y).backward()
                return None

            return run

        methods.append(
            Method("bp_diag_ggn", "BackPACK DiagGGNExact", bp_diag(ext.DiagGGNExact), None)
        )
        methods.append(Method("bp_diag_h", "BackPACK DiagHessian", bp_diag(ext.DiagHessian), None))
    return Case(
        key="curvature_estimators",
        title=f"Trace, eigenvalues and diagonals of the Hessian of an {mlp_name(p.sizes)} "
        f"({p.n} parameters)",
        setup=p.setup(),
        methods=methods,
        baseline=("grad",),
        reference=None,
        dtype=p.x.dtype,
        targets=[
            Target("trace, 100 products (Hutch++) / gradient", "hutchpp", ("grad",)),
            Target("top-3 eigenvalues / gradient", "eig", ("grad",)),
            Target("exact GGN diagonal / gradient", "diag_ggn", ("grad",), "<=", 8.0),
            Target("exact Hessian diagonal / gradient", "diag_h", ("grad",), "<=", 30.0),
            *(
                [
                    Target(
                        "exact GGN diagonal / BackPACK DiagGGNExact",
                        "diag_ggn",
                        ("bp_diag_ggn",),
                        "<=",
                        1.0,
                    )
                ]
                if bp is not None
                else []
            ),
        ],
        notes=notes,
        repeats_scale=1 / 3,
        extras=_accuracy(p, H, G),
    )

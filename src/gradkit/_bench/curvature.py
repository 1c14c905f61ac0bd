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

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradkit.curvature as gc
from gradkit._bench._case import Case, Method, Target
from gradkit._bench._models import mlp, mlp_name, warm_up

__all__ = ["build_cases"]

_SIZES = (256, 256, 128, 10)
_BATCH = 128
_COLUMNS = 8
_SMALL = (16, 48, 24, 3)
_SMALL_BATCH = 64
_PROBES = 100
_SEEDS = 20


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _curvlinops() -> Any:
    try:
        with _quiet():
            import curvlinops
    except Exception:  # ImportError, or a broken install against this torch
        return None
    return curvlinops


def _backpack() -> Any:
    try:
        with _quiet():
            import backpack
            import backpack.extensions
            import backpack.hessianfree.ggnvp
            import backpack.hessianfree.hvp
    except Exception:
        return None
    return backpack


_CL_NOTE = (
    "curvlinops is not installed (optional; `pip install curvlinops-for-pytorch` would replace "
    "torch here): its methods are skipped."
)
_BP_NOTE = "BackPACK is not installed (`pip install --no-deps backpack-for-pytorch`): skipped."


class _Problem:
    def __init__(self, sizes: tuple[int, ...], batch: int, dtype: torch.dtype) -> None:
        self.sizes = sizes
        self.model = mlp(sizes, dtype)
        self.params = list(self.model.parameters())
        self.x = torch.randn(batch, sizes[0], dtype=dtype)
        self.y = torch.randint(0, sizes[-1], (batch,))
        self.batch = (self.x, self.y)
        self.n = sum(p.numel() for p in self.params)
        self.v = torch.randn(self.n, dtype=dtype)
        self.vs = [
            t.view_as(p)
            for t, p in zip(
                self.v.split([p.numel() for p in self.params]), self.params, strict=True
            )
        ]

    def loss(self) -> torch.Tensor:
        return F.cross_entropy(self.model(self.x), self.y)

    def grad(self) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(self.loss(), self.params)

    def setup(self) -> dict[str, Any]:
        return {
            "model": mlp_name(self.sizes),
            "parameters": self.n,
            "batch": self.x.shape[0],
            "loss": "cross entropy (mean)",
            "dtype": str(self.x.dtype).replace("torch.", ""),
        }


def _curvlinops_methods(p: _Problem, name: str, notes: list[str]) -> list[Method]:
    """curvlinops' operator (built once, without its determinism check) times a vector, and
    its construction with the default check; none (and a note) when it is not installed."""
    cl = _curvlinops()
    if cl is None:
        notes.append(_CL_NOTE)
        return []
    cls = getattr(cl, name)
    loss = nn.CrossEntropyLoss()  # curvlinops needs the loss module (its GGN dispatches on it)

    def build(check: bool) -> Any:
        with _quiet():
            return cls(p.model, loss, p.params, [p.batch], check_deterministic=check)

    op = build(False)
    return [
        Method("curvlinops", f"curvlinops {name} @ v", lambda: op @ p.v),
        Method(
            "curvlinops_build",
            f"curvlinops {name}(...) construction (default check_deterministic=True)",
            lambda: build(True),
            None,
        ),
    ]


def _hvp_case(p: _Problem) -> Case:
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
    bp = _backpack()
    if bp is None:
        notes.append(_BP_NOTE)
    else:
        hvp = bp.hessianfree.hvp.hessian_vector_product
        methods.append(
            Method(
                "backpack",
                "BackPACK hessian_vector_product (incl. forward)",
                lambda: hvp(p.loss(), p.params, p.vs),
            )
        )
    methods += _curvlinops_methods(p, "HessianLinearOperator", notes)
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


def _ggn_case(p: _Problem) -> Case:
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
    bp = _backpack()
    if bp is None:
        notes.append(_BP_NOTE)
    else:
        ggnvp = bp.hessianfree.ggnvp.ggn_vector_product

        def backpack_ggnvp() -> Any:
            out = p.model(p.x)
            return ggnvp(F.cross_entropy(out, p.y), out, p.model, p.vs)

        methods.append(
            Method("backpack", "BackPACK ggn_vector_product (incl. forward)", backpack_ggnvp)
        )
    methods += _curvlinops_methods(p, "GGNLinearOperator", notes)
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
            Target("each extra vector / gradient", "extra", ("grad",)),
            Target("construction / extra GGNVP", "build", ("extra",), "<=", 2.0),
        ],
        notes=notes,
        repeats_scale=1.5,
    )


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


def gen0() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _accuracy(p: _Problem, H: Any, G: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, Any]]:
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
        top = gc.eigenvalues(counted, k=3, generator=gen0())
        ref = evals[-3:].flip(0)
        err = float(((top - ref).abs() / ref.abs()).max())
        ok = "PASS" if err <= 1e-5 and counted.products <= 64 else "FAIL"
        out["top-3 eigenvalues"] = (
            f"max rel. error {err:.1e} in {counted.products} products (target 1e-5 in <= 64: "
            f"{ok}); exact {', '.join(f'{float(e):.6f}' for e in ref)}"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ghost = gc.eigenvalues(H, k=3, max_iter=64, tol=0.0, generator=gen0())
        out["top-3 after 64 products (tol=0), ghosts"] = (
            f"{', '.join(f'{float(e):.6f}' for e in ghost)} "
            f"({'none' if len(set(ghost.tolist())) == 3 else 'DUPLICATE'})"
        )
        low = gc.eigenvalues(H, k=1, which="smallest", generator=gen0())
        out["smallest eigenvalue"] = f"{float(low[0]):.6f} (exact {float(evals[0]):.6f})"
        for method in ("hutchinson", "hutch++"):
            d = gc.diagonal(H, _PROBES, method=method, generator=gen0()).value
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
        mc = gc.Fisher(p.model, F.cross_entropy, p.batch, samples=100, generator=gen0()).dense()
        out["MC Fisher (100 samples), rel. Frobenius error vs GGN"] = round(_rel(mc, Gd), 4)
        return out

    return extras


def _estimator_case(p: _Problem) -> Case:
    H = gc.Hessian(p.model, F.cross_entropy, p.batch)
    G = gc.GGN(p.model, F.cross_entropy, p.batch)

    methods = [
        Method("grad", "torch.autograd.grad(loss, params) (one gradient)", p.grad, None),
        Method(
            "hutchpp",
            f"trace(H, {_PROBES}) (Hutch++)",
            lambda: gc.trace(H, _PROBES, generator=gen0()),
            None,
        ),
        Method(
            "hutchinson",
            f"trace(H, {_PROBES}, method='hutchinson')",
            lambda: gc.trace(H, _PROBES, method="hutchinson", generator=gen0()),
            None,
        ),
        Method(
            "trace_exact",
            "trace(H, method='exact') (sum of the exact diagonal)",
            lambda: gc.trace(H, method="exact"),
            None,
        ),
        Method(
            "eig", "eigenvalues(H, k=3)", lambda: gc.eigenvalues(H, k=3, generator=gen0()), None
        ),
        Method(
            "diag_ggn",
            "diagonal(GGN(...)) (exact, per-example gradients)",
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
        "MLPs; other models take P products with unit vectors), the GGN's from per-example "
        "gradients (one backward per class but one)."
    ]
    bp = _backpack()
    if bp is None:
        notes.append(_BP_NOTE)
    else:
        ext = bp.extensions
        with _quiet():
            bp_model = bp.extend(mlp(_SMALL, torch.float64))
            bp_model.load_state_dict(p.model.state_dict())
            bp_loss = bp.extend(nn.CrossEntropyLoss())

        def bp_diag(extension: Any) -> Callable[[], Any]:
            def run() -> Any:
                with _quiet(), bp.backpack(extension()):
                    bp_loss(bp_model(p.x), p.y).backward()
                return None

            return run

        methods.append(
            Method("bp_diag_ggn", "BackPACK DiagGGNExact", bp_diag(ext.DiagGGNExact), None)
        )
        methods.append(Method("bp_diag_h", "BackPACK DiagHessian", bp_diag(ext.DiagHessian), None))
    return Case(
        key="curvature_estimators",
        title=f"Trace, eigenvalues and diagonals of the Hessian of an {mlp_name(_SMALL)} "
        f"({p.n} parameters)",
        setup=p.setup(),
        methods=methods,
        baseline=("grad",),
        reference=None,
        dtype=p.x.dtype,
        targets=[
            Target("trace, 100 products (Hutch++) / gradient", "hutchpp", ("grad",)),
            Target("top-3 eigenvalues / gradient", "eig", ("grad",)),
            Target("exact GGN diagonal / gradient", "diag_ggn", ("grad",)),
            Target("exact Hessian diagonal / gradient", "diag_h", ("grad",), "<=", 30.0),
        ],
        notes=notes,
        repeats_scale=1 / 3,
        extras=_accuracy(p, H, G),
    )


def build_cases() -> list[Case]:
    """All cases of the suite (models and data drawn from the current torch RNG state)."""
    warm_up()
    big = _Problem(_SIZES, _BATCH, torch.float32)
    small = _Problem(_SMALL, _SMALL_BATCH, torch.float64)
    return [_hvp_case(big), _ggn_case(big), _estimator_case(small)]

"""The ``func`` suite: gradkit.func against torch.func / torch.autograd, side by side.

Models and targets follow curvature.md section 3 and the goals of its section 4.1 (CPU, 1 thread):

* Jacobian of MLPs w.r.t. the input: ``jacobian(mode="auto")`` within 1.1x of the better of
  ``jacrev``/``jacfwd``, where reverse should win (50x100) and where forward should win
  (500x8); per-example Jacobians against ``vmap(jacrev)``/``vmap(jacfwd)`` (reported).
* HVP of an MLP loss w.r.t. its ~100k parameters: one-off ``hvp`` <= 2.5x one gradient, each
  extra vector through a prebuilt operator <= 1.5x; torch.func and torch.autograd.functional
  peers as ratios to the same gradient.
* Full Hessian of a 2067-parameter model: ``hessian`` within 1.1x of
  ``jacrev(jacrev, chunk_size=256)`` and >= 2.5x faster than a Python loop of HVPs.

Every gradient and HVP differentiates the same function w.r.t. the same parameters as the
gradient it is divided by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call, jacfwd, jacrev, vmap

import gradkit.func as gf
from gradkit._bench._case import Case, Method, Target, flat
from gradkit._bench._models import apply_mlp, mlp, mlp_name, warm_up

__all__ = ["build_cases"]


def _jacobian_case(key: str, sizes: Sequence[int], target: float | None, note: str) -> Case:
    model = mlp(sizes).requires_grad_(False)
    x = torch.randn(sizes[0])
    return Case(
        key=key,
        title=f"Jacobian of an {mlp_name(sizes)} w.r.t. a {sizes[0]}-dim input",
        setup={"J": f"{sizes[-1]}x{sizes[0]}", "dtype": "float32"},
        methods=[
            Method(
                "auto",
                'gradkit.func.jacobian(f, x, mode="auto")',
                lambda: gf.jacobian(model, x, mode="auto"),
            ),
            Method(
                "gk_reverse",
                'gradkit.func.jacobian(f, x, mode="reverse")',
                lambda: gf.jacobian(model, x, mode="reverse"),
            ),
            Method(
                "gk_forward",
                'gradkit.func.jacobian(f, x, mode="forward")',
                lambda: gf.jacobian(model, x, mode="forward"),
            ),
            Method("jacrev", "torch.func.jacrev(f)(x)", lambda: jacrev(model)(x)),
            Method("jacfwd", "torch.func.jacfwd(f)(x)", lambda: jacfwd(model)(x)),
            Method("forward", "f(x) (one forward pass, for scale)", lambda: model(x), None),
        ],
        baseline=("jacrev", "jacfwd"),
        reference="jacrev",
        dtype=torch.float32,
        targets=[Target("auto / min(jacrev, jacfwd)", "auto", ("jacrev", "jacfwd"), "<=", target)],
        notes=[note] if note else [],
    )


def _batch_jacobian_case(key: str, sizes: Sequence[int], batch: int) -> Case:
    model = mlp(sizes).requires_grad_(False)
    xb = torch.randn(batch, sizes[0])
    return Case(
        key=key,
        title=f"Per-example Jacobians of an {mlp_name(sizes)}, batch {batch}",
        setup={"J": f"{batch}x{sizes[-1]}x{sizes[0]}", "dtype": "float32"},
        methods=[
            Method(
                "batch_jacobian",
                "gradkit.func.batch_jacobian(f, X)",
                lambda: gf.batch_jacobian(model, xb),
            ),
            Method(
                "bj_reverse",
                'gradkit.func.batch_jacobian(f, X, mode="reverse")',
                lambda: gf.batch_jacobian(model, xb, mode="reverse"),
            ),
            Method(
                "bj_forward",
                'gradkit.func.batch_jacobian(f, X, mode="forward")',
                lambda: gf.batch_jacobian(model, xb, mode="forward"),
            ),
            Method(
                "vmap_jacrev",
                "torch.func.vmap(torch.func.jacrev(f))(X)",
                lambda: vmap(jacrev(model))(xb),
            ),
            Method(
                "vmap_jacfwd",
                "torch.func.vmap(torch.func.jacfwd(f))(X)",
                lambda: vmap(jacfwd(model))(xb),
            ),
        ],
        baseline=("vmap_jacrev", "vmap_jacfwd"),
        reference="vmap_jacrev",
        dtype=torch.float32,
        targets=[
            Target(
                "batch_jacobian / min(vmap(jacrev), vmap(jacfwd))",
                "batch_jacobian",
                ("vmap_jacrev", "vmap_jacfwd"),
            )
        ],
    )


_HVP_SIZES = (256, 256, 128, 10)
_HVP_BATCH = 128
_COLUMNS = 8


def _hvp_cases() -> list[Case]:
    """The HVP, functional (pure function of a parameter tuple) and with the module helpers."""
    model = mlp(_HVP_SIZES)
    params = tuple(p.detach() for p in model.parameters())
    n_params = sum(p.numel() for p in params)
    x = torch.randn(_HVP_BATCH, _HVP_SIZES[0])
    y = torch.randint(0, _HVP_SIZES[-1], (_HVP_BATCH,))
    vs = tuple(torch.randn_like(p) for p in params)
    v_flat = torch.cat([v.reshape(-1) for v in vs])
    v_cols = torch.cat([v_flat[:, None], torch.randn(n_params, _COLUMNS - 1)], dim=1)
    argnums = tuple(range(len(params)))

    def loss(*ps: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(apply_mlp(ps, x), y)

    leaves = [p.clone().requires_grad_(True) for p in params]
    op = gf.hvp_operator(loss, params)
    first = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)

    def double_backward() -> tuple[torch.Tensor, ...]:
        xs = [p.detach().requires_grad_(True) for p in params]
        g = torch.autograd.grad(loss(*xs), xs, create_graph=True)
        return torch.autograd.grad(g, xs, vs)

    setup = {
        "model": mlp_name(_HVP_SIZES),
        "parameters": n_params,
        "batch": _HVP_BATCH,
        "loss": "cross entropy",
        "dtype": "float32",
    }
    functional = Case(
        key="hvp",
        title=f"HVP of the loss of an {mlp_name(_HVP_SIZES)} w.r.t. its {n_params} parameters "
        "(pure function of the parameter tuple)",
        setup=setup,
        methods=[
            Method(
                "grad",
                "torch.autograd.grad(f(*params), params) (one gradient)",
                lambda: torch.autograd.grad(loss(*leaves), leaves),
                None,
            ),
            Method("forward", "f(*params) (forward only, for scale)", lambda: loss(*params), None),
            Method(
                "hvp",
                "gradkit.func.hvp(f, params, v)",
                lambda: gf.hvp(loss, params, vs),
                lambda r: flat(r[1]),
            ),
            Method(
                "op_matvec",
                "op @ v, op = gradkit.func.hvp_operator(f, params) prebuilt",
                lambda: op @ v_flat,
            ),
            Method(
                "op_matmat",
                f"op @ V, V with {_COLUMNS} columns (per column)",
                lambda: op @ v_cols,
                lambda r: r[:, 0],
                units=_COLUMNS,
            ),
            Method(
                "op_build",
                "gradkit.func.hvp_operator(f, params) (one-off construction)",
                lambda: gf.hvp_operator(loss, params),
                None,
            ),
            Method(
                "double_backward",
                "hand-written double backward (autograd.grad twice)",
                double_backward,
            ),
            Method(
                "reuse_backward",
                "hand-written autograd.grad(g, params, v) on a kept graph",
                lambda: torch.autograd.grad(first, leaves, vs, retain_graph=True),
            ),
            Method(
                "fwd_over_rev",
                "torch.func.jvp(torch.func.grad(f), params, v)",
                lambda: torch.func.jvp(torch.func.grad(loss, argnums=argnums), params, vs),
                lambda r: flat(r[1]),
            ),
            Method(
                "af_hvp",
                "torch.autograd.functional.hvp(f, params, v)",
                lambda: torch.autograd.functional.hvp(loss, params, vs),
                lambda r: flat(r[1]),
            ),
            Method(
                "af_vhp",
                "torch.autograd.functional.vhp(f, params, v)",
                lambda: torch.autograd.functional.vhp(loss, params, vs),
                lambda r: flat(r[1]),
            ),
        ],
        baseline=("grad",),
        reference="double_backward",
        dtype=torch.float32,
        targets=[
            Target("hvp / gradient", "hvp", ("grad",), "<=", 2.5),
            Target("hvp_operator @ v / gradient", "op_matvec", ("grad",), "<=", 1.5),
            Target("torch.func jvp(grad) / gradient", "fwd_over_rev", ("grad",)),
        ],
        repeats_scale=1.5,
    )

    batch = (x, y)
    named = dict(model.named_parameters())
    v_named = {n: v for n, v in zip(named, vs, strict=True)}
    mop = gf.module_hvp_operator(model, F.cross_entropy, batch)
    ref = ("hand-written double backward (functional case)", flat(double_backward()))
    module = Case(
        key="module_hvp",
        title=f"HVP of the same loss through the module helpers (nn.Module {mlp_name(_HVP_SIZES)})",
        setup=setup,
        methods=[
            Method(
                "module_grad",
                "torch.autograd.grad(loss(model(x), y), model.parameters())",
                lambda: torch.autograd.grad(F.cross_entropy(model(x), y), list(named.values())),
                None,
            ),
            Method(
                "module_hvp",
                "gradkit.func.module_hvp(model, loss_fn, batch, v)",
                lambda: gf.module_hvp(model, F.cross_entropy, batch, v_named),
                lambda r: flat(list(r.values())),
            ),
            Method(
                "module_op_matvec",
                "op @ v, op = gradkit.func.module_hvp_operator(...) prebuilt",
                lambda: mop @ v_flat,
            ),
            Method(
                "module_op_build",
                "gradkit.func.module_hvp_operator(model, loss_fn, batch)",
                lambda: gf.module_hvp_operator(model, F.cross_entropy, batch),
                None,
            ),
        ],
        baseline=("module_grad",),
        reference=None,
        reference_value=ref,
        dtype=torch.float32,
        targets=[
            Target("module_hvp / gradient", "module_hvp", ("module_grad",), "<=", 2.5),
            Target(
                "module_hvp_operator @ v / gradient",
                "module_op_matvec",
                ("module_grad",),
                "<=",
                1.5,
            ),
        ],
        repeats_scale=1.5,
    )
    return [functional, module]


_HESS_SIZES = (16, 48, 24, 3)
_HESS_BATCH = 64


def _hessian_case() -> Case:
    model = mlp(_HESS_SIZES, torch.float64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    n = flat0.numel()
    x = torch.randn(_HESS_BATCH, _HESS_SIZES[0], dtype=torch.float64)
    y = torch.randint(0, _HESS_SIZES[-1], (_HESS_BATCH,))

    def f(v: torch.Tensor) -> torch.Tensor:
        pieces = {k: t.view(s) for k, t, s in zip(names, v.split(sizes), shapes, strict=True)}
        return F.cross_entropy(functional_call(model, pieces, (x,)), y)

    def hvp_loop() -> torch.Tensor:
        op = gf.hvp_operator(f, flat0)
        eye = torch.eye(n, dtype=flat0.dtype)
        return torch.stack([op @ eye[i] for i in range(n)])

    def symmetry(values: dict[str, torch.Tensor]) -> dict[str, Any]:
        h = values["hessian"].view(n, n)
        return {"max abs asymmetry of gradkit.func.hessian": float((h - h.T).abs().max())}

    return Case(
        key="hessian",
        title=f"Full Hessian of the loss of an {mlp_name(_HESS_SIZES)} ({n} parameters)",
        setup={
            "parameters": n,
            "batch": _HESS_BATCH,
            "loss": "cross entropy",
            "dtype": "float64",
            "f": "loss of a flat parameter vector via functional_call",
        },
        methods=[
            Method("hessian", "gradkit.func.hessian(f, flat)", lambda: gf.hessian(f, flat0)),
            Method(
                "module_hessian",
                "gradkit.func.module_hessian(model, loss_fn, batch, flat=True)",
                lambda: gf.module_hessian(model, F.cross_entropy, (x, y), flat=True),
            ),
            Method(
                "op_dense",
                "gradkit.func.hvp_operator(f, flat).to_dense()",
                lambda: gf.hvp_operator(f, flat0).to_dense(),
            ),
            Method(
                "jacrev2",
                "torch.func.jacrev(torch.func.jacrev(f), chunk_size=256)(flat)",
                lambda: jacrev(jacrev(f), chunk_size=256)(flat0),
            ),
            Method(
                "torch_hessian", "torch.func.hessian(f)(flat)", lambda: torch.func.hessian(f)(flat0)
            ),
            Method("hvp_loop", f"Python loop of {n} HVPs (hvp_operator, graph kept)", hvp_loop),
        ],
        baseline=("jacrev2",),
        reference="jacrev2",
        dtype=torch.float64,
        targets=[
            Target("hessian / jacrev(jacrev, chunk 256)", "hessian", ("jacrev2",), "<=", 1.1),
            Target("HVP loop / hessian (speed-up)", "hvp_loop", ("hessian",), ">=", 2.5),
        ],
        repeats_scale=1 / 3,
        extras=symmetry,
    )


def build_cases() -> list[Case]:
    """All cases of the suite (models and data drawn from the current torch RNG state)."""
    warm_up()
    return [
        _jacobian_case("jacobian_50x100", (100, 256, 256, 50), 1.1, ""),
        _jacobian_case(
            "jacobian_500x8",
            (8, 256, 256, 500),
            1.1,
            "Two hidden layers of 256 make forward mode win clearly (8 JVPs against 500 VJPs); "
            "with one hidden layer of 64 (next case) both modes are overhead-bound and tie.",
        ),
        _jacobian_case(
            "jacobian_500x8_small",
            (8, 64, 500),
            None,
            "Overhead-bound shape: the two modes cost about the same here, so there is no "
            "target; the ratio shows what auto mode costs when the choice does not matter.",
        ),
        _batch_jacobian_case("batch_jacobian_50x100", (100, 256, 256, 50), 64),
        _batch_jacobian_case("batch_jacobian_500x8", (8, 256, 256, 500), 16),
        *_hvp_cases(),
        _hessian_case(),
    ]

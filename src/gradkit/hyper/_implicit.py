"""Implicit hypergradients at an inner optimum, matrix-free through Hessian-vector products.

At :math:`\\theta^*` with :math:`\\nabla_\\theta L(\\theta^*, \\lambda) = 0` the implicit function
theorem gives :math:`d\\theta^*/d\\lambda = -H^{-1} \\partial_\\lambda \\nabla_\\theta L` with
:math:`H = \\nabla^2_\\theta L`, so

.. math:: \\frac{dE}{d\\lambda} = \\frac{\\partial E}{\\partial \\lambda}
          - \\left(\\partial_\\lambda \\nabla_\\theta L\\right)^\\top q, \\qquad
          H q = \\nabla_\\theta E.

``q`` is found by conjugate gradients, a truncated Neumann series or fixed-point iteration,
each needing only products :math:`Hv` (double backward through the kept graph of
:math:`\\nabla_\\theta L`); the last term is one more backward pass.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from gradkit._errors import message
from gradkit._tree import leaves, rebuild, structure_of
from gradkit._validate import check_bool, check_callable, check_choice, check_int, check_number
from gradkit.hyper._problem import (
    HyperResult,
    check_hyper,
    check_outer,
    check_params,
    check_scalar,
    hyper_leaves,
    unused_error,
)

__all__ = ["NotStationaryWarning", "implicit"]

logger = logging.getLogger(__name__)

_METHODS = ("cg", "neumann", "fixed_point")
_MAXITER = {"cg": 200, "neumann": 100, "fixed_point": 1000}

HVP = Callable[[torch.Tensor], torch.Tensor]

STATIONARY_TOL = 1e-4
"""Default ``stationary_tol`` of :func:`implicit`."""

_CALL = "implicit(inner_loss, outer_loss, params_star, hyper)"
_UNUSED_FIX = (
    "list only tensors inner_loss or outer_loss close over: implicit differentiates at the "
    "optimum, which optimizer hyperparameters (learning rate, momentum) do not move"
)


class NotStationaryWarning(UserWarning):
    """:func:`implicit` was given a point whose inner gradient is not (close to) zero: the
    implicit function theorem does not hold there, and the result is the hypergradient of
    another problem."""


def _check_stationary(norm: torch.Tensor, w: torch.Tensor, tol: float, call: str) -> None:
    """A :class:`NotStationaryWarning` when ``norm`` (of the inner gradient at ``w``) is above
    ``tol * max(1, ||w||)``."""
    scale = max(1.0, float(w.detach().norm()))
    if float(norm) > tol * scale:
        warnings.warn(
            f"{call}: params_star is not a stationary point of inner_loss: "
            f"||grad inner_loss(params_star)|| = {float(norm):.3g} > stationary_tol * "
            f"max(1, ||params_star||) = {tol:g} * {scale:.3g}; the implicit hypergradient "
            "assumes the gradient is 0, so this is the hypergradient of another problem. "
            "Train the inner problem further (or pass a larger stationary_tol to accept it).",
            NotStationaryWarning,
            stacklevel=3,
        )


def _cg(hvp: HVP, b: torch.Tensor, tol: float, maxiter: int, call: str) -> tuple[torch.Tensor, int]:
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = r @ r
    target = tol * float(b.norm())
    it = 0
    while it < maxiter and float(rs.sqrt()) > target:
        hp = hvp(p)
        it += 1
        curvature = p @ hp
        if float(curvature) <= 0:
            raise ValueError(
                message(
                    call,
                    "inner_loss",
                    "a Hessian that is positive definite at params_star (method='cg')",
                    f"a direction of curvature {float(curvature):.3g}",
                    "pass the parameters of a strict minimum, add damping=..., or use "
                    "method='fixed_point'",
                )
            )
        step = rs / curvature
        x = x + step * p
        r = r - step * hp
        rs_new = r @ r
        p = r + (rs_new / rs) * p
        rs = rs_new
    return x, it


def _neumann(
    hvp: HVP, b: torch.Tensor, alpha: float, terms: int
) -> tuple[torch.Tensor, int, float]:
    """The series, its products, and how much its last term grew over the first (above 1: the
    series diverges, as ``(I - alpha H)`` has an eigenvalue beyond 1 in magnitude)."""
    v, q = b, b
    for _ in range(terms - 1):
        v = v - alpha * hvp(v)
        q = q + v
    growth = float(v.norm()) / max(float(b.norm()), torch.finfo(b.dtype).tiny)
    return alpha * q, max(terms - 1, 0), growth


def _fixed_point(
    hvp: HVP, b: torch.Tensor, alpha: float, tol: float, maxiter: int
) -> tuple[torch.Tensor, int, float]:
    """The iterate, its products, and its residual over the starting one (above 1: the
    iteration diverges)."""
    q = torch.zeros_like(b)
    residual = -b
    start = max(float(b.norm()), torch.finfo(b.dtype).tiny)
    target = tol * start
    it = 0
    while it < maxiter and float(residual.norm()) > target:
        q = q - alpha * residual
        residual = hvp(q) - b
        it += 1
    return q, it, float(residual.norm()) / start


def _largest_eigenvalue(hvp: HVP, like: torch.Tensor, iters: int = 20) -> float:
    gen = torch.Generator(device=like.device).manual_seed(0)
    v = torch.randn(like.shape, generator=gen, dtype=like.dtype, device=like.device)
    value = 0.0
    for _ in range(iters):
        w = hvp(v / v.norm())
        value = float(w.norm())
        if value == 0:
            break
        v = w
    return value


def implicit(
    inner_loss: Callable[..., Any],
    outer_loss: Callable[..., Any],
    params_star: Any,
    hyper: dict[str, torch.Tensor],
    *,
    method: str = "cg",
    batch: Any = None,
    tol: float = 1e-10,
    maxiter: int | None = None,
    alpha: float | None = None,
    damping: float = 0.0,
    stationary_tol: float = STATIONARY_TOL,
    full_output: bool = False,
) -> Any:
    r"""Implicit hypergradient at an inner optimum ``params_star`` (no trajectory needed).

    Solves :math:`(H + \delta I) q = \nabla_\theta E` matrix-free and returns
    :math:`\partial_\lambda E - (\partial_\lambda \nabla_\theta L)^\top q`.

    * ``"cg"``: conjugate gradients, to relative residual ``tol`` or ``maxiter`` products
      (default 200); needs :math:`H` positive definite (a strict minimum).
    * ``"neumann"``: ``maxiter`` terms (default 100) of
      :math:`q = \alpha \sum_{k} (I - \alpha H)^k \nabla_\theta E` -- exactly what truncated
      reverse mode through ``maxiter`` gradient-descent steps of size ``alpha`` gives at a
      fixed point.
    * ``"fixed_point"``: :math:`q \leftarrow q - \alpha (H q - \nabla_\theta E)` to relative
      residual ``tol`` (default ``maxiter`` 1000).

    ``alpha`` defaults to :math:`1 / \lambda_{\max}(H)`, estimated by 20 power iterations.
    The result is only as good as the optimum: at a point that is not stationary it is the
    hypergradient of a different problem. The inner gradient norm
    :math:`\lVert \nabla_\theta L(\theta^*) \rVert` is computed (it is needed anyway), reported
    as ``inner_grad_norm`` with ``full_output=True``, and a :class:`NotStationaryWarning` is
    issued when :math:`\lVert \nabla_\theta L \rVert > \text{stationary\_tol} \cdot
    \max(1, \lVert \theta^* \rVert)` (default ``stationary_tol = 1e-4``; ``math.inf``
    silences it). Optimizer hyperparameters (learning rate, momentum) do not move the
    optimum: listing them raises, as nothing depends on them.

    Args:
        inner_loss: ``inner_loss(params, batch) -> scalar``, closing over hyperparameters.
        outer_loss: ``outer_loss(params) -> scalar``.
        params_star: the (approximate) minimizer of ``inner_loss``; a dict or a tuple.
        hyper: ``name -> tensor`` used by the losses.
        method: ``"cg"``, ``"neumann"`` or ``"fixed_point"``.
        batch: passed to ``inner_loss`` (default None: full batch).
        tol: relative residual at which ``"cg"`` and ``"fixed_point"`` stop.
        maxiter: Hessian-vector products at most in the solve (``"neumann"``: terms of the
            series); the 20 that estimate a default ``alpha`` come on top.
        alpha: step of ``"neumann"`` and ``"fixed_point"``; must be below
            :math:`2 / \lambda_{\max}(H)`.
        damping: :math:`\delta`, added to the Hessian's diagonal.
        stationary_tol: warn when the inner gradient norm at ``params_star`` exceeds
            ``stationary_tol * max(1, ||params_star||)`` (>= 0; ``math.inf``: never).
        full_output: return a :class:`HyperResult` with ``residual``, ``iterations`` and
            ``inner_grad_norm``.

    Returns:
        ``{name: d outer_loss / d hyper[name]}`` shaped like each tensor.

    Examples:
        >>> import torch
        >>> from gradkit import hyper
        >>> X, y = torch.randn(30, 4, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
        >>> l2 = torch.tensor(0.1, dtype=torch.float64)
        >>> def inner(p, batch):
        ...     return 0.5 * ((X @ p["w"] - y) ** 2).mean() + 0.5 * l2 * p["w"] @ p["w"]
        >>> outer = lambda p: 0.5 * ((X[:10] @ p["w"] - y[:10]) ** 2).mean()
        >>> A = X.T @ X / 30 + l2 * torch.eye(4, dtype=torch.float64)
        >>> w_star = torch.linalg.solve(A, X.T @ y / 30)
        >>> g = hyper.implicit(inner, outer, {"w": w_star}, {"l2": l2})
        >>> grad_e = X[:10].T @ (X[:10] @ w_star - y[:10]) / 10
        >>> closed_form = -grad_e @ torch.linalg.solve(A, w_star)
        >>> torch.allclose(g["l2"], closed_form, rtol=1e-8)
        True
    """
    call = _CALL
    check_callable(inner_loss, call, "inner_loss", "a function (params, batch) -> scalar")
    check_callable(outer_loss, call, "outer_loss", "a function params -> scalar")
    check_choice(method, _METHODS, call, "method")
    names, hypers = check_hyper(
        hyper, call, "pass e.g. hyper={'l2': l2} with tensors inner_loss or outer_loss close over"
    )
    params_star = check_params(params_star, call, "params_star")
    if maxiter is None:
        maxiter = _MAXITER[method]
    maxiter = check_int(maxiter, call, "maxiter", low=1, example="100")
    tol = check_number(tol, call, "tol", low=0, example="1e-10")
    damping = check_number(damping, call, "damping", low=0, example="1e-3")
    if alpha is not None:
        alpha = check_number(alpha, call, "alpha", low=0, low_open=True, example="0.1")
    stationary_tol = check_number(
        stationary_tol, call, "stationary_tol", low=0, finite=False, example="1e-3"
    )
    check_bool(full_output, call, "full_output")
    structure = structure_of(params_star, call, "params_star")
    ps = leaves(params_star, structure, call, "params_star")
    shapes = [p.shape for p in ps]
    with hyper_leaves(hypers), torch.enable_grad():
        w = torch.cat([p.detach().reshape(-1) for p in ps]).requires_grad_(True)
        views = rebuild(
            structure,
            [t.view(s) for t, s in zip(w.split([s.numel() for s in shapes]), shapes, strict=True)],
        )
        value = check_scalar(outer_loss(views), call, "outer_loss")
        res = (
            torch.autograd.grad(value, [w, *hypers], retain_graph=True, allow_unused=True)
            if value.requires_grad
            else (None,) * (1 + len(hypers))
        )
        check_outer(call, res[0] is not None)
        assert res[0] is not None
        b = res[0].detach()
        direct = res[1:]
        loss = check_scalar(inner_loss(views, batch), call, "inner_loss")
        (g,) = (
            torch.autograd.grad(loss, w, create_graph=True, allow_unused=True)
            if loss.requires_grad
            else (None,)
        )
        flat_hessian_error = ValueError(
            message(
                call,
                "inner_loss",
                "a loss whose gradient depends on params_star (a nonzero Hessian)",
                "a loss linear in (or independent of) the parameters",
                "check that inner_loss uses params nonlinearly",
            )
        )
        if g is None or not g.requires_grad:
            raise flat_hessian_error
        grad_norm = g.detach().norm()

        def hvp(v: torch.Tensor) -> torch.Tensor:
            (hv,) = torch.autograd.grad(g, w, v, retain_graph=True, allow_unused=True)
            if hv is None:
                raise flat_hessian_error
            return hv + damping * v if damping else hv

        spent = 0
        if method == "cg":
            q, spent = _cg(hvp, b, tol, maxiter, call)
        else:
            step = alpha
            if step is None:
                top = _largest_eigenvalue(hvp, b)  # of H + damping I: hvp adds it
                spent += 20
                step = 1.0 / top if top > 0 else 1.0
            if method == "neumann":
                q, n, growth = _neumann(hvp, b, step, maxiter)
            else:
                q, n, growth = _fixed_point(hvp, b, step, tol, maxiter)
            spent += n
            if not growth <= 1.0:  # diverged (finite or not): say so
                what = "last term" if method == "neumann" else "residual"
                grew = f"grew {growth:.3g}-fold" if math.isfinite(growth) else "grew to inf/nan"
                raise ValueError(
                    message(
                        call,
                        "alpha",
                        "a solve that converges: alpha below 2 / lambda_max of the Hessian "
                        "(plus damping), at a minimum, where the Hessian is positive definite",
                        f"alpha={step:.3g}, whose {method} {what} {grew} over "
                        f"{n} Hessian-vector products (a larger alpha, or a saddle point or "
                        "maximum at params_star)",
                        "lower alpha (or leave it None: 1 / lambda_max), add damping=..., or "
                        "use method='cg', which says where the curvature is not positive",
                    )
                )
        if not bool(torch.isfinite(q).all()):
            raise ValueError(
                message(
                    call,
                    "alpha" if method != "cg" else "inner_loss",
                    "a solve that stays finite"
                    + (" (alpha below 2 / lambda_max of the Hessian)" if method != "cg" else ""),
                    f"non-finite values after {spent} Hessian-vector products",
                    "lower alpha (or leave it None: 1 / lambda_max)"
                    if method != "cg"
                    else "check that inner_loss is finite and twice differentiable at params_star",
                )
            )
        residual = None
        if full_output or method != "neumann":
            residual = (hvp(q) - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny)
            if method != "neumann" and float(residual) > max(tol, 1e-6) * 10:
                logger.warning(
                    "%s: the %s solve stopped at relative residual %.3g after %d products",
                    call,
                    method,
                    float(residual),
                    spent,
                )
        # retain_graph: a hyperparameter may reach the loss through the user's own graph
        mixed = torch.autograd.grad(g, hypers, q.detach(), retain_graph=True, allow_unused=True)
    grads = {}
    for name, h, d, m in zip(names, hypers, direct, mixed, strict=True):
        if d is None and m is None:
            raise unused_error(call, name, _UNUSED_FIX)
        total = torch.zeros_like(h) if d is None else d.detach()
        if m is not None:
            total = total - m.detach()
        grads[name] = total.reshape(h.shape)
    _check_stationary(grad_norm, w, stationary_tol, call)
    if not full_output:
        return grads
    return HyperResult(
        grads,
        value.detach(),
        rebuild(structure, [p.detach() for p in ps]),
        residual,
        spent,
        grad_norm,
    )

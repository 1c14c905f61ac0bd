r"""Linear systems with a curvature operator: ``solve(op + damping, b)`` by conjugate gradients.

The building block of Newton-CG and Hessian-free optimization (Martens 2010), natural-gradient
steps (``(F + \lambda I)^{-1} g``) and influence functions (``H^{-1} \nabla L``): only products
``op @ V`` are needed, one per iteration for all right-hand sides together.

``op + damping`` is a :class:`ShiftedOperator` (``op @ v + damping * v``), itself an operator:
:func:`~gradkit.curvature.trace`, :func:`~gradkit.curvature.diagonal` and
:func:`~gradkit.curvature.eigenvalues` take it too.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import check_number, check_optional_int

__all__ = ["ConvergenceWarning", "ShiftedOperator", "Solution", "check_damping", "solve"]


class ConvergenceWarning(UserWarning):
    """An iterative method stopped at its iteration limit before reaching its tolerance; the
    result it returns is the last iterate (see its ``converged`` and ``residual``)."""


class ShiftedOperator:
    """``op + shift * I`` for a square operator ``op``: what ``op + damping`` builds.

    Products, vectors keyed by parameter (where ``op`` takes them), ``dense()`` and further
    shifts (``op + a + b``) work as on ``op``; ``shape``, ``dtype``, ``device`` and ``names``
    are ``op``'s.

    Example:
        >>> import torch
        >>> from gradkit.curvature import Hessian
        >>> model = torch.nn.Linear(2, 1)
        >>> H = Hessian(model, torch.nn.functional.mse_loss, (torch.randn(5, 2), torch.randn(5, 1)))
        >>> D = H + 0.5
        >>> v = torch.randn(3)
        >>> torch.allclose(D @ v, H @ v + 0.5 * v)
        True
    """

    def __init__(self, op: Any, shift: float) -> None:
        self.op = op
        self.shift = shift
        self.shape = op.shape
        self.dtype = op.dtype
        self.device = op.device
        self.names = getattr(op, "names", None)

    def __matmul__(self, v: Any) -> Any:
        out = self.op @ v
        if isinstance(v, Mapping):
            return {k: out[k] + self.shift * v[k].to(out[k].dtype) for k in out}
        return out + self.shift * v.to(dtype=out.dtype, device=out.device)

    def __add__(self, other: Any) -> ShiftedOperator:
        return ShiftedOperator(self.op, self.shift + check_damping(other, f"{self!r} + damping"))

    __radd__ = __add__

    def dense(self) -> torch.Tensor:
        """The matrix ``op.dense() + shift * I``."""
        d = self.op.dense()
        return d + self.shift * torch.eye(d.shape[0], dtype=d.dtype, device=d.device)

    def flatten(self, tensors: Any) -> torch.Tensor:
        return self.op.flatten(tensors)

    def as_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(self.op.as_dict(vector))

    def __repr__(self) -> str:
        return f"({self.op!r} + {self.shift:g})"


def check_damping(value: Any, call: str) -> float:
    """The ``damping`` of ``op + damping``: a finite real number."""
    return check_number(value, call, "damping", example=1e-3)


class Solution(NamedTuple):
    """The result of :func:`solve`.

    Attributes:
        x: the solution, shaped like ``b`` (``[P]``, ``[P, k]`` or a dict keyed like
            ``op.names``).
        iterations: conjugate-gradient iterations (one product ``op @ V`` each).
        residual: ``||b - op x|| / ||b||`` of the returned ``x``, per column of ``b`` (a
            0-dim tensor for a vector), float64; 0 for a zero right-hand side.
        converged: whether every column reached ``rtol``.
    """

    x: Any
    iterations: int
    residual: torch.Tensor
    converged: bool


def solve(
    op: Any,
    b: Any,
    *,
    rtol: float | None = None,
    maxiter: int | None = None,
    x0: Any = None,
) -> Solution:
    r"""Solve ``op x = b`` for a symmetric positive definite operator by conjugate gradients.

    Damping is part of the operator: ``solve(op + damping, b)`` solves ``(op + \lambda I) x =
    b``. Every right-hand side (the columns of ``b``) runs its own CG recurrence, all of them
    through one product ``op @ V`` per iteration; the arithmetic is float64 whatever the
    operator's dtype, and a column stops changing once ``||b - op x|| <= rtol * ||b||``. Each
    iteration reads its residuals on the host (the stopping test).

    Args:
        op: a curvature operator (:class:`Hessian`, :class:`GGN`, :class:`Fisher`, or one shifted
            by ``+ damping``), a :class:`gradkit.func.HVPOperator`, or a square tensor.
        b: ``[P]``, ``[P, k]`` (k systems), or a dict keyed like ``op.names``.
        rtol: relative residual to reach, in (0, 1) (default: the square root of the
            operator's machine epsilon, 1.5e-8 in float64 and 3.5e-4 in float32, about what
            products in that dtype allow on a moderately conditioned system).
        maxiter: the most iterations (default: ``min(P, 1000)``; CG needs at most ``P`` in
            exact arithmetic, far fewer on a well-conditioned or damped operator).
        x0: a starting guess shaped like ``b`` (default: zeros).

    Returns:
        A :class:`Solution` ``(x, iterations, residual, converged)``. When ``maxiter`` runs out
        first, ``x`` is the last iterate, ``converged`` is False and a
        :class:`ConvergenceWarning` says how far it got.

    Raises:
        GradkitError: the operator has a direction of zero or negative curvature
            (``p^T op p <= 0``: it is not positive definite, e.g. a Hessian away from a
            minimum), with the curvature found and what to do (damping above ``-lambda_min``,
            or the positive semi-definite GGN or Fisher).

    Example:
        >>> import torch
        >>> from gradkit.curvature import GGN, solve
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
        ...                             torch.nn.Linear(4, 2)).double()
        >>> x, y = torch.randn(16, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
        >>> G = GGN(model, torch.nn.functional.cross_entropy, (x, y))
        >>> g = torch.randn(G.shape[0], dtype=torch.float64)
        >>> sol = solve(G + 1e-2, g, rtol=1e-10)
        >>> dense = torch.linalg.solve(G.dense() + 1e-2 * torch.eye(G.shape[0]), g)
        >>> sol.converged, torch.allclose(sol.x, dense, rtol=1e-7, atol=1e-9)
        (True, True)
    """
    from gradkit.curvature._estimators import LinearOp, label

    call = f"solve({label(op) if not isinstance(op, ShiftedOperator) else repr(op)}, b)"
    A = LinearOp(op, call)
    if rtol is None:
        rtol = torch.finfo(A.dtype).eps ** 0.5
    rtol = check_number(rtol, call, "rtol", low=0, high=1, low_open=True, high_open=True)
    maxiter = check_optional_int(maxiter, call, "maxiter", low=1)
    limit = maxiter if maxiter is not None else min(A.n, 1000)
    B, restore = _columns(op, b, A.n, call, "b")
    X = torch.zeros_like(B) if x0 is None else _columns(op, x0, A.n, call, "x0", like=B)[0]
    R = B - A(X) if x0 is not None else B.clone()
    target = rtol * torch.linalg.vector_norm(B, dim=0)
    rs = (R * R).sum(0)
    D = R.clone()
    iterations = 0
    while True:
        active = rs.sqrt() > target
        if not bool(active.any()) or iterations == limit:
            break
        AD = A(D)
        curvature = (D * AD).sum(0)
        bad = active & (curvature <= 0)
        if bool(bad.any()):
            _not_positive_definite(call, D, curvature, bad, iterations)
        alpha = torch.where(active, rs / torch.where(active, curvature, 1.0), 0.0)
        X += alpha * D
        R -= alpha * AD
        new = (R * R).sum(0)
        beta = torch.where(active, new / torch.where(active, rs, 1.0), 0.0)
        D = R + beta * D
        rs = new
        iterations += 1
    residual = _relative(B, B - A(X) if iterations else R)
    converged = bool((residual <= rtol).all())
    if not converged:
        worst = float(residual.max())
        warnings.warn(
            ConvergenceWarning(
                f"{call}: stopped at maxiter={limit} iterations with a relative residual of "
                f"{worst:.3g} > rtol={rtol:g}; raise maxiter, add damping (op + damping "
                "improves the conditioning), or accept the larger residual"
            ),
            stacklevel=2,
        )
    return Solution(restore(X), iterations, residual if B.shape[1] > 1 else residual[0], converged)


def _relative(B: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(B, dim=0)
    res = torch.linalg.vector_norm(R, dim=0)
    return torch.where(norm > 0, res / torch.where(norm > 0, norm, 1.0), res)


def _columns(
    op: Any, v: Any, n: int, call: str, argument: str, like: torch.Tensor | None = None
) -> tuple[torch.Tensor, Any]:
    """``v`` as float64 columns ``[n, k]`` and the function giving a result back in its form."""
    if isinstance(v, Mapping) and hasattr(op, "flatten"):
        flat = op.flatten(v)
        return flat.to(torch.float64)[:, None], lambda X: op.as_dict(X[:, 0].to(op.dtype))
    ok = isinstance(v, torch.Tensor) and v.dim() in (1, 2) and v.shape[0] == n
    ok = ok and v.is_floating_point()
    if ok and like is not None:
        ok = (v.shape[1] if v.dim() == 2 else 1) == like.shape[1]
    if not ok:
        expected = f"a floating-point tensor of shape [{n}] or [{n}, k]"
        if hasattr(op, "flatten"):
            expected += ", or a dict keyed like op.names"
        if like is not None:
            expected += f" with as many columns as b ({like.shape[1]})"
        raise ValueError(message(call, argument, expected, describe(v), "flatten it first"))
    cols = v.to(torch.float64)
    if v.dim() == 1:
        return cols[:, None], lambda X: X[:, 0].to(v.dtype)
    return cols, lambda X: X.to(v.dtype)


def _not_positive_definite(
    call: str, D: torch.Tensor, curvature: torch.Tensor, bad: torch.Tensor, iteration: int
) -> None:
    col = int(bad.nonzero()[0, 0])
    norm2 = float(D[:, col].square().sum())
    value = float(curvature[col]) / norm2 if norm2 > 0 else math.nan
    raise GradkitError(
        f"{call}: the operator is not positive definite: CG found a direction of curvature "
        f"p^T A p / p^T p = {value:.3g} <= 0 (iteration {iteration}, column {col}), so the "
        "system has no minimizer to converge to; add damping above the most negative "
        "eigenvalue (solve(op + damping, b), see curvature.eigenvalues(op, which='smallest')),"
        " or use the positive semi-definite GGN or Fisher instead of the Hessian"
    )

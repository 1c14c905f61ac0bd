r"""Extreme eigenvalues (Lanczos) and spectral density (stochastic Lanczos quadrature).

Lanczos builds an orthonormal basis ``Q_m`` of the Krylov space of ``A`` and the tridiagonal
``T_m = Q_m^T A Q_m``, whose eigenvalues (Ritz values) approximate the extreme eigenvalues of
``A``. In floating point the basis loses orthogonality as Ritz values converge and copies of
converged eigenvalues appear ("ghosts": hessian-eigenthings returns 0.690973 twice for a
matrix with one such eigenvalue at 64 iterations). Here every new vector is orthogonalized
against the whole basis, twice, in float64, at every step: no ghosts at any iteration count.
The basis takes ``m * P * 8`` bytes.

Stopping: a Ritz pair ``(theta, Q y)`` has residual ``||A Q y - theta Q y|| = beta_m |y_m|``;
the iteration stops when the ``k`` wanted pairs have residuals below ``tol * max|theta|``
(each eigenvalue then lies within the residual of its Ritz value, within ``residual**2 / gap``
once separated), or at ``max_iter``. An invariant subspace (``beta = 0``) restarts from a random
vector orthogonal to the basis, always (all residuals are 0 there, for that subspace only), and
the iteration goes on until the newest block has converged a value that is not more wanted than
the ``k``-th: exactly repeated eigenvalues are found with their multiplicity once the Krylov
space of the start vector is exhausted. Before that, a single-vector Krylov space holds one copy
of each eigenvalue, so a copy beyond the first is found only after such a restart.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from gradkit._errors import describe, message
from gradkit._validate import check_bool, check_choice, check_int, check_number
from gradkit.curvature._estimators import LinearOp, label, probe_generator

__all__ = ["SpectralDensity", "eigenvalues", "spectral_density"]

_WHICH = ("largest", "smallest", "magnitude")


def _orthogonalize(w: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    for _ in range(2):  # "twice is enough" (Kahan, Parlett)
        w = w - basis.T @ (basis @ w)
    return w


def _check_symmetric(op: Any, call: str) -> None:
    """Refuse a square tensor that is not symmetric (to a few hundred epsilons of its dtype):
    Lanczos finds the eigenvalues of symmetric operators only, and those of another matrix come
    out matching neither its eigenvalues nor its symmetric part's. Operators (curvature,
    ``HVPOperator``) are symmetric by construction."""
    if not isinstance(op, torch.Tensor) or op.numel() == 0:
        return
    gap = float((op - op.mT).abs().max())
    scale = float(op.abs().max())
    if gap > 256 * torch.finfo(op.dtype).eps * scale:
        raise ValueError(
            message(
                call,
                "op",
                "a symmetric matrix (Lanczos finds the eigenvalues of symmetric operators)",
                f"a {tuple(op.shape)} tensor with max |A - A^T| = {gap:.3g} (max |A| = "
                f"{scale:.3g})",
                "pass its symmetric part (A + A.T) / 2 if that is meant, or use "
                "torch.linalg.eigvals for a general matrix",
            )
        )


def _key(theta: torch.Tensor, which: str) -> torch.Tensor:
    """Larger is more wanted."""
    if which == "largest":
        return theta
    if which == "smallest":
        return -theta
    return theta.abs()


def _order(theta: torch.Tensor, which: str) -> torch.Tensor:
    """Indices of ``theta``, most wanted first."""
    return torch.argsort(_key(theta, which), descending=True)


def _lanczos(
    A: LinearOp,
    v0: torch.Tensor,
    steps: int,
    *,
    gen: torch.Generator | None,
    done: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``steps`` Lanczos steps from ``v0``; returns ``(alpha [m], beta [m], Q [m, n])``.

    ``done(alpha, beta)`` may stop early; ``gen`` restarts after a breakdown (else it stops).
    """
    n = A.n
    Q = torch.zeros(steps, n, dtype=torch.float64, device=A.device)
    alpha = torch.zeros(steps, dtype=torch.float64, device="cpu")
    beta = torch.zeros(steps, dtype=torch.float64, device="cpu")
    q = v0 / torch.linalg.vector_norm(v0)
    # an invariant subspace leaves the rounding of the products: a few hundred machine
    # epsilons of the operator's dtype in float32 (3.7e-5 relative where an exhausted float32
    # space was read as converged and repeated eigenvalues were lost), 1e-15 in float64
    eps = torch.finfo(A.dtype).eps
    floor = max(1e-12, min(1e3 * eps, math.sqrt(eps)))
    scale = 0.0
    m = 0
    for j in range(steps):
        Q[j] = q
        m = j + 1
        w = A(q[:, None])[:, 0]
        alpha[j] = a = torch.dot(q, w)
        w = _orthogonalize(w, Q[: j + 1])
        b = float(torch.linalg.vector_norm(w))
        scale = max(scale, abs(float(a)) + b)
        exhausted = b <= floor * max(scale, 1e-300)  # an invariant subspace
        beta[j] = 0.0 if exhausted else b
        if exhausted and gen is not None and j + 1 < min(steps, n):
            # every Ritz residual is 0 here, but only for the space spanned so far: the rest
            # (another copy of a found eigenvalue included) is reached from a new vector
            r = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device)
            w = _orthogonalize(r.to(A.device), Q[: j + 1])
            q = w / torch.linalg.vector_norm(w)
            continue
        if done is not None and done(alpha[: j + 1], beta[: j + 1]):
            break
        if j + 1 == min(steps, n) or exhausted:
            break
        q = w / b
    return alpha[:m], beta[:m], Q[:m]


def _tridiagonal(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    off = beta[:-1]
    return torch.diag(alpha) + torch.diag(off, 1) + torch.diag(off, -1)


def _certified(
    alpha: torch.Tensor,
    beta: torch.Tensor,
    k: int,
    which: str,
    rtol: float,
    residuals: list[float],
) -> bool:
    """Whether the ``k`` wanted Ritz pairs of ``T = tridiag(alpha, beta)`` are eigenpairs of
    the operator within ``rtol`` (relative to the largest Ritz value); their residuals go to
    ``residuals``.

    After a restart (``beta = 0`` where a block ended in an invariant subspace), the newest
    block spans part of the rest of the space, which may hold further copies of the values
    found: it must have converged its most wanted Ritz value, and that value must not be more
    wanted than the ``k``-th one, else the iteration goes on (to the next restart when it is).
    """
    theta, Y = torch.linalg.eigh(_tridiagonal(alpha, beta))
    idx = _order(theta, which)[:k]
    tol = rtol * float(theta.abs().max())
    res = (beta[-1] * Y[-1, idx]).abs()
    residuals[:] = res.tolist()
    breaks = (beta[:-1] == 0).nonzero()
    if len(breaks):
        start = int(breaks[-1]) + 1
        t_new, Y_new = torch.linalg.eigh(_tridiagonal(alpha[start:], beta[start:]))
        best = int(torch.argmax(_key(t_new, which)))
        res_new = abs(float(beta[-1] * Y_new[-1, best]))
        residuals.append(res_new)
        if res_new > tol:
            return False
        if float(_key(t_new[best], which)) > float(_key(theta[idx[-1]], which)) + tol:
            return False
    return bool((res <= tol).all())


@overload
def eigenvalues(
    op: Any,
    k: int = 3,
    *,
    which: str = "largest",
    max_iter: int | None = None,
    tol: float | None = None,
    return_vectors: Literal[False] = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor: ...


@overload
def eigenvalues(
    op: Any,
    k: int = 3,
    *,
    which: str = "largest",
    max_iter: int | None = None,
    tol: float | None = None,
    return_vectors: Literal[True],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def eigenvalues(
    op: Any,
    k: int = 3,
    *,
    which: str = "largest",
    max_iter: int | None = None,
    tol: float | None = None,
    return_vectors: bool,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def eigenvalues(
    op: Any,
    k: int = 3,
    *,
    which: str = "largest",
    max_iter: int | None = None,
    tol: float | None = None,
    return_vectors: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""The ``k`` extreme eigenvalues of a symmetric operator by Lanczos with full
    reorthogonalization.

    .. math:: A Q_m = Q_m T_m + \beta_m q_{m+1} e_m^\top, \qquad
              \lambda_i(A) \approx \theta_i(T_m)

    Args:
        op: a curvature operator, :class:`gradkit.func.HVPOperator` or symmetric tensor.
        k: how many eigenvalues.
        which: ``"largest"`` (algebraic), ``"smallest"`` (algebraic, the most negative first)
            or ``"magnitude"`` (largest absolute value); indefinite spectra are fine.
        max_iter: the most products (default ``min(P, max(64, 4 k))``).
        tol: residual tolerance relative to the largest Ritz value (default: the square root
            of the operator dtype's machine epsilon, 1.5e-8 for float64); 0 runs all
            ``max_iter`` steps.
        return_vectors: also return the eigenvectors ``[P, k]``.
        generator: a ``torch.Generator`` for the starting vector.

    Returns:
        ``values [k]`` (ordered as ``which`` says, in the operator's dtype), or ``(values,
        vectors)``. Warns when ``max_iter`` products did not reach ``tol``.

    Examples:
        >>> import torch
        >>> from gradkit.curvature import eigenvalues
        >>> A = torch.diag(torch.tensor([3.0, -5.0, 1.0, 0.5], dtype=torch.float64))
        >>> eigenvalues(A, k=2).round(decimals=10)
        tensor([3., 1.], dtype=torch.float64)
        >>> eigenvalues(A, k=1, which="magnitude").round(decimals=10)
        tensor([-5.], dtype=torch.float64)
        >>> values, vectors = eigenvalues(A, k=1, which="smallest", return_vectors=True)
        >>> vectors.abs().T.round(decimals=10)
        tensor([[0., 1., 0., 0.]], dtype=torch.float64)
    """
    call = f"eigenvalues({label(op)})"
    check_choice(which, _WHICH, call, "which")
    A = LinearOp(op, call)
    _check_symmetric(op, call)
    n = A.n
    k = check_int(k, call, "k", low=1, high=n, example=3)
    steps = min(n, max(64, 4 * k)) if max_iter is None else max_iter
    steps = check_int(steps, call, "max_iter", low=k, fix=f"raise max_iter to at least k ({k})")
    steps = min(steps, n)
    check_bool(return_vectors, call, "return_vectors")
    eps = torch.finfo(A.dtype).eps
    rtol = math.sqrt(eps) if tol is None else check_number(tol, call, "tol", low=0, example="1e-6")
    gen = probe_generator(generator, call)
    v0 = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device).to(A.device)
    residuals: list[float] = []

    def done(alpha: torch.Tensor, beta: torch.Tensor) -> bool:
        if len(alpha) < k:
            return False
        return _certified(alpha, beta, k, which, rtol, residuals)

    alpha, beta, Q = _lanczos(A, v0, steps, gen=gen, done=done)
    theta, Y = torch.linalg.eigh(_tridiagonal(alpha, beta))
    idx = _order(theta, which)[:k]
    converged = len(alpha) == n or _certified(alpha, beta, k, which, rtol, residuals)
    if not converged and rtol > 0:
        warnings.warn(
            f"{call}: {k} eigenvalues not converged in {len(alpha)} products (largest relative "
            f"residual {max(residuals) / float(theta.abs().max()):.2g} > tol {rtol:.2g}); "
            "raise max_iter",
            RuntimeWarning,
            stacklevel=2,
        )
    # the small tridiagonal problem is solved on the host: back to the operator's device
    values = theta[idx].to(device=A.device, dtype=A.dtype)
    if not return_vectors:
        return values
    return values, (Q.T @ Y[:, idx].to(Q.device)).to(A.dtype)


@dataclass(frozen=True)
class SpectralDensity:
    """A smoothed spectral density from stochastic Lanczos quadrature, in float64 on the CPU
    (for plotting, whatever the operator's device).

    Attributes:
        grid: ``[G]`` points where the density is evaluated.
        density: ``[G]``, integrating to about 1 over the grid (a probability density of the
            eigenvalues; multiply by ``P`` for eigenvalue counts).
        nodes: ``[probes, steps]`` Ritz values of each probe's Lanczos run (quadrature nodes).
        weights: ``[probes, steps]`` quadrature weights (each row sums to 1).
        width: the Gaussian kernel's standard deviation.
    """

    grid: torch.Tensor
    density: torch.Tensor
    nodes: torch.Tensor
    weights: torch.Tensor
    width: float


def spectral_density(
    op: Any,
    *,
    probes: int = 5,
    steps: int = 64,
    grid: int | torch.Tensor = 1000,
    width: float | None = None,
    generator: torch.Generator | None = None,
) -> SpectralDensity:
    r"""The eigenvalue density of a symmetric operator by stochastic Lanczos quadrature.

    .. math:: \phi(t) = \frac1P \sum_i \delta(t - \lambda_i) \approx \frac1{n_v}
              \sum_{v} \sum_{j=1}^{m} \tau_{vj}\, \mathcal N(t;\ \theta_{vj}, \sigma^2)

    with ``theta_vj`` the Ritz values of ``m`` Lanczos steps from a normalized Rademacher
    probe ``v`` and ``tau_vj`` the squared first components of the eigenvectors of ``T_m``
    (Golub and Meurant; Ghorbani, Krishnan and Xiao 2019).

    Args:
        op: a curvature operator, :class:`gradkit.func.HVPOperator` or symmetric tensor.
        probes: random starting vectors (costs ``probes * steps`` products).
        steps: Lanczos steps per probe (fully reorthogonalized).
        grid: the number of evaluation points (spanning the nodes with a margin), or the points.
        width: the Gaussian kernel's standard deviation (default: 1 % of the nodes' range).
        generator: a ``torch.Generator`` for the probes.

    Returns:
        A :class:`SpectralDensity`.

    Examples:
        >>> import torch
        >>> from gradkit.curvature import spectral_density
        >>> A = torch.diag(torch.linspace(-1.0, 2.0, 50, dtype=torch.float64))
        >>> sd = spectral_density(A, probes=2, steps=50, grid=301)
        >>> sd.nodes.shape, round(float(torch.trapezoid(sd.density, sd.grid)), 2)
        (torch.Size([2, 50]), 1.0)
    """
    call = f"spectral_density({label(op)})"
    A = LinearOp(op, call)
    _check_symmetric(op, call)
    probes = check_int(probes, call, "probes", low=1, example=10)
    steps = check_int(steps, call, "steps", low=1, example=10)
    if width is not None:
        width = check_number(width, call, "width", low=0, low_open=True, example="0.01")
    if isinstance(grid, torch.Tensor):
        if grid.dim() != 1 or grid.numel() < 2 or not grid.is_floating_point():
            raise ValueError(
                message(
                    call,
                    "grid",
                    "a 1-D floating-point tensor of at least 2 points, or a number of points",
                    describe(grid),
                    "pass e.g. grid=torch.linspace(lo, hi, 1000)",
                )
            )
    else:
        grid = check_int(grid, call, "grid", low=2, example=1000)
    steps = min(steps, A.n)
    gen = probe_generator(generator, call)
    nodes = torch.zeros(probes, steps, dtype=torch.float64, device="cpu")
    weights = torch.zeros(probes, steps, dtype=torch.float64, device="cpu")
    for p in range(probes):
        z = torch.randint(0, 2, (A.n,), generator=gen, device=gen.device).to(torch.float64)
        alpha, beta, _ = _lanczos(A, (2 * z - 1).to(A.device), steps, gen=None)
        theta, Y = torch.linalg.eigh(_tridiagonal(alpha, beta))
        m = len(theta)
        nodes[p, :m], weights[p, :m] = theta.cpu(), Y[0].square().cpu()
        nodes[p, m:] = theta[-1].cpu()
    lo, hi = float(nodes.min()), float(nodes.max())
    sigma = width if width is not None else max(0.01 * (hi - lo), 1e-12 * max(abs(lo), 1.0))
    if isinstance(grid, torch.Tensor):
        points = grid.to(torch.float64).cpu().reshape(-1)
    else:
        pad = 5 * sigma
        points = torch.linspace(lo - pad, hi + pad, int(grid), dtype=torch.float64, device="cpu")
    density = torch.zeros_like(points)
    for p in range(probes):  # [G, steps] at a time
        kernel = torch.exp(-0.5 * ((points[:, None] - nodes[p]) / sigma) ** 2)
        density += kernel @ weights[p]
    density /= probes * sigma * math.sqrt(2 * math.pi)
    return SpectralDensity(points, density, nodes, weights, sigma)

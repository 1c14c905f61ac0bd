r"""Trace and diagonal of a symmetric operator: exact, Hutchinson and Hutch++.

For Rademacher probes ``z`` (entries +-1), ``E[z^T A z] = tr(A)`` and ``E[z * (A z)] =
diag(A)`` (Hutchinson 1989). Hutch++ (Meyer, Musco, Musco, Woodruff 2021) spends a third of the
products on a sketch ``Q = qr(A S)`` of the dominant range, takes ``tr(Q^T A Q)`` exactly and
Hutchinson only on the deflated rest ``(I - QQ^T) A (I - QQ^T)``; the diagonal version
(Diag++, Baston and Nakatsukasa 2022) adds ``diag(Q Q^T A)`` exactly and estimates
``diag((I - QQ^T) A)``. Both are unbiased. The standard error is the sample standard deviation
of the Hutchinson part over ``sqrt(m)`` (given ``Q`` for Hutch++).

Operators: a :class:`~gradkit.curvature.CurvatureOperator`, a
:class:`gradkit.func.HVPOperator`, a square tensor, or any object with ``shape == (n, n)``
whose ``@`` takes ``[n, k]`` tensors.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import check_choice, check_int, check_number
from gradkit.curvature._base import DENSE_MAX, CurvatureOperator, exact_diagonal_of, operator_call
from gradkit.curvature._data import check_generator
from gradkit.curvature._diag import unit_diagonal
from gradkit.curvature._solve import ConvergenceWarning

__all__ = ["Estimate", "LinearOp", "diagonal", "label", "probe_generator", "trace"]

_MAX_MEMORY = 256 * 2**20


class Estimate(NamedTuple):
    """An estimate with its standard error.

    Attributes:
        value: the estimate (a 0-dim float64 tensor for the trace; ``[P]`` for the diagonal).
        stderr: its standard error, shaped like ``value`` (zeros for exact methods).
        probes: the random probe vectors used (0 for exact methods).
    """

    value: torch.Tensor
    stderr: torch.Tensor
    probes: int


class LinearOp:
    """``op`` as a function of float64 ``[n, k]`` matrices (products in the operator's dtype)."""

    def __init__(self, op: Any, call: str) -> None:
        shape = getattr(op, "shape", None)
        ok = (
            shape is not None
            and len(shape) == 2
            and shape[0] == shape[1]
            and hasattr(op, "__matmul__")
        )
        if not ok:
            raise TypeError(
                message(
                    call,
                    "op",
                    "a square operator: a curvature operator, gradkit.func.HVPOperator or a "
                    "square tensor",
                    describe(op),
                    "build one with gradkit.curvature.Hessian(model, loss_fn, data)",
                )
            )
        self.op = op
        self.call = call
        self.n = int(shape[0])  # type: ignore[index]
        self.dtype = getattr(op, "dtype", torch.float32)
        self.device = getattr(op, "device", torch.device("cpu"))
        self.products = 0
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(
                message(
                    call,
                    "op",
                    "a floating-point operator (products of float64 probes are cast to its dtype)",
                    f"an operator of dtype {self.dtype}",
                    "convert it, e.g. op.double() for a tensor",
                )
            )
        if isinstance(self.device, torch.device) and self.device.type == "meta":
            raise ValueError(
                message(
                    call,
                    "op",
                    "an operator with values",
                    "one on the meta device (shapes only)",
                    "build it from tensors with values",
                )
            )

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        self.products += V.shape[1] if V.dim() == 2 else 1
        res = self.op @ V.to(dtype=self.dtype, device=self.device)
        if not isinstance(res, torch.Tensor):  # as_tensor would move a tensor to the default device
            res = torch.as_tensor(res, device=self.device)
        if not bool(torch.isfinite(res).all()):
            raise GradkitError(
                f"{self.call}: a product of the operator with finite probe vectors has nan or "
                "inf entries (the loss, its gradient or its curvature is not finite at these "
                "parameters, e.g. after a diverged step); check the loss at the current "
                "parameters before estimating its curvature"
            )
        return res.to(torch.float64)


def label(op: Any) -> str:
    """How an operator is named in error messages."""
    if isinstance(op, CurvatureOperator):
        return operator_call(op)
    # gradkit.func.HVPOperator keeps the call that built it (e.g. "hvp_operator(f)") privately
    return str(getattr(op, "_call", type(op).__name__))


def probe_generator(generator: torch.Generator | None, call: str) -> torch.Generator:
    """``generator``, or a CPU generator seeded from torch's global one (``torch.manual_seed``
    then makes estimates reproducible)."""
    checked = check_generator(generator, call)
    if checked is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
        return torch.Generator().manual_seed(seed)
    return checked


def _rademacher(n: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    z = torch.randint(0, 2, (n, k), generator=gen, device=gen.device, dtype=torch.int8)
    return (z.to(torch.float64) * 2 - 1).to(device)


class _Probes(NamedTuple):
    """The products of Hutch++ (``method="hutch++"``) or Hutchinson (``"hutchinson"``, ``s =
    0``): ``Q`` ``[n, s]`` orthonormal, spanning ``A S`` for ``s = probes // 3`` Rademacher
    columns ``S``, ``AQ = A Q``, and ``Z`` ``[n, m]``, the ``m = probes - 2 s`` Rademacher
    probes of the Hutchinson part; ``probes`` is the checked count."""

    Q: torch.Tensor
    AQ: torch.Tensor
    Z: torch.Tensor
    probes: int


def _probes(A: LinearOp, probes: Any, method: str, gen: torch.Generator, call: str) -> _Probes:
    fix = f"pass more probes for method={method!r}, e.g. probes=100"
    minimum = 2 if method == "hutchinson" else 5
    probes = check_int(probes, call, "probes", low=minimum, fix=fix)
    s = probes // 3 if method == "hutch++" else 0
    Q = AQ = torch.zeros(A.n, 0, dtype=torch.float64, device=A.device)
    if s:
        Q = torch.linalg.qr(A(_rademacher(A.n, s, gen, A.device))).Q
        AQ = A(Q)
    return _Probes(Q, AQ, _rademacher(A.n, probes - 2 * s, gen, A.device), probes)


def exact_diagonal(op: Any, *, max_size: int, max_memory: int, call: str) -> torch.Tensor:
    max_size = check_int(max_size, call, "max_size", low=1, example=DENSE_MAX)
    max_memory = check_int(max_memory, call, "max_memory", low=1, example=_MAX_MEMORY)
    if isinstance(op, torch.Tensor):
        return op.diagonal().clone()
    if isinstance(op, CurvatureOperator):
        d = exact_diagonal_of(op, max_size=max_size, max_memory=max_memory, call=call)
        if not bool(torch.isfinite(d).all()):
            raise GradkitError(
                f"{call}: the exact diagonal has nan or inf entries (the loss or its curvature "
                "is not finite at these parameters); check the loss at the current parameters"
            )
        return d
    A = LinearOp(op, call)
    return unit_diagonal(A, A.n, A.dtype, A.device, max_size=max_size, call=call)


def trace(
    op: Any,
    probes: int = 100,
    *,
    method: str = "hutch++",
    rtol: float | None = None,
    max_probes: int = 1000,
    generator: torch.Generator | None = None,
    max_size: int = DENSE_MAX,
    max_memory: int = _MAX_MEMORY,
) -> Estimate:
    r"""The trace of a symmetric operator, estimated from ``probes`` products.

    .. math:: \operatorname{tr}(A) \approx \operatorname{tr}(Q^\top A Q) + \frac1m \sum_{i=1}^m
              z_i^\top (I - QQ^\top) A (I - QQ^\top) z_i

    (Hutch++: ``Q`` from a third of the products, ``m`` the last third; ``Q = 0`` for
    Hutchinson, ``m = probes``.)

    Args:
        op: a curvature operator, :class:`gradkit.func.HVPOperator` or square tensor.
        probes: operator products to spend (Rademacher probes).
        method: ``"hutch++"`` (default; far smaller error on spectra with a few large
            eigenvalues), ``"hutchinson"``, or ``"exact"`` (the sum of the exact diagonal, see
            :func:`diagonal`).
        rtol: adaptive mode: after the first ``probes`` products, add Hutchinson probes (as
            many again each round, the sketch ``Q`` kept) until ``stderr <= rtol * |value|``
            or ``max_probes`` products are spent; then a :class:`ConvergenceWarning` says
            which relative error was reached. None (default): exactly ``probes`` products.
            What a given ``rtol`` costs depends on the spectrum, not on the method alone: the
            Hutchinson part's error is about ``sqrt(2) ||A'||_F / sqrt(m)`` for the deflated
            ``A'``, so a flat or indefinite spectrum (``||A||_F`` large against ``|tr A|``)
            needs many probes for any estimator. The stopping point depends on the samples
            (runs that overestimate ``|tr|`` stop earlier), so the adaptive estimate is biased
            by up to the order of ``rtol``; a fixed ``probes`` is unbiased.
        max_probes: the most products in adaptive mode (default 1000; at least ``probes``).
        generator: a ``torch.Generator`` for the probes (default: seeded from the global one).
        max_size, max_memory: limits of the exact diagonal (``method="exact"``).

    Returns:
        An :class:`Estimate` with float64 0-dim tensors ``value`` and ``stderr``, and the
        products spent in ``probes``.

    Examples:
        >>> import torch
        >>> from gradkit.curvature import trace
        >>> A = torch.diag(torch.arange(1.0, 101.0, dtype=torch.float64))
        >>> est = trace(A, probes=30, generator=torch.Generator().manual_seed(0))
        >>> abs(float(est.value) - 5050.0) < 4 * float(est.stderr) + 1e-9
        True
        >>> trace(A, method="exact").value
        tensor(5050., dtype=torch.float64)
        >>> est = trace(A, rtol=0.01, generator=torch.Generator().manual_seed(0))
        >>> bool(est.stderr <= 0.01 * est.value.abs()), est.probes <= 1000
        (True, True)
    """
    call = f"trace({label(op)}, method={method!r})"
    check_choice(method, ("hutch++", "hutchinson", "exact"), call, "method")
    A = LinearOp(op, call)
    if method == "exact":
        d = exact_diagonal(op, max_size=max_size, max_memory=max_memory, call=call)
        value = d.to(torch.float64).sum()
        return Estimate(value, torch.zeros_like(value), 0)
    if rtol is not None:
        rtol = check_number(rtol, call, "rtol", low=0, low_open=True, example=0.05)
        max_probes = check_int(max_probes, call, "max_probes", low=1, example=1000)
        if isinstance(probes, int) and not isinstance(probes, bool) and max_probes < probes:
            raise ValueError(
                message(
                    call,
                    "max_probes",
                    f"at least probes ({probes}): the adaptive mode starts with probes products "
                    "and adds more until rtol is met or max_probes are spent",
                    repr(max_probes),
                    f"pass max_probes >= {probes}, or fewer probes",
                )
            )
    gen = probe_generator(generator, call)
    Q, AQ, Z, probes = _probes(A, probes, method, gen, call)
    exact_part = (Q * AQ).sum()

    def hutchinson(Z: torch.Tensor) -> torch.Tensor:
        Z = Z - Q @ (Q.T @ Z)  # deflated: the Hutchinson part sees (I - QQ^T) A (I - QQ^T)
        return (Z * A(Z)).sum(0)

    samples = hutchinson(Z)
    value, stderr = exact_part + samples.mean(), samples.std() / samples.numel() ** 0.5
    if rtol is None:
        return Estimate(value, stderr, probes)
    spent, step = probes, Z.shape[1]
    while float(stderr) > rtol * float(value.abs()) and spent < max_probes:
        more = min(step, max_probes - spent)
        samples = torch.cat([samples, hutchinson(_rademacher(A.n, more, gen, A.device))])
        spent += more
        value, stderr = exact_part + samples.mean(), samples.std() / samples.numel() ** 0.5
    if float(stderr) > rtol * float(value.abs()):
        reached = float(stderr) / float(value.abs()) if float(value) != 0 else math.inf
        warnings.warn(
            ConvergenceWarning(
                f"{call}: the standard error is {reached:.3g} of the estimate after "
                f"max_probes={max_probes} products, above rtol={rtol:g}; the spectrum is "
                "flat or indefinite here (every estimator's error is set by ||A||_F / |tr A| "
                "then): raise max_probes, accept the larger error, or use method='exact'"
            ),
            stacklevel=2,
        )
    return Estimate(value, stderr, spent)


def diagonal(
    op: Any,
    probes: int = 100,
    *,
    method: str = "exact",
    generator: torch.Generator | None = None,
    max_size: int = DENSE_MAX,
    max_memory: int = _MAX_MEMORY,
) -> Estimate:
    r"""The diagonal of a symmetric operator: exact, or estimated from ``probes`` products.

    .. math:: \operatorname{diag}(A) \approx \operatorname{diag}(QQ^\top A) + \frac1m
              \sum_{i=1}^m z_i \odot (I - QQ^\top) A z_i

    Args:
        op: a curvature operator, :class:`gradkit.func.HVPOperator` or square tensor.
        probes: operator products to spend (estimators only).
        method: ``"exact"`` (default): for :class:`GGN` and :class:`Fisher` from per-example
            gradients (one backward per column of the loss Hessian w.r.t. the output, e.g.
            ``C - 1`` for ``C`` classes; no size limit); for the :class:`Hessian` of a
            sequential MLP (``Linear`` layers and elementwise activations) from one sweep of
            per-example Hessian blocks; otherwise from ``P`` products with unit vectors (up to
            ``max_size`` parameters). ``"hutch++"`` (Diag++) or ``"hutchinson"``.
        generator: a ``torch.Generator`` for the probes.
        max_size: the largest ``P`` for the exact diagonal by unit vectors.
        max_memory: bytes for the per-example loss Hessians of the GGN's exact diagonal
            (``N * O**2`` entries for ``O`` outputs per example).

    Returns:
        An :class:`Estimate` with ``value`` and ``stderr`` of shape ``[P]`` in the operator's
        dtype (split them by parameter with ``op.as_dict``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.curvature import GGN, diagonal
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
        >>> x, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
        >>> G = GGN(model, nn.functional.cross_entropy, (x, y))
        >>> d = diagonal(G)
        >>> torch.allclose(d.value, G.dense().diagonal(), atol=1e-6), d.probes
        (True, 0)

    Warning:
        Hutchinson diagonals are poor at practical probe counts (relative error about 0.7 at
        100 probes on a 2k-parameter MLP Hessian); prefer the exact diagonal where it exists.
    """
    call = f"diagonal({label(op)}, method={method!r})"
    check_choice(method, ("exact", "hutch++", "hutchinson"), call, "method")
    A = LinearOp(op, call)
    if method == "exact":
        d = exact_diagonal(op, max_size=max_size, max_memory=max_memory, call=call)
        return Estimate(d, torch.zeros_like(d), 0)
    Q, AQ, Z, probes = _probes(A, probes, method, probe_generator(generator, call), call)
    AZ = A(Z)
    samples = Z * (AZ - Q @ (Q.T @ AZ))  # the Hutchinson part of diag((I - QQ^T) A)
    value = (Q * AQ).sum(1) + samples.mean(1)
    stderr = samples.std(1) / Z.shape[1] ** 0.5
    return Estimate(value.to(A.dtype), stderr.to(A.dtype), probes)

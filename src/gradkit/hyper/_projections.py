"""Euclidean projections onto the constraint sets of hyperparameters, exact and O(n log n).

Every projection maps a tensor ``x`` (read as one flat vector of ``n`` entries, any shape) to

.. math:: \\Pi_C(x) = \\arg\\min_{y \\in C} \\lVert y - x \\rVert_2

for the sets

* box: :math:`\\{\\text{low} \\le y \\le \\text{high}\\}` (``nonnegative``: low 0, no high);
* simplex: :math:`\\{y \\ge 0, \\sum y = R\\}`;
* L1 ball: :math:`\\{\\lVert y \\rVert_1 \\le R\\}`;
* capped simplex: :math:`\\{\\text{low} \\le y \\le \\text{high}, \\sum y \\le R\\}` (the box
  cut by a budget: the per-example weights of data hyper-cleaning, Franceschi et al. 2017,
  where RFHO solved a quadratic program with cvxopt).

The last three have the form :math:`y = \\text{clip}(x - \\tau, \\text{low}, \\text{high})`
(the KKT conditions of the quadratic program), with :math:`\\tau` the root of the
non-increasing, piecewise-linear :math:`f(\\tau) = \\sum_i \\text{clip}(x_i - \\tau)` at the
budget. :func:`_shift` finds it exactly: sort, evaluate :math:`f` at every breakpoint with
prefix sums, then solve the one linear piece that holds the root. Arithmetic is float64
whatever the input dtype; the result has the input's dtype, shape and device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = [
    "PROJECTIONS",
    "project_box",
    "project_capped_simplex",
    "project_l1_ball",
    "project_simplex",
    "projection",
]

Projection = Callable[[torch.Tensor], torch.Tensor]


def _check_tensor(x: Any, call: str, *, finite: bool = True) -> torch.Tensor:
    """``x`` if it is a floating-point tensor without NaN (and, with ``finite``, without inf:
    the sorting projections need finite entries)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            message(call, "x", "a floating-point tensor", describe(x), "pass e.g. weights.detach()")
        )
    data = x.detach()
    bad = torch.isnan(data) if not finite else ~torch.isfinite(data)
    if data.numel() and bool(bad.any()):
        index = int(bad.reshape(-1).nonzero()[0, 0])
        raise ValueError(
            message(
                call,
                "x",
                "finite entries" if finite else "entries that are not NaN",
                f"{float(data.reshape(-1)[index])} at flat index {index} of {describe(x)}",
                "a non-finite hyperparameter comes from a non-finite hypergradient or outer "
                "step: lower the learning rates (inner or outer)",
            )
        )
    return x


def _check_number(value: Any, call: str, name: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(message(call, name, "a number", describe(value), f"pass e.g. {name}=1.0"))
    if positive and not (math.isfinite(value) and value > 0):
        raise ValueError(
            message(call, name, "a finite number > 0", repr(value), f"pass e.g. {name}=1.0")
        )
    return float(value)


def _check_bounds(low: Any, high: Any, call: str) -> tuple[float, float]:
    lo = _check_number(low, call, "low")
    hi = _check_number(high, call, "high")
    if not lo <= hi or lo == math.inf or hi == -math.inf:
        raise ValueError(
            message(
                call, "low, high", "low <= high", f"low={low!r}, high={high!r}", "swap the bounds"
            )
        )
    return lo, hi


def _shift(x: torch.Tensor, low: float, high: float, total: float) -> float:
    """The root :math:`\\tau` of :math:`\\sum_i \\text{clip}(x_i - \\tau, low, high) = total`
    for a float64 vector ``x`` (``high`` may be inf, ``low`` may be -inf only with a finite
    ``high``); the caller checks that a root exists (``n low <= total <= n high``)."""
    xs = torch.sort(x).values
    n = xs.numel()
    prefix = torch.cat([xs.new_zeros(1), xs.cumsum(0)])
    points = [xs - low] if math.isfinite(low) else []
    if math.isfinite(high):
        points.append(xs - high)
    taus = torch.sort(torch.cat(points)).values

    def classes(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # below: entries clipped at low (x - tau <= low); upto: entries not clipped at high
        below = (
            torch.searchsorted(xs, tau + low, right=True)
            if math.isfinite(low)
            else torch.zeros_like(tau, dtype=torch.long)
        )
        upto = (
            torch.searchsorted(xs, tau + high, right=True)
            if math.isfinite(high)
            else torch.full_like(tau, n, dtype=torch.long)
        )
        return below, upto

    below, upto = classes(taus)
    values = (prefix[upto] - prefix[below]) - taus * (upto - below).to(taus.dtype)
    if math.isfinite(low):
        values = values + low * below.to(taus.dtype)
    if math.isfinite(high):
        values = values + high * (n - upto).to(taus.dtype)
    k = int((values >= total).sum())  # f is non-increasing: taus[:k] have f >= total
    left = float(taus[k - 1]) if k > 0 else -math.inf
    right = float(taus[k]) if k < taus.numel() else math.inf
    if k > 0 and float(values[k - 1]) == total:
        return left
    # the root lies in (left, right), where f is linear: classify the entries at a point inside
    if math.isinf(left) and math.isinf(right):
        mid = 0.0
    elif math.isinf(left):
        mid = right - 1.0
    elif math.isinf(right):
        mid = left + 1.0
    else:
        mid = 0.5 * (left + right)
    at_low = xs - mid <= low
    at_high = xs - mid >= high
    active = ~(at_low | at_high)
    count = int(active.sum())
    if count == 0:  # f is flat here: only possible when the root is a breakpoint (numerically)
        return left if math.isfinite(left) else right
    fixed = low * float(at_low.sum()) if math.isfinite(low) else 0.0
    if math.isfinite(high):
        fixed += high * float(at_high.sum())
    tau = (float(xs[active].sum()) + fixed - total) / count
    return min(max(tau, left), right)


def _flat64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).to(torch.float64)


def _back(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y.to(like.dtype).reshape(like.shape)


def project_box(x: torch.Tensor, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    r"""Projection onto the box :math:`\{\text{low} \le y \le \text{high}\}`: ``x.clamp``.

    Args:
        x: any floating-point tensor.
        low, high: the bounds (``-inf`` / ``inf`` for one-sided boxes).

    Returns:
        A new tensor shaped like ``x``.

    Examples:
        >>> import torch
        >>> from gradkit.hyper import project_box
        >>> project_box(torch.tensor([-0.5, 0.25, 2.0]))
        tensor([0.0000, 0.2500, 1.0000])
    """
    call = "project_box(x, low, high)"
    x = _check_tensor(x, call, finite=False)
    lo, hi = _check_bounds(low, high, call)
    return x.detach().clamp(lo, hi)


def project_simplex(x: torch.Tensor, radius: float = 1.0) -> torch.Tensor:
    r"""Projection onto the simplex :math:`\{y \ge 0, \sum_i y_i = R\}`, ``R`` = ``radius``.

    :math:`y = \max(x - \tau, 0)` with :math:`\tau` the exact root of :math:`\sum_i
    \max(x_i - \tau, 0) = R` (sorting and prefix sums; float64 inside).

    Args:
        x: any floating-point tensor, read as a flat vector.
        radius: the sum ``R > 0``.

    Returns:
        A new tensor shaped like ``x``.

    Examples:
        >>> import torch
        >>> from gradkit.hyper import project_simplex
        >>> project_simplex(torch.tensor([0.5, 0.5, 2.0]))
        tensor([0., 0., 1.])
        >>> project_simplex(torch.tensor([0.3, 0.1]), radius=2.0)
        tensor([1.1000, 0.9000])
    """
    call = "project_simplex(x, radius)"
    x = _check_tensor(x, call)
    r = _check_number(radius, call, "radius", positive=True)
    if x.numel() == 0:
        raise ValueError(message(call, "x", "at least one entry", describe(x), "pass a vector"))
    v = _flat64(x)
    tau = _shift(v, 0.0, math.inf, r)
    return _back((v - tau).clamp_min(0.0), x)


def project_l1_ball(x: torch.Tensor, radius: float = 1.0) -> torch.Tensor:
    r"""Projection onto the L1 ball :math:`\{\lVert y \rVert_1 \le R\}`, ``R`` = ``radius``.

    ``x`` itself when inside; else :math:`\text{sign}(x) \max(|x| - \tau, 0)` with
    :math:`\tau > 0` the exact root of :math:`\sum_i \max(|x_i| - \tau, 0) = R`.

    Examples:
        >>> import torch
        >>> from gradkit.hyper import project_l1_ball
        >>> project_l1_ball(torch.tensor([3.0, -1.0, 0.5]), radius=2.0)
        tensor([2., 0., 0.])
        >>> project_l1_ball(torch.tensor([0.5, -0.5]), radius=2.0)
        tensor([ 0.5000, -0.5000])
    """
    call = "project_l1_ball(x, radius)"
    x = _check_tensor(x, call)
    r = _check_number(radius, call, "radius", positive=True)
    v = _flat64(x)
    size = v.abs()
    if float(size.sum()) <= r:
        return x.detach().clone()
    tau = _shift(size, 0.0, math.inf, r)
    return _back(torch.sign(v) * (size - tau).clamp_min(0.0) + 0.0, x)  # no -0.0


def project_capped_simplex(
    x: torch.Tensor, radius: float, *, low: float = 0.0, high: float = 1.0
) -> torch.Tensor:
    r"""Projection onto the capped simplex :math:`\{\text{low} \le y \le \text{high},
    \sum_i y_i \le R\}`: a box cut by a budget ``R`` = ``radius``.

    ``x.clamp(low, high)`` when its sum is within the budget; else
    :math:`\text{clip}(x - \tau, \text{low}, \text{high})` with :math:`\tau > 0` the exact root
    of :math:`\sum_i \text{clip}(x_i - \tau) = R`. With the default box [0, 1] this is the
    constraint on the per-example weights of data hyper-cleaning (Franceschi et al. 2017).

    Args:
        x: any floating-point tensor, read as a flat vector.
        radius: the budget ``R``; needs ``R >= n * low``.
        low, high: the box (``high`` may be ``inf``: the nonnegative part of an L1 ball).

    Returns:
        A new tensor shaped like ``x``.

    Raises:
        ValueError: an empty set (``radius < n * low``).

    Examples:
        >>> import torch
        >>> from gradkit.hyper import project_capped_simplex
        >>> project_capped_simplex(torch.tensor([0.9, 0.8, 0.1, -0.2]), radius=1.0)
        tensor([0.5500, 0.4500, 0.0000, 0.0000])
        >>> project_capped_simplex(torch.tensor([1.5, 0.2]), radius=3.0)
        tensor([1.0000, 0.2000])
    """
    call = "project_capped_simplex(x, radius, low, high)"
    x = _check_tensor(x, call)
    r = _check_number(radius, call, "radius")
    lo, hi = _check_bounds(low, high, call)
    if not math.isfinite(lo):
        raise ValueError(
            message(call, "low", "a finite lower bound", repr(low), "pass e.g. low=0.0")
        )
    v = _flat64(x)
    n = v.numel()
    if r < n * lo:
        raise ValueError(
            message(
                call,
                "radius",
                f"radius >= n * low = {n * lo:g} (else the set is empty)",
                repr(radius),
                "raise the budget or lower the box's low bound",
            )
        )
    clipped = v.clamp(lo, hi)
    if float(clipped.sum()) <= r:
        return _back(clipped, x)
    tau = max(_shift(v, lo, hi, r), 0.0)
    return _back((v - tau).clamp(lo, hi), x)


def _nonnegative(x: torch.Tensor) -> torch.Tensor:
    return project_box(x, 0.0, math.inf)


PROJECTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "box": project_box,
    "nonnegative": _nonnegative,
    "simplex": project_simplex,
    "l1_ball": project_l1_ball,
    "capped_simplex": project_capped_simplex,
}
"""The projections :func:`projection` knows by name."""


def projection(name: str, **options: Any) -> Projection:
    """A projection by name, with its options bound: ``x -> projected x``.

    Names: ``"box"`` (``low=0, high=1``), ``"nonnegative"``, ``"simplex"`` (``radius=1``),
    ``"l1_ball"`` (``radius=1``), ``"capped_simplex"`` (``radius`` required, ``low=0``,
    ``high=1``). The options are checked at once, on a one-entry vector.

    Examples:
        >>> import torch
        >>> from gradkit.hyper import projection
        >>> cap = projection("capped_simplex", radius=1.0)
        >>> cap(torch.tensor([0.9, 0.9]))
        tensor([0.5000, 0.5000])
        >>> projection("box", low=0.0, high=0.99)(torch.tensor([1.2]))
        tensor([0.9900])
    """
    call = "projection(name, **options)"
    if not isinstance(name, str) or name not in PROJECTIONS:
        names = ", ".join(repr(k) for k in PROJECTIONS)
        raise ValueError(
            message(call, "name", f"one of {names}", repr(name), "pass a known name or a function")
        )
    fn = PROJECTIONS[name]
    if name == "capped_simplex" and "radius" not in options:
        raise TypeError(
            message(
                call,
                "radius",
                "a budget for 'capped_simplex' (sum of the entries <= radius)",
                "no radius",
                "pass e.g. projection('capped_simplex', radius=500.0)",
            )
        )

    def project(x: torch.Tensor) -> torch.Tensor:
        return fn(x, **options)

    try:
        probe = torch.zeros(1, dtype=torch.float64)
        if name == "capped_simplex":
            probe = probe + float(options.get("low", 0.0))
        project(probe)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):  # a bad value: that check's words
            raise TypeError(f"{call}: {err}") from None
        raise TypeError(
            message(
                call,
                "options",
                f"keyword options of {fn.__name__}",
                repr(options),
                f"check the option names ({err})",
            )
        ) from None
    project.__name__ = f"projection({name!r})"
    project.__qualname__ = project.__name__
    return project

"""Projections onto constraint sets: exact against independent references (Duchi et al.'s
sort-based simplex projection, bisection on the threshold, a QP solver) and the KKT conditions
of ``min ||y - x||^2 / 2`` over the set, on random inputs with ties and extreme budgets."""

from __future__ import annotations

import math

import pytest
import torch

from gradkit import hyper

D = torch.float64


def _inputs(seed: int = 0):
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    cases = []
    for n in (1, 2, 3, 7, 50, 1000):
        for scale in (0.3, 2.0, 10.0):
            x = scale * torch.randn(n, generator=gen, dtype=D)
            cases.append(x)
    cases.append(torch.zeros(5, dtype=D))
    cases.append(torch.full((6,), 0.7, dtype=D))  # all tied
    cases.append(torch.tensor([0.5, 0.5, 0.5, 2.0, 2.0, -1.0], dtype=D))  # ties
    return cases


def duchi_simplex(x: torch.Tensor, radius: float) -> torch.Tensor:
    """Duchi et al. (2008), figure 1: sort descending, find rho, shift."""
    u = torch.sort(x, descending=True).values
    css = torch.cumsum(u, 0) - radius
    k = torch.arange(1, len(u) + 1, dtype=D)
    rho = int(torch.nonzero(u - css / k > 0).max())
    theta = css[rho] / (rho + 1)
    return (x - theta).clamp_min(0)


def bisect_capped(x: torch.Tensor, radius: float, low: float, high: float) -> torch.Tensor:
    """Bisection on tau for sum(clip(x - tau, low, high)) = radius (200 halvings)."""
    if float(x.clamp(low, high).sum()) <= radius:
        return x.clamp(low, high)
    a, b = 0.0, float(x.max()) - low + 1.0
    for _ in range(200):
        m = 0.5 * (a + b)
        if float((x - m).clamp(low, high).sum()) > radius:
            a = m
        else:
            b = m
    return (x - 0.5 * (a + b)).clamp(low, high)


def kkt_capped(x, y, radius, low, high, tol=1e-10):
    """KKT of min ||y - x||^2 / 2 s.t. low <= y <= high, sum(y) <= radius: y = clip(x - tau)
    with one tau >= 0 and tau * (sum(y) - radius) = 0. Returns the list of violations."""
    problems = []
    if float(y.min()) < low - tol or float(y.max()) > high + tol:
        problems.append("outside the box")
    if float(y.sum()) > radius + tol * max(1.0, radius):
        problems.append(f"sum {float(y.sum())} > {radius}")
    free = (y > low + tol) & (y < high - tol)
    taus = x[free] - y[free]
    tau = float(taus.mean()) if len(taus) else None
    if len(taus) and float((taus - tau).abs().max()) > tol:
        problems.append("free entries shifted by different amounts")
    if tau is None:  # no free entry: the smallest tau >= 0 the clipped entries allow
        lo_bound = max([float(v) for v in x[y <= low + tol] - low] or [-math.inf])
        hi_bound = min([float(v) for v in x[y >= high - tol] - high] or [math.inf])
        tau = max(0.0, lo_bound)
        if tau > hi_bound + tol:
            problems.append("no multiplier fits the clipped entries")
    if tau < -tol:
        problems.append(f"negative multiplier {tau}")
    if abs(tau) > tol and abs(float(y.sum()) - radius) > tol * max(1.0, radius):
        problems.append("budget multiplier > 0 but the budget is not tight")
    at_low = y <= low + tol
    at_high = y >= high - tol
    if bool((x[at_low & ~at_high] - tau > low + tol).any()):
        problems.append("an entry at low that should be free")
    if bool((x[at_high & ~at_low] - tau < high - tol).any()):
        problems.append("an entry at high that should be free")
    return problems


def test_simplex_matches_duchi_sort_reference():
    problems = []
    for i, x in enumerate(_inputs()):
        for radius in (0.5, 1.0, 3.0, 100.0):
            y = hyper.project_simplex(x, radius=radius)
            ref = duchi_simplex(x, radius)
            err = float((y - ref).abs().max())
            if err > 1e-12 * max(1.0, radius):
                problems.append(f"case {i} radius {radius}: max diff {err:.3g}")
            if abs(float(y.sum()) - radius) > 1e-12 * max(1.0, radius) * len(x):
                problems.append(f"case {i} radius {radius}: sum {float(y.sum())}")
            if float(y.min()) < 0:
                problems.append(f"case {i} radius {radius}: negative entry")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("low", "high"), [(0.0, 1.0), (0.1, 2.0), (-1.0, 0.5), (0.0, math.inf)])
def test_capped_simplex_matches_bisection_and_satisfies_kkt(low, high):
    problems = []
    for i, x in enumerate(_inputs(1)):
        n = len(x)
        for frac in (0.0, 0.1, 0.5, 0.9, 1.0, 2.0):
            radius = n * low + frac * n * (min(high, 3.0) - low)
            y = hyper.project_capped_simplex(x, radius, low=low, high=high)
            ref = bisect_capped(x, radius, low, high)
            err = float((y - ref).abs().max())
            if err > 1e-11 * max(1.0, abs(radius)):
                problems.append(f"case {i} radius {radius:.3g}: max diff to bisection {err:.3g}")
            for p in kkt_capped(x, y, radius, low, high):
                problems.append(f"case {i} radius {radius:.3g}: {p}")
    assert not problems, "\n".join(problems)


def test_capped_simplex_matches_a_qp_solver():
    optimize = pytest.importorskip("scipy.optimize")
    gen = torch.Generator(torch.get_default_device()).manual_seed(2)
    for n, radius in ((5, 1.0), (12, 4.0), (20, 2.5)):
        x = 2 * torch.randn(n, generator=gen, dtype=D)
        y = hyper.project_capped_simplex(x, radius)
        x0 = x.cpu().numpy()
        res = optimize.minimize(
            lambda v, x0=x0: 0.5 * ((v - x0) ** 2).sum(),
            x0.clip(0, 1) * 0,
            jac=lambda v, x0=x0: v - x0,
            bounds=[(0.0, 1.0)] * n,
            constraints=[{"type": "ineq", "fun": lambda v, r=radius: r - v.sum()}],
            method="SLSQP",
            options={"ftol": 1e-14, "maxiter": 500},
        )
        assert res.success
        assert float((y.cpu() - torch.from_numpy(res.x)).abs().max()) < 1e-6


def test_l1_ball_is_the_signed_simplex_projection_outside_and_identity_inside():
    for i, x in enumerate(_inputs(3)):
        for radius in (0.5, 2.0, 1e4):
            y = hyper.project_l1_ball(x, radius=radius)
            if float(x.abs().sum()) <= radius:
                assert torch.equal(y, x), i
                continue
            ref = torch.sign(x) * duchi_simplex(x.abs(), radius)
            assert float((y - ref).abs().max()) < 1e-12 * max(1.0, radius), i
            assert abs(float(y.abs().sum()) - radius) < 1e-10 * max(1.0, radius)


def test_box_and_nonnegative():
    x = torch.tensor([-2.0, 0.3, 1.5])
    assert torch.equal(hyper.project_box(x), torch.tensor([0.0, 0.3, 1.0]))
    assert torch.equal(hyper.project_box(x, low=-1.0, high=0.5), torch.tensor([-1.0, 0.3, 0.5]))
    assert torch.equal(hyper.projection("nonnegative")(x), torch.tensor([0.0, 0.3, 1.5]))


@pytest.mark.parametrize(
    "project",
    [
        hyper.projection("box"),
        hyper.projection("simplex", radius=2.0),
        hyper.projection("l1_ball", radius=2.0),
        hyper.projection("capped_simplex", radius=2.0),
    ],
    ids=["box", "simplex", "l1_ball", "capped_simplex"],
)
def test_projections_keep_dtype_shape_and_are_idempotent(project):
    x = 3 * torch.randn(4, 5)  # float32, two dimensions: read as one vector of 20
    y = project(x)
    assert y.dtype == torch.float32 and y.shape == x.shape and not y.requires_grad
    assert torch.allclose(project(y), y, rtol=0, atol=1e-6)
    x64 = x.double()
    y64 = project(x64)
    assert torch.allclose(y.double(), y64, rtol=0, atol=1e-6)


def test_input_is_not_modified():
    x = torch.tensor([0.9, 0.8, 0.1, -0.2], requires_grad=True)
    before = x.detach().clone()
    hyper.project_capped_simplex(x, 1.0)
    hyper.project_simplex(x)
    assert torch.equal(x.detach(), before) and x.grad is None


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda: hyper.projection("ball"), ValueError, r"projection\(name, \*\*options\): name: "),
        (lambda: hyper.projection("capped_simplex"), TypeError, r"radius: expected a budget"),
        (lambda: hyper.projection("box", radius=2.0), TypeError, r"options: expected keyword"),
        (
            lambda: hyper.project_capped_simplex(torch.zeros(4), 1.0, low=0.5),
            ValueError,
            r"radius: expected radius >= n \* low = 2",
        ),
        (
            lambda: hyper.project_simplex(torch.zeros(3), radius=0.0),
            ValueError,
            r"radius: expected",
        ),
        (lambda: hyper.project_box([1.0]), TypeError, r"x: expected a floating-point tensor"),
        (
            lambda: hyper.project_box(torch.zeros(2), low=1.0, high=0.0),
            ValueError,
            r"low, high: expected low <= high",
        ),
        (
            lambda: hyper.project_capped_simplex(torch.tensor([0.9, math.nan]), radius=1.0),
            ValueError,
            r"project_capped_simplex\(.*\): x: expected finite entries, got nan at flat index 1",
        ),
        (
            lambda: hyper.project_simplex(torch.tensor([math.inf, 0.0])),
            ValueError,
            r"project_simplex\(x, radius\): x: expected finite entries, got inf",
        ),
        (
            lambda: hyper.project_l1_ball(torch.tensor([math.nan])),
            ValueError,
            r"project_l1_ball\(x, radius\): x: expected finite entries",
        ),
        (
            lambda: hyper.project_box(torch.tensor([math.nan, 2.0])),
            ValueError,
            r"project_box\(x, low, high\): x: expected entries that are not NaN",
        ),
        (
            lambda: hyper.projection("simplex", radius=True),
            TypeError,
            r"projection\(name, \*\*options\): project_simplex\(x, radius\): radius: expected a "
            r"number, got True",
        ),
    ],
)
def test_errors_name_the_call_and_argument(call, error, pattern):
    """Before: one NaN entry made every entry of a capped-simplex projection NaN, silently."""
    with pytest.raises(error, match=pattern):
        call()

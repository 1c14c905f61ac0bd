"""Implicit hypergradients on ridge regression (strongly convex, closed form): CG, Neumann and
fixed point against the closed form, against reverse mode at convergence, and Neumann with K
terms against truncated reverse through K gradient-descent steps at the optimum."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from gradkit import hyper, optim
from gradkit.hyper._implicit import NotStationaryWarning
from gradkit.testing import assert_close

D = torch.float64
N, FEATURES = 40, 5


def _ridge():
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    X, y = torch.randn(N, FEATURES, generator=gen, dtype=D), torch.randn(N, generator=gen, dtype=D)
    Xv, yv = (
        torch.randn(15, FEATURES, generator=gen, dtype=D),
        torch.randn(15, generator=gen, dtype=D),
    )
    l2 = torch.linspace(0.05, 0.3, FEATURES, dtype=D)  # per-coordinate L2
    c = torch.linspace(0.5, 1.5, N, dtype=D)  # per-example weights

    def inner(p, batch):
        return 0.5 * (c * (X @ p["w"] - y) ** 2).mean() + 0.5 * (l2 * p["w"] ** 2).sum()

    def outer(p):
        return 0.5 * ((Xv @ p["w"] - yv) ** 2).mean()

    def solve(l2_, c_):
        A = X.T @ (c_[:, None] * X) / N + torch.diag(l2_)
        return torch.linalg.solve(A, X.T @ (c_ * y) / N)

    return inner, outer, solve, {"l2": l2, "c": c}


def _largest(inner, w_star):
    w = {"w": w_star["w"].detach().clone().requires_grad_(True)}
    H = torch.autograd.functional.hessian(lambda v: inner({"w": v}, None), w["w"])
    return float(torch.linalg.eigvalsh(H)[-1])


@pytest.mark.parametrize("method", ["neumann", "fixed_point"])
@pytest.mark.parametrize("maxiter", [20, 100])
def test_a_diverging_series_raises_while_still_finite(method, maxiter):
    """A step above 2 / lambda_max makes the iteration grow: it stayed finite for 100 terms
    (-1.05e15 where the answer is -0.14) and was returned as the hypergradient."""
    inner, outer, solve, h = _ridge()
    w_star = {"w": solve(h["l2"], h["c"])}
    alpha = 2.5 / _largest(inner, w_star)
    with pytest.raises(
        ValueError, match=r"alpha: expected a solve that converges.*grew [0-9.e+]+-fold"
    ):
        hyper.implicit(inner, outer, w_star, h, method=method, alpha=alpha, maxiter=maxiter)


def test_the_default_step_counts_the_damping_once(monkeypatch):
    """alpha = 1 / lambda_max(H + damping I): the damping was added to that estimate twice."""
    from gradkit.hyper import _implicit

    inner, outer, solve, h = _ridge()
    w_star = {"w": solve(h["l2"], h["c"])}
    seen = []
    original = _implicit._neumann

    def spy(hvp, b, alpha, terms):
        seen.append(alpha)
        return original(hvp, b, alpha, terms)

    monkeypatch.setattr(_implicit, "_neumann", spy)
    hyper.implicit(inner, outer, w_star, h, method="neumann", damping=1.0, maxiter=5)
    # (20 power iterations: within 1 %; the damping counted twice gave 1 / (lambda + 2))
    assert seen[0] == pytest.approx(1 / (_largest(inner, w_star) + 1.0), rel=1e-2)


def _closed_form(outer, solve, h):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in h.items()}
    value = outer({"w": solve(leaves["l2"], leaves["c"])})
    return dict(zip(leaves, torch.autograd.grad(value, list(leaves.values())), strict=True))


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("cg", {}),
        ("neumann", {"maxiter": 400}),
        ("fixed_point", {}),
        ("fixed_point", {"alpha": 0.5}),
    ],
)
def test_implicit_matches_the_closed_form(method, options):
    inner, outer, solve, h = _ridge()
    w_star = solve(h["l2"], h["c"])
    res = hyper.implicit(inner, outer, {"w": w_star}, h, method=method, full_output=True, **options)
    assert_close(res.grads, _closed_form(outer, solve, h), rtol=1e-8, atol=1e-12)
    assert float(res.residual) < 1e-8 and res.iterations > 0
    assert_close(res.params["w"], w_star, rtol=0, atol=0)


def test_reverse_converges_to_the_implicit_hypergradient():
    inner, outer, solve, h = _ridge()
    w_star = solve(h["l2"], h["c"])
    imp = hyper.implicit(inner, outer, {"w": w_star}, h)
    rev = hyper.reverse(
        inner,
        outer,
        {"w": torch.zeros(FEATURES, dtype=D)},
        optim.sgd(lr=0.7, momentum=0.3),
        steps=150,
        hyper=h,
        checkpoint_every="sqrt",
    )
    assert_close(rev, imp, rtol=1e-7, atol=1e-10)


def test_neumann_with_k_terms_is_truncated_reverse_through_k_steps_at_the_optimum():
    inner, outer, solve, h = _ridge()
    w_star = solve(h["l2"], h["c"])
    for k in (1, 3, 10):
        neumann = hyper.implicit(
            inner, outer, {"w": w_star}, h, method="neumann", maxiter=k, alpha=0.4
        )
        trunc = hyper.truncated(
            inner, outer, {"w": w_star}, optim.sgd(lr=0.4), steps=k, last=k, hyper=h
        )
        assert_close(neumann, trunc, rtol=1e-9, atol=1e-12)


def test_tuple_parameters_and_damping():
    inner, outer, solve, h = _ridge()
    w_star = solve(h["l2"], h["c"])
    g = hyper.implicit(
        lambda p, b: inner({"w": p[0]}, b), lambda p: outer({"w": p[0]}), (w_star,), h
    )
    assert_close(g, _closed_form(outer, solve, h), rtol=1e-8, atol=1e-12)
    damped = hyper.implicit(inner, outer, {"w": w_star}, h, damping=1.0)
    assert not torch.allclose(damped["l2"], g["l2"])


def test_an_unconverged_solve_is_logged(caplog):
    inner, outer, solve, h = _ridge()
    with caplog.at_level(logging.WARNING, logger="gradkit.hyper._implicit"):
        res = hyper.implicit(
            inner, outer, {"w": solve(h["l2"], h["c"])}, h, maxiter=1, full_output=True
        )
    assert res.iterations == 1 and float(res.residual) > 1e-6
    assert "stopped at relative residual" in caplog.text


def test_implicit_errors():
    inner, outer, solve, h = _ridge()
    w_star = {"w": solve(h["l2"], h["c"])}
    with pytest.raises(
        ValueError,
        match=r"implicit\(.*\): method: expected one of 'cg', 'neumann', 'fixed_point', got 'lu'",
    ):
        hyper.implicit(inner, outer, w_star, h, method="lu")
    with pytest.raises(ValueError, match=r"maxiter: expected an int >= 1, got 0"):
        hyper.implicit(inner, outer, w_star, h, maxiter=0)
    with pytest.raises(
        ValueError,
        match=r"implicit\(.*\): hyper\['lr'\]: expected a tensor the optimizer or the losses "
        r"use.*list only tensors inner_loss or outer_loss close over: implicit differentiates "
        r"at the optimum, which optimizer hyperparameters",
    ) as info:
        hyper.implicit(inner, outer, w_star, {**h, "lr": torch.tensor(0.1, dtype=D)})
    assert "sgd(lr=lr)" not in str(info.value)  # no advice about an optimizer implicit lacks
    concave = lambda p, b: inner(p, b) - 10 * (p["w"] ** 2).sum()
    with pytest.raises(
        ValueError, match=r"inner_loss: expected a Hessian that is positive definite"
    ):
        hyper.implicit(concave, outer, w_star, h)
    with pytest.raises(
        ValueError, match=r"inner_loss: expected a loss whose gradient depends on params_star"
    ):
        hyper.implicit(lambda p, b: h["l2"] @ p["w"], outer, w_star, h)
    with pytest.raises(
        TypeError, match=r"outer_loss: expected a callable \(a function params -> scalar\)"
    ):
        hyper.implicit(inner, 3.0, w_star, h)


CALL = r"implicit\(inner_loss, outer_loss, params_star, hyper\): "


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        (lambda: {"maxiter": -5}, ValueError, CALL + r"maxiter: expected an int >= 1, got -5"),
        (lambda: {"maxiter": 10.0}, TypeError, CALL + r"maxiter: expected an int.*, got 10.0"),
        (lambda: {"maxiter": True}, TypeError, CALL + r"maxiter: expected an int.*, got True"),
        (
            lambda: {"tol": -1e-3},
            ValueError,
            CALL + r"tol: expected a finite number >= 0, got -0.001",
        ),
        (
            lambda: {"tol": math.nan},
            ValueError,
            CALL + r"tol: expected a finite number >= 0, got nan",
        ),
        (lambda: {"tol": "1e-6"}, TypeError, CALL + r"tol: expected a .*number.*, got '1e-6'"),
        (
            lambda: {"damping": math.inf},
            ValueError,
            CALL + r"damping: expected a finite number >= 0",
        ),
        (lambda: {"damping": -1.0}, ValueError, CALL + r"damping: expected a finite number >= 0"),
        (
            lambda: {"method": "neumann", "alpha": 0.0},
            ValueError,
            CALL + r"alpha: expected a finite number > 0, got 0.0",
        ),
        (
            lambda: {"alpha": torch.tensor(0.1)},
            TypeError,
            CALL + r"alpha: expected a .*number.*, got Tensor",
        ),
        (
            lambda: {"stationary_tol": -1.0},
            ValueError,
            CALL + r"stationary_tol: expected a number >= 0",
        ),
        (lambda: {"full_output": 1}, TypeError, CALL + r"full_output: expected a bool, got 1"),
        (
            lambda: {"hyper": {}},
            TypeError,
            CALL + r"hyper: expected a non-empty dict .*with tensors inner_loss or outer_loss "
            r"close over",
        ),
        (
            lambda: {"method": "neumann", "alpha": 5.0, "maxiter": 400},
            ValueError,
            CALL + r"alpha: expected a solve that converges: alpha below 2 / lambda_max.*inf/nan",
        ),
    ],
)
def test_bad_options_name_implicits_own_arguments(options, error, pattern):
    """Before: a NaN tol stopped CG before its first product (q = 0, a wrong number without a
    word), alpha=0 gave a zero Neumann series, a diverging alpha gave inf/NaN silently."""
    inner, outer, solve, h = _ridge()
    w_star = {"w": solve(h["l2"], h["c"])}
    kwargs = options()
    given = kwargs.pop("hyper", h)
    with pytest.raises(error, match=pattern):
        hyper.implicit(inner, outer, w_star, given, **kwargs)


def test_a_point_that_is_not_stationary_warns_and_reports_its_gradient_norm():
    inner, outer, solve, h = _ridge()
    w_star = solve(h["l2"], h["c"])
    off = {"w": w_star + 0.05}
    # the oracle: the gradient of inner_loss at the point, by plain autograd
    x = off["w"].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(inner({"w": x}, None), x)
    with pytest.warns(
        NotStationaryWarning,
        match=r"params_star is not a stationary point of inner_loss: \|\|grad "
        r"inner_loss\(params_star\)\|\| = .* > stationary_tol \* max\(1, \|\|params_star\|\|\)",
    ):
        res = hyper.implicit(inner, outer, off, h, full_output=True)
    assert_close(res.inner_grad_norm, grad.norm(), rtol=1e-12)
    assert float(res.inner_grad_norm) > 1e-3
    # accepted explicitly: no warning (warnings are errors in this test suite)
    quiet = hyper.implicit(inner, outer, off, h, full_output=True, stationary_tol=math.inf)
    assert_close(quiet.grads, res.grads, rtol=0, atol=0)
    # an optimizer's stationary_tol large enough for this point: silent as well
    hyper.implicit(inner, outer, off, h, stationary_tol=2 * float(grad.norm()))


def test_a_solved_inner_problem_is_silent_and_reports_a_tiny_gradient_norm():
    inner, outer, solve, h = _ridge()
    w_star = solve(h["l2"], h["c"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = hyper.implicit(inner, outer, {"w": w_star}, h, full_output=True)
    assert float(res.inner_grad_norm) < 1e-12


def test_hyperoptimizer_passes_stationary_tol_and_warns_when_training_is_too_short():
    inner, outer, solve, h = _ridge()
    params0 = {"w": torch.zeros(FEATURES, dtype=D)}
    l2 = h["l2"].clone()
    ridge = lambda p, b: inner(p, b) + 0.5 * ((l2 - h["l2"]) * p["w"] ** 2).sum()
    hopt = hyper.HyperOptimizer(
        ridge, outer, params0, optim.sgd(lr=0.5), {"l2": l2}, method="implicit", steps=3
    )
    with pytest.warns(NotStationaryWarning):
        hopt.step()
    hopt = hyper.HyperOptimizer(
        ridge,
        outer,
        params0,
        optim.sgd(lr=0.5),
        {"l2": l2},
        method="implicit",
        steps=3,
        implicit_options={"stationary_tol": math.inf},
    )
    hopt.step()

"""``solve(op + damping, b)`` by conjugate gradients against a dense float64 solve, and the
shifted operator ``op + damping`` itself."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradkit import GradkitError
from gradkit.curvature import (
    GGN,
    ConvergenceWarning,
    Hessian,
    ShiftedOperator,
    eigenvalues,
    solve,
    trace,
)

from ._oracles import D, ce_problem, dense_ggn, dense_hessian, mse_problem


def _ggn():
    model, loss_fn, batch = ce_problem(n=16)
    return GGN(model, loss_fn, batch), dense_ggn(model, loss_fn, batch)


@pytest.mark.parametrize("damping", [1e-2, 0.1, 10.0])
def test_damped_ggn_systems_match_a_dense_solve(damping):
    G, dense = _ggn()
    P = G.shape[0]
    B = torch.randn(P, 3, dtype=D)
    want = torch.linalg.solve(dense + damping * torch.eye(P, dtype=D), B)
    sol = solve(G + damping, B, rtol=1e-11)
    assert sol.converged and sol.x.shape == (P, 3) and sol.residual.shape == (3,)
    torch.testing.assert_close(sol.x, want, rtol=1e-7, atol=1e-9)
    assert float(sol.residual.max()) <= 1e-11
    one = solve(G + damping, B[:, 1], rtol=1e-11)  # a vector: the same column, alone
    assert one.residual.dim() == 0
    torch.testing.assert_close(one.x, want[:, 1], rtol=1e-7, atol=1e-9)


def test_dict_right_hand_sides_come_back_keyed_by_parameter():
    G, dense = _ggn()
    b = {name: torch.randn(s, dtype=D) for name, s in zip(G.names, G.shapes, strict=True)}
    sol = solve(G + 0.5, b, rtol=1e-12)
    want = torch.linalg.solve(dense + 0.5 * torch.eye(G.shape[0], dtype=D), G.flatten(b))
    assert list(sol.x) == G.names
    torch.testing.assert_close(G.flatten(sol.x), want, rtol=1e-8, atol=1e-10)


def test_indefinite_hessian_is_refused_and_damping_past_its_bottom_solves_it():
    torch.manual_seed(3)
    model, loss_fn, batch = mse_problem(n=8)  # random weights: far from a minimum
    H = Hessian(model, loss_fn, [batch])
    dense = dense_hessian(model, loss_fn, [batch])
    lowest = float(torch.linalg.eigvalsh(dense)[0])
    assert lowest < 0
    b = torch.randn(H.shape[0], dtype=D)
    with pytest.raises(GradkitError, match="not positive definite: CG found a direction of"):
        solve(H, b)
    shift = -lowest + 0.1
    sol = solve(H + shift, b, rtol=1e-12)
    want = torch.linalg.solve(dense + shift * torch.eye(H.shape[0], dtype=D), b)
    torch.testing.assert_close(sol.x, want, rtol=1e-7, atol=1e-9)


def test_maxiter_stops_early_with_a_warning_and_the_last_iterate():
    G, dense = _ggn()
    b = torch.randn(G.shape[0], dtype=D)
    with pytest.warns(ConvergenceWarning, match=r"stopped at maxiter=2 iterations"):
        sol = solve(G + 1e-4, b, maxiter=2, rtol=1e-12)
    assert not sol.converged and sol.iterations == 2 and float(sol.residual) > 1e-12
    exact = (dense + 1e-4 * torch.eye(G.shape[0], dtype=D)) @ sol.x
    assert float(sol.residual) == pytest.approx(float((b - exact).norm() / b.norm()), rel=1e-6)


def test_a_start_at_the_solution_and_a_zero_right_hand_side_take_no_iteration():
    G, dense = _ggn()
    b = torch.randn(G.shape[0], dtype=D)
    x = torch.linalg.solve(dense + torch.eye(G.shape[0], dtype=D), b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at = solve(G + 1.0, b, x0=x, rtol=1e-6)
        zero = solve(G + 1.0, torch.zeros_like(b))
    assert at.iterations == 0 and at.converged
    assert zero.iterations == 0 and zero.converged and not zero.x.any()


def test_square_tensors_are_operators_too():
    M = torch.randn(6, 6, dtype=D)
    A = M @ M.T + torch.eye(6, dtype=D)
    b = torch.randn(6, dtype=D)
    sol = solve(A, b, rtol=1e-12)  # CUDA's float64 sums end at 1.03e-13 in 6 steps
    torch.testing.assert_close(sol.x, torch.linalg.solve(A, b), rtol=1e-9, atol=1e-11)
    assert sol.iterations <= 6 + 2  # CG: at most P steps in exact arithmetic


def test_the_shifted_operator_is_an_operator():
    G, dense = _ggn()
    P = G.shape[0]
    S = G + 0.25
    assert isinstance(S, ShiftedOperator) and S.shape == G.shape and S.names == G.names
    V = torch.randn(P, 2, dtype=D)
    torch.testing.assert_close(S @ V, G @ V + 0.25 * V)
    torch.testing.assert_close((0.25 + G) @ V, S @ V)
    torch.testing.assert_close(((G + 0.125) + 0.125) @ V, S @ V)
    torch.testing.assert_close(S.dense(), dense + 0.25 * torch.eye(P, dtype=D))
    v = G.as_dict(V[:, 0])
    torch.testing.assert_close(G.flatten(S @ v), S @ V[:, 0])
    exact = trace(S, method="exact").value
    torch.testing.assert_close(exact, dense.trace() + 0.25 * P)
    top = eigenvalues(S, 2, generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    torch.testing.assert_close(top, torch.linalg.eigvalsh(dense).flip(0)[:2] + 0.25)


@pytest.mark.parametrize(
    ("run", "error", "match"),
    [
        (lambda G, b: G + "1e-3", TypeError, r"GGN\(Sequential\) \+ damping: damping: expected"),
        (lambda G, b: G + float("nan"), ValueError, "damping: expected a finite number"),
        (lambda G, b: solve(G, b, rtol=0.0), ValueError, r"rtol: expected a finite number > 0"),
        (lambda G, b: solve(G, b, rtol=1.0), ValueError, r"rtol: expected a finite number"),
        (lambda G, b: solve(G, b, maxiter=0), ValueError, r"maxiter: expected None or an int >= 1"),
        (lambda G, b: solve(G, b[:-1]), ValueError, r"b: expected a floating-point tensor"),
        (lambda G, b: solve(G, b, x0=b[:, None].repeat(1, 2)), ValueError, "as many columns"),
        (lambda G, b: solve("G", b), TypeError, "op: expected a square operator"),
    ],
)
def test_bad_arguments_say_what_to_do(run, error, match):
    G, _ = _ggn()
    b = torch.randn(G.shape[0], dtype=D)
    with pytest.raises(error, match=match):
        run(G, b)

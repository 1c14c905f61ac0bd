"""Trace and diagonal estimators: exact where asked, unbiased over independent seeds (mean
within 3 standard errors), honest standard errors, reproducible with a generator
(curvature.md 4.3, case 7)."""

from __future__ import annotations

import pytest
import torch

from gradkit.curvature import ConvergenceWarning, Estimate, Hessian, diagonal, trace
from gradkit.func import hvp_operator
from gradkit.testing import assert_close

from ._oracles import D, ce_problem, dense_hessian

SEEDS = 60


def _gen(seed: int) -> torch.Generator:
    """A seeded generator on the device under test."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def _matrix(n: int = 40) -> torch.Tensor:
    g = _gen(1)
    Q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D)).Q
    lam = torch.cat(
        [torch.tensor([8.0, 5.0, 3.0], dtype=D), torch.randn(n - 3, generator=g, dtype=D) * 0.5]
    )
    return Q @ torch.diag(lam) @ Q.T


@pytest.mark.parametrize("method", ["hutch++", "hutchinson"])
def test_trace_is_unbiased_with_honest_standard_errors(method):
    A = _matrix()
    exact = float(A.trace())
    ests = [trace(A, 12, method=method, generator=_gen(s)) for s in range(SEEDS)]
    values = torch.stack([e.value for e in ests])
    se = float(values.std()) / SEEDS**0.5
    assert abs(float(values.mean()) - exact) <= 3 * se
    reported = float(torch.stack([e.stderr for e in ests]).mean())
    assert 0.5 <= reported / float(values.std()) <= 1.6
    assert all(e.probes == 12 and e.value.dtype == D for e in ests)


@pytest.mark.parametrize("method", ["hutch++", "hutchinson"])
def test_diagonal_is_unbiased_entrywise(method):
    A = _matrix()
    ests = [diagonal(A, 12, method=method, generator=_gen(s)) for s in range(SEEDS)]
    values = torch.stack([e.value for e in ests])
    z = (values.mean(0) - A.diagonal()) / (values.std(0) / SEEDS**0.5)
    assert float(z.abs().max()) < 4.5  # 40 entries, each within 3 standard errors but rarely
    assert float((z.abs() <= 3).float().mean()) >= 0.95
    reported = torch.stack([e.stderr for e in ests]).mean(0)
    ratio = reported / values.std(0)
    assert 0.5 <= float(ratio.median()) <= 1.6


def test_hutchpp_beats_hutchinson_on_a_decaying_spectrum():
    n = 200
    Q = torch.linalg.qr(torch.randn(n, n, dtype=D)).Q
    A = Q @ torch.diag(1.0 / torch.arange(1, n + 1, dtype=D) ** 2) @ Q.T
    err = {}
    for method in ("hutch++", "hutchinson"):
        errs = [
            float(trace(A, 30, method=method, generator=_gen(s)).value) - float(A.trace())
            for s in range(20)
        ]
        err[method] = sum(e * e for e in errs) ** 0.5
    assert err["hutch++"] < 0.2 * err["hutchinson"]


def test_estimates_are_reproducible():
    model, loss_fn, batch = ce_problem()
    H = Hessian(model, loss_fn, batch)
    a = trace(H, 9, generator=_gen(5))
    b = trace(H, 9, generator=_gen(5))
    assert isinstance(a, Estimate) and torch.equal(a.value, b.value)
    torch.manual_seed(3)
    c = diagonal(H, 6, method="hutchinson")
    torch.manual_seed(3)
    d = diagonal(H, 6, method="hutchinson")
    assert torch.equal(c.value, d.value) and torch.equal(c.stderr, d.stderr)


def test_exact_methods_and_other_operators():
    model, loss_fn, batch = ce_problem()
    H = Hessian(model, loss_fn, batch)
    ref = dense_hessian(model, loss_fn, [batch])
    ex = trace(H, method="exact")
    assert ex.probes == 0 and float(ex.stderr) == 0
    assert_close(ex.value, ref.trace())
    assert_close(diagonal(ref).value, ref.diagonal())
    f = lambda t: (t.sin() * t).sum()
    op = hvp_operator(f, torch.randn(7, dtype=D))
    assert_close(diagonal(op).value, op.to_dense().diagonal())
    assert_close(trace(op, method="exact").value, op.to_dense().trace())
    assert trace(op, 9).value.shape == ()


def test_estimator_errors():
    A = _matrix(6)
    with pytest.raises(ValueError, match=r"trace\(Tensor, method='hutch\+\+'\): probes: expected"):
        trace(A, 4)
    with pytest.raises(ValueError, match=r"probes: expected an int >= 2"):
        diagonal(A, 1, method="hutchinson")
    with pytest.raises(ValueError, match=r"method: expected one of 'hutch\+\+', 'hutchinson'"):
        trace(A, method="xtrace")
    with pytest.raises(TypeError, match=r"op: expected a square operator"):
        trace(torch.ones(3, 4))
    with pytest.raises(TypeError, match=r"generator: expected a torch.Generator or None"):
        trace(A, 6, generator=0)


def _spectrum(lam: torch.Tensor) -> torch.Tensor:
    n = lam.numel()
    Q = torch.linalg.qr(torch.randn(n, n, dtype=D, generator=_gen(2))).Q
    return Q @ torch.diag(lam) @ Q.T


@pytest.mark.parametrize("method", ["hutch++", "hutchinson"])
def test_adaptive_trace_stops_at_the_requested_relative_error(method):
    A = _spectrum(4 * torch.rand(120, dtype=D, generator=_gen(4)) - 1)
    exact = float(A.trace())
    for seed in range(5):
        gen = _gen(seed)
        est = trace(A, 12, method=method, rtol=0.02, generator=gen)
        assert float(est.stderr) <= 0.02 * abs(float(est.value))
        assert 12 < est.probes <= 1000  # 12 products were not enough here
        assert abs(float(est.value) - exact) <= 4 * float(est.stderr)


def test_adaptive_trace_says_when_the_spectrum_keeps_it_from_the_tolerance():
    signs = torch.tensor([1.0, -1.0], dtype=D).repeat(100)  # flat, indefinite: tr 2, ||A||_F 14
    A = _spectrum(signs + 0.01)
    with pytest.warns(ConvergenceWarning, match=r"standard error is .* after max_probes=60"):
        est = trace(A, 20, rtol=0.05, max_probes=60, generator=_gen(0))
    assert est.probes == 60
    assert float(est.stderr) > 0.05 * abs(float(est.value))


def test_adaptive_trace_refuses_max_probes_below_probes():
    """It spent all of probes, and the warning named max_probes as if it had stopped there."""
    A = _spectrum(torch.tensor([1.0, -1.0], dtype=D).repeat(50))
    with pytest.raises(ValueError, match=r"max_probes: expected at least probes \(100\)"):
        trace(A, 100, rtol=1e-3, max_probes=50, generator=_gen(0))


def test_adaptive_trace_without_need_spends_only_the_first_probes():
    A = torch.diag(torch.arange(1.0, 51.0, dtype=D))  # diagonal: every Rademacher sample exact
    est = trace(A, 9, method="hutchinson", rtol=0.05, generator=_gen(0))
    assert est.probes == 9 and float(est.stderr) == 0.0

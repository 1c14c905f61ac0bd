"""Lanczos eigenvalues against torch.linalg.eigh (top-k to 1e-6 relative, no ghost copies with
more than 50 iterations, indefinite spectra for every ``which``) and stochastic Lanczos
quadrature (curvature.md 4.3, case 8)."""

from __future__ import annotations

import pytest
import torch

from gradkit.curvature import Hessian, SpectralDensity, eigenvalues, spectral_density
from gradkit.testing import assert_close

from ._oracles import D, ce_problem, dense_hessian


def _gen(seed: int) -> torch.Generator:
    """A seeded generator on the device under test."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


@pytest.fixture(scope="module")
def hessian():
    torch.manual_seed(0)
    model, loss_fn, batch = ce_problem(n=40, sizes=(6, 12, 4))
    return Hessian(model, loss_fn, batch), dense_hessian(model, loss_fn, [batch])


@pytest.mark.parametrize("which", ["largest", "smallest", "magnitude"])
def test_extreme_eigenvalues_of_an_indefinite_hessian(hessian, which):
    H, ref = hessian
    lam = torch.linalg.eigvalsh(ref)
    assert lam.min() < -1e-3 < 1e-3 < lam.max()  # indefinite
    order = {
        "largest": lam.flip(0),
        "smallest": lam,
        "magnitude": lam[lam.abs().argsort(descending=True)],
    }[which]
    values, vectors = eigenvalues(H, k=4, which=which, return_vectors=True, generator=_gen(0))
    assert_close(values, order[:4], rtol=1e-6, atol=0)
    residual = ref @ vectors - vectors * values
    assert float(residual.abs().max()) <= 1e-6 * float(lam.abs().max())
    eye = torch.eye(4, dtype=D, device=vectors.device)  # the fixture's operator: on the CPU
    assert_close(vectors.T @ vectors, eye, atol=1e-8)


def test_no_ghost_copies_with_many_iterations(hessian):
    H, ref = hessian
    top = torch.linalg.eigvalsh(ref).flip(0)[:6]
    for steps in (51, 80, H.shape[0]):
        values = eigenvalues(H, k=6, max_iter=steps, tol=0.0, generator=_gen(1))
        assert_close(values, top, rtol=1e-6, atol=0)
        gaps = (values[:-1] - values[1:]).abs()
        assert float(gaps.min()) > 1e-6 * float(top.abs().max())


def test_repeated_eigenvalues_are_found_after_an_invariant_subspace():
    A = torch.diag(torch.tensor([5.0, 5.0, 5.0, 4.0] + [1.0] * 20, dtype=D))
    values = eigenvalues(A, k=4, generator=_gen(0))
    assert_close(values, torch.tensor([5.0, 5.0, 5.0, 4.0], dtype=D))


def _ordered(lam: torch.Tensor, which: str) -> torch.Tensor:
    return {
        "largest": lam.flip(0),
        "smallest": lam,
        "magnitude": lam[lam.abs().argsort(descending=True, stable=True)],
    }[which]


def _rotated(values: list[float]) -> torch.Tensor:
    g = _gen(3)
    Q, _ = torch.linalg.qr(torch.randn(len(values), len(values), dtype=D, generator=g))
    return Q @ torch.diag(torch.tensor(values, dtype=D)) @ Q.T


@pytest.mark.parametrize("which", ["largest", "smallest", "magnitude"])
def test_repeated_eigenvalues_when_the_krylov_space_is_exhausted_after_k_steps(which):
    """The Krylov space of the start vector holds one copy of each eigenvalue; once exhausted
    (after at least k steps) every residual is 0, yet the copies lie outside it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(D)  # MSE: 5 distinct eigenvalues, each 3 times
    x, y = torch.randn(64, 4, dtype=D), torch.randn(64, 3, dtype=D)
    H = Hessian(model, torch.nn.functional.mse_loss, (x, y))
    lam = torch.linalg.eigvalsh(H.dense())
    A = _rotated([5.0, 5.0, -5.0, -5.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    for op, ref in ((H, lam), (A, torch.linalg.eigvalsh(A))):
        for k in (2, 3, 4):
            values, vectors = eigenvalues(
                op,
                k=k,
                which=which,
                return_vectors=True,
                generator=_gen(0),
            )
            want = _ordered(ref, which)[:k]
            if which == "magnitude":  # -5 and 5 tie
                values, want = values.abs(), want.abs()
            assert_close(values, want, rtol=1e-8, atol=1e-12)
            assert_close(vectors.T @ vectors, torch.eye(k, dtype=D), atol=1e-8)


@pytest.mark.parametrize("which", ["largest", "smallest"])
def test_repeated_eigenvalues_of_float32_operators(which):
    """A float32 operator's products leave an exhausted Krylov space a residual of a few
    hundred float32 epsilons (3.7e-5 relative), which was read as convergence: the copies of
    repeated eigenvalues were lost (55 % off for the second largest)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3, bias=False)  # MSE: every eigenvalue 3 times
    x, y = torch.randn(20, 5), torch.randn(20, 3)
    H = Hessian(model, torch.nn.functional.mse_loss, (x, y))
    A = _rotated([5.0, 5.0, 5.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]).float()
    for op in (H, A):
        ref = _ordered(torch.linalg.eigvalsh(op.dense() if op is H else A).double(), which)
        for k in (4, 6, 9):
            values = eigenvalues(op, k=k, which=which, generator=_gen(0))
            assert values.dtype == torch.float32
            assert_close(values.double(), ref[:k], rtol=1e-5, atol=1e-5)


def test_defaults_stop_early_and_warn_when_not_converged(hessian):
    H, ref = hessian
    count = {"n": 0}

    class Counted:
        shape, dtype, device = H.shape, H.dtype, H.device

        def __matmul__(self, V):
            count["n"] += 1 if V.dim() == 1 else V.shape[1]
            return H @ V

    values = eigenvalues(Counted(), k=3, generator=_gen(0))
    assert_close(values, torch.linalg.eigvalsh(ref).flip(0)[:3], rtol=1e-6, atol=0)
    assert count["n"] <= 64
    with pytest.warns(RuntimeWarning, match=r"not converged in 4 products .* raise max_iter"):
        eigenvalues(H, k=3, max_iter=4)
    torch.manual_seed(7)
    a = eigenvalues(H, k=2)
    torch.manual_seed(7)
    assert torch.equal(a, eigenvalues(H, k=2))


def test_eigenvalue_errors():
    A = torch.eye(5, dtype=D)
    with pytest.raises(ValueError, match=r"eigenvalues\(Tensor\): k: expected an int in \[1, 5\]"):
        eigenvalues(A, k=6)
    with pytest.raises(ValueError, match=r"which: expected one of 'largest', 'smallest'"):
        eigenvalues(A, which="LA")
    with pytest.raises(ValueError, match=r"max_iter: expected an int >= 3, got 2; .* k \(3\)"):
        eigenvalues(A, k=3, max_iter=2)

    # a matrix that is not symmetric: its Lanczos values matched neither its eigenvalues nor
    # its symmetric part's; a float32 rounding of a symmetric one passes
    B = torch.randn(6, 6, dtype=D, generator=_gen(1))
    for call in (lambda m: eigenvalues(m, k=2), lambda m: spectral_density(m, probes=2)):
        with pytest.raises(ValueError, match=r"op: expected a symmetric matrix.*\(A \+ A.T\) / 2"):
            call(B)
    sym = (B + B.T).float() / 3
    assert_close(eigenvalues(sym, k=1, generator=_gen(0)), torch.linalg.eigvalsh(sym)[-1:])


def test_spectral_density_by_stochastic_lanczos_quadrature():
    lam = torch.cat([torch.full((20,), -1.0), torch.full((30,), 2.0)]).to(D)
    A = torch.diag(lam)
    gen = torch.Generator(torch.get_default_device())
    sd = spectral_density(A, probes=3, steps=10, grid=2001, generator=gen)
    assert isinstance(sd, SpectralDensity) and sd.nodes.shape == (3, 10)
    assert sd.weights.device.type == sd.grid.device.type == "cpu"  # for plotting
    assert_close(sd.weights.sum(1), torch.ones(3, dtype=D, device="cpu"))
    # first moment of each probe's quadrature: z^T A z / n = tr(A) / n for diagonal A
    mean = torch.full((3,), float(lam.mean()), dtype=D, device="cpu")
    assert_close((sd.weights * sd.nodes).sum(1), mean)
    mass_low = torch.trapezoid(sd.density * (sd.grid < 0.5), sd.grid)
    assert abs(float(mass_low) - 0.4) < 1e-6
    assert abs(float(torch.trapezoid(sd.density, sd.grid)) - 1) < 1e-6
    grid = torch.linspace(-3, 3, 7, dtype=D, device="cpu")
    assert torch.equal(spectral_density(A, probes=1, steps=5, grid=grid).grid, grid)
    with pytest.raises(ValueError, match=r"steps: expected an int >= 1"):
        spectral_density(A, steps=0)

"""A user's default device does not move the library's host tensors.

``torch.set_default_device("cuda")`` is how many users put a model on the GPU. Every tensor
factory without ``device=`` then makes a CUDA tensor, including those the library means for
the host: a CPU generator's draw raises there, ``.numpy()`` raises, host bookkeeping syncs at
every write. Such tensors say ``device="cpu"`` (the static check in ``test_device_placement``
lists the rest, which follow the default device by design).

Without a GPU the ``meta`` device stands in for CUDA as the default: a host tensor made on it
is an error as soon as its values are read or mixed with the CPU model's. Each test computes a
result on a CPU model with the CPU as the default device and again with ``meta`` as the
default, and compares the two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import curvature, func, per_example
from gradkit.accumulate._window import float64_compensation

pytestmark = pytest.mark.cpu_only  # the CPU is the model's device, meta the default one

D = torch.float64


@contextmanager
def another_default_device() -> Iterator[None]:
    """The stand-in for ``torch.set_default_device("cuda")``."""
    with torch.device("meta"):
        yield


def _problem() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A CPU model and batch, whatever the default device."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(D)
        return model, (torch.randn(6, 3, dtype=D), torch.randint(0, 3, (6,)))


def _cpu_linspace(start: float, end: float, n: int) -> torch.Tensor:
    return torch.linspace(start, end, n, dtype=D, device="cpu")


def _same_under_another_default(compute: Callable[[], Any]) -> None:
    torch.manual_seed(1)
    want = compute()
    torch.manual_seed(1)
    with another_default_device():
        got = compute()
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12)
    else:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _hessian(**options: Any) -> curvature.Hessian:
    model, batch = _problem()
    return curvature.Hessian(model, F.cross_entropy, batch, **options)


def _to_scipy_matvec(op: Any) -> torch.Tensor:
    import numpy as np

    linear = op.to_scipy()
    assert linear.dtype == np.float64
    v = np.linspace(-1.0, 1.0, op.shape[0])
    return torch.as_tensor(linear.matvec(v), device="cpu")


def test_a_curvature_operator_as_a_scipy_operator():
    _same_under_another_default(lambda: _to_scipy_matvec(_hessian()))


def test_an_hvp_operator_as_a_scipy_operator():
    x = _cpu_linspace(-1.0, 1.0, 5)
    _same_under_another_default(
        lambda: _to_scipy_matvec(func.hvp_operator(lambda t: (t.sin() * t).sum(), x))
    )


def test_check_deterministic_draws_its_vectors_on_the_host():
    def check() -> torch.Tensor:
        _hessian().check_deterministic()
        return torch.zeros(1, device="cpu")

    _same_under_another_default(check)


def test_a_block_diagonal_operator_splits_its_blocks_on_the_host():
    v = _cpu_linspace(-1.0, 1.0, 31)
    _same_under_another_default(lambda: _hessian(blocks="layer") @ v)


def test_the_independence_check_of_batch_jacobian():
    w = _cpu_linspace(-1.0, 1.0, 12).reshape(3, 4)
    x = _cpu_linspace(-2.0, 2.0, 15).reshape(5, 3)
    _same_under_another_default(lambda: func.batch_jacobian(lambda t: (t @ w).tanh(), x))


def test_eigenvalues_trace_diagonal_and_density_without_a_generator():
    _same_under_another_default(lambda: curvature.eigenvalues(_hessian(), k=2))
    _same_under_another_default(lambda: curvature.trace(_hessian(), 9).value)
    _same_under_another_default(
        lambda: curvature.diagonal(_hessian(), 9, method="hutchinson").value
    )
    _same_under_another_default(
        lambda: curvature.spectral_density(_hessian(), probes=2, steps=8, grid=50).density
    )


def test_a_sampled_fisher_without_a_generator():
    def fisher() -> torch.Tensor:
        model, batch = _problem()
        op = curvature.Fisher(model, F.cross_entropy, batch, samples=3)
        return op @ _cpu_linspace(-1.0, 1.0, op.shape[0])

    _same_under_another_default(fisher)


def test_a_grad_scalers_scale_is_rounded_on_the_host():
    def statistics() -> torch.Tensor:
        model, (x, y) = _problem()
        scaler = torch.amp.GradScaler("cpu", init_scale=3.7)
        with per_example.track(model, "variance", loss_scale=scaler) as stats:
            scaler.scale(F.cross_entropy(model(x), y)).backward()
        return stats["0.weight"].variance

    _same_under_another_default(statistics)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.7)
    want = float64_compensation(scaler)
    with another_default_device():
        assert float64_compensation(scaler) == want

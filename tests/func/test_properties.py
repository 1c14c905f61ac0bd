"""Property tests: random shapes and functions, every mode against torch.func in float64."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradkit.func import batch_jacobian, gradients, hessian, hvp, jacobian
from gradkit.testing import assert_close

D = torch.float64


def _gen(seed: int) -> torch.Generator:
    """A seeded generator on the device under test."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


def make_f(seed: int, out_size: int, shape: tuple[int, ...]):
    n = torch.Size(shape).numel()
    W = torch.randn(out_size, n, generator=_gen(seed), dtype=D)

    def f(x):
        flat = x.reshape(-1)
        return torch.tanh(W @ flat.sin()) * flat.sum()

    return f


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    out_size=st.integers(1, 12),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["auto", "forward", "reverse"]),
    chunk=st.sampled_from([None, 1, 5]),
)
def test_jacobian_any_shape(shape, out_size, seed, mode, chunk):
    f = make_f(seed, out_size, shape)
    x = torch.randn(shape, dtype=D, generator=_gen(seed))
    J = jacobian(f, x, mode=mode, chunk_size=chunk)
    assert J.shape == (out_size, *shape)
    assert_close(J, torch.func.jacrev(f)(x))


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000))
def test_hessian_hvp_gradients_agree(shape, seed):
    inner = make_f(seed, 2, shape)
    f = lambda x: inner(x).pow(2).sum()
    gen = _gen(seed)
    x = torch.randn(shape, dtype=D, generator=gen)
    v = torch.randn(shape, dtype=D, generator=gen)
    H = hessian(f, x)
    n = x.numel()
    assert_close(H, torch.func.hessian(f)(x))
    assert_close(hvp(f, x, v)[1], (H.reshape(n, n) @ v.reshape(n)).reshape(shape))
    xr = x.clone().requires_grad_()
    assert_close(gradients(f(xr), xr)[0], torch.func.grad(f)(x))


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4),
    n_in=st.integers(1, 5),
    n_out=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["auto", "forward", "reverse"]),
)
def test_batch_jacobian_vs_vmap_jacrev(b, n_in, n_out, seed, mode):
    W = torch.randn(n_out, n_in, dtype=D, generator=_gen(seed))
    f = lambda x: torch.tanh(x @ W.T) * x.sum(-1, keepdim=True)
    X = torch.randn(b, n_in, dtype=D)
    assert_close(batch_jacobian(f, X, mode=mode), torch.func.vmap(torch.func.jacrev(f))(X))

"""hvp and hvp_operator vs dense Hessians, finite differences and torch.func."""

import pytest
import torch
from torch import nn

from gradkit.func import HVPOperator, hessian, hvp, hvp_operator
from gradkit.testing import assert_close, finite_difference_hvp

D = torch.float64


def test_quadratic_convention_pinned():
    # f(x) = 1/2 x^T A x with non-symmetric A: H = (A + A^T)/2, Hv = (A + A^T)v/2
    A = torch.tensor([[1.0, 2.0], [-3.0, 4.0]], dtype=D)
    v = torch.tensor([1.0, -2.0], dtype=D)
    f = lambda x: 0.5 * x @ A @ x
    x = torch.randn(2, dtype=D)
    _, hv = hvp(f, x, v)
    assert_close(hv, (A + A.T) @ v / 2)
    op = hvp_operator(f, x)
    assert_close([op @ v, op.to_dense()], [(A + A.T) @ v / 2, (A + A.T) / 2])


@pytest.mark.parametrize("act", [nn.Tanh, nn.ReLU])
@pytest.mark.parametrize("method", ["auto", "reverse_over_reverse", "forward_over_reverse"])
def test_hvp_vs_dense_hessian_on_mlp_losses(act, method):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), act(), nn.Linear(5, 2)).to(D)
    X, y = torch.randn(7, 3, dtype=D), torch.tensor([0, 1, 1, 0, 1, 0, 0])
    params = [p.detach() for p in net.parameters()]
    names = [n for n, _ in net.named_parameters()]
    sizes = [p.numel() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])

    def loss(theta):
        parts = {
            n: t.view(p.shape) for n, t, p in zip(names, theta.split(sizes), params, strict=True)
        }
        return nn.functional.cross_entropy(torch.func.functional_call(net, parts, (X,)), y)

    H = hessian(loss, flat)
    v = torch.randn_like(flat)
    value, hv = hvp(loss, flat, v, method=method)
    assert_close([value, hv], [loss(flat), H @ v])
    assert_close(hv, finite_difference_hvp(loss, flat, v), rtol=1e-6, atol=1e-8)
    op = hvp_operator(loss, flat)
    V = torch.randn(flat.numel(), 4, dtype=D)
    assert_close([op @ v, op @ V, op.to_dense()], [H @ v, H @ V, H])
    looped = hvp_operator(loss, flat, vectorize=False)
    assert not looped.vectorize and op.vectorize
    assert_close(looped @ V, H @ V)
    assert_close(op.gradient, torch.func.grad(loss)(flat))


def test_hvp_tuple_args_and_cross_terms():
    f = lambda a, b: (a.sin() * b.sum()).sum() + (b**3).sum()
    a, b = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    va, vb = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    _, (ha, hb) = hvp(f, (a, b), (va, vb))
    H = hessian(f, a, b, argnums=(0, 1))
    assert_close(ha, H[0][0] @ va + H[0][1] @ vb)
    assert_close(hb, H[1][0] @ va + H[1][1] @ vb)
    op = hvp_operator(f, (a, b))
    assert op.shape == (5, 5)
    assert_close(op.unflatten(op @ op.flatten([va, vb])), [ha, hb])


def test_linear_function_gives_zeros_not_exception():
    f = lambda x: (3 * x).sum()
    x, v = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    assert_close(hvp(f, x, v)[1], torch.zeros(4, dtype=D))
    op = hvp_operator(f, x)
    assert_close(
        [op @ v, op @ torch.eye(4, dtype=D)], [torch.zeros(4, dtype=D), torch.zeros(4, 4, dtype=D)]
    )
    # partially linear: an argument with a linear-only role
    g = lambda a, b: (a**2).sum() + (3 * b).sum()
    _, (ha, hb) = hvp(g, (x, x), (v, v))
    assert_close([ha, hb], [2 * v, torch.zeros(4, dtype=D)])


def test_hvp_under_vmap_uses_forward_over_reverse():
    f = lambda x: (x**3).sum()
    x = torch.randn(3, dtype=D)
    V = torch.eye(3, dtype=D)
    rows = torch.func.vmap(lambda v: hvp(f, x, v)[1])(V)
    assert_close(rows, torch.diag(6 * x))


def test_operator_chunked_matmat_and_scipy():
    scipy = pytest.importorskip("scipy")
    del scipy
    A = torch.randn(6, 6, dtype=D)
    A = A @ A.T
    f = lambda x: 0.5 * x @ A @ x
    op = hvp_operator(f, torch.zeros(6, dtype=D), chunk_size=4)
    assert_close(op @ torch.eye(6, dtype=D), A)
    lin = op.to_scipy()
    import numpy as np
    from scipy.sparse.linalg import eigsh

    top = eigsh(lin, k=2, which="LA", return_eigenvectors=False)
    want = torch.linalg.eigvalsh(A)[-2:].cpu().numpy()
    np.testing.assert_allclose(np.sort(top), want, rtol=1e-8)


def test_operator_repr_and_errors():
    op = hvp_operator(lambda x: (x**2).sum(), torch.ones(3))
    assert isinstance(op, HVPOperator) and "shape=(3, 3)" in repr(op)
    with pytest.raises(ValueError, match=r"v: expected a tensor of shape \[3\] or \[3, k\]"):
        op @ torch.ones(4)
    with pytest.raises(ValueError, match="expected a function returning a scalar tensor"):
        hvp_operator(lambda x: x * 2, torch.ones(3))
    with pytest.raises(ValueError, match="method: expected one of"):
        hvp(lambda x: x.sum(), torch.ones(2), torch.ones(2), method="fast")
    with pytest.raises(ValueError, match=r"v\[0\]: expected shape \(2,\)"):
        hvp(lambda x: x.sum(), torch.ones(2), torch.ones(3))
    with pytest.raises(TypeError, match="tensors of one dtype"):
        hvp_operator(lambda a, b: a.sum() + b.sum(), (torch.ones(2), torch.ones(2, dtype=D)))


def test_no_graph_left_on_inputs():
    x = torch.randn(3, requires_grad=True)
    value, hv = hvp(lambda z: (z**3).sum(), x, torch.ones(3))
    assert not hv.requires_grad and not value.requires_grad and x.grad is None


def test_functional_operator_has_no_names():
    op = hvp_operator(lambda x: (x**2).sum(), torch.ones(2))
    assert op.names is None
    with pytest.raises(ValueError, match="use op.unflatten"):
        op.as_dict(torch.ones(2))


def test_matmat_does_not_hide_real_errors(monkeypatch):
    import gradkit.func._hvp as H

    op = hvp_operator(lambda x: (x**3).sum(), torch.ones(3))

    def boom(*a, **k):
        raise RuntimeError("CPU out of memory while allocating")

    monkeypatch.setattr(H, "_second_grads", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        op @ torch.eye(3)


def _group_norm_loss(x):
    w = torch.linspace(0.5, 1.5, 4, dtype=D)
    return (nn.functional.group_norm(x, 2, w) ** 3).sum()


def test_batched_products_through_group_norm_fall_back_to_the_loop():
    """group_norm's batched double backward mis-broadcasts the batch of vectors ("The size of
    tensor a (3) must match the size of tensor b (2)"), an error that names no vmap: the
    product with one vector succeeds, so the columns are taken one at a time."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, 2, dtype=D)
    ref = torch.autograd.functional.hessian(_group_norm_loss, x).reshape(48, 48)
    op = hvp_operator(_group_norm_loss, x)
    V = torch.randn(48, 5, dtype=D)
    assert_close([op.to_dense(), op @ V], [ref, ref @ V])


def test_an_error_of_the_single_product_too_is_raised_not_looped(monkeypatch):
    import gradkit.func._hvp as H

    op = hvp_operator(lambda x: (x**3).sum(), torch.ones(3))
    calls = []

    def boom(*a, **k):
        calls.append(k.get("batched", False))
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (2)")

    monkeypatch.setattr(H, "_second_grads", boom)
    with pytest.raises(RuntimeError, match="The size of tensor a"):
        op @ torch.eye(3)
    assert calls == [True, False]  # the batched product, then one vector alone


@pytest.mark.parametrize("method", ["auto", "reverse_over_reverse", "forward_over_reverse"])
def test_hvp_of_expanded_input_equals_dense_hessian(method):
    """Forward over reverse lays its tangent out like the primal, which shares memory here."""
    torch.manual_seed(0)
    x = torch.randn(3, dtype=D).expand(2, 3)
    f = lambda x: (x**3).sum() + x.prod()
    v = torch.randn(2, 3, dtype=D)
    want = (torch.autograd.functional.hessian(f, x).reshape(6, 6) @ v.reshape(6)).reshape(2, 3)
    assert_close(hvp(f, x, v, method=method)[1], want)
    assert_close(torch.func.vmap(lambda v: hvp(f, x, v)[1])(v[None])[0], want)


def test_integer_function_is_refused():
    with pytest.raises(TypeError, match=r"hvp\(<lambda>\): f: expected a function returning "):
        hvp(lambda x: (x > 0).sum(), torch.ones(2, dtype=D), torch.ones(2, dtype=D))

"""custom_gradient: TF's examples, torch.func composability, errors."""

import pytest
import torch

from gradkit.func import custom_gradient, grad, jacobian


@custom_gradient
def log1pexp(x):
    e = torch.exp(x)
    return torch.log(1 + e), lambda dy: dy * (1 - 1 / (1 + e))


@custom_gradient
def ste_sign(x):
    return torch.sign(x), lambda dy: dy


def test_log1pexp_stable_where_plain_autograd_is_nan():
    x = torch.tensor(100.0, requires_grad=True)
    plain = torch.log(1 + torch.exp(x))
    (g_plain,) = torch.autograd.grad(plain, x)
    assert torch.isnan(g_plain)
    (g,) = torch.autograd.grad(log1pexp(x), x)
    assert g.item() == 1.0


def test_straight_through_sign_vs_plain_sign():
    x = torch.tensor([-0.5, 2.0], requires_grad=True)
    (g,) = torch.autograd.grad(ste_sign(x).sum(), x)
    assert torch.equal(g, torch.ones(2))
    (g0,) = torch.autograd.grad(torch.sign(x).sum(), x)
    assert torch.equal(g0, torch.zeros(2))


def test_under_torch_func_transforms():
    xs = torch.tensor([0.0, 100.0])
    assert torch.equal(grad(log1pexp)(torch.tensor(100.0)), torch.tensor(1.0))
    assert torch.allclose(torch.func.vmap(grad(log1pexp))(xs), torch.tensor([0.5, 1.0]))
    assert torch.allclose(jacobian(log1pexp, xs), torch.diag(torch.tensor([0.5, 1.0])))
    assert torch.allclose(
        jacobian(log1pexp, xs, mode="reverse"), torch.diag(torch.tensor([0.5, 1.0]))
    )
    assert torch.allclose(torch.func.vmap(log1pexp)(xs), torch.log1p(torch.exp(xs)))


def test_second_order_through_autograd_when_grad_fn_uses_inputs():
    @custom_gradient
    def softplus(x):
        return torch.log1p(torch.exp(x)), lambda dy: dy * torch.sigmoid(x)

    x = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(softplus(x), x, create_graph=True)
    (h,) = torch.autograd.grad(g, x)
    s = torch.sigmoid(x.detach())
    assert torch.allclose(h, s * (1 - s))


def test_several_inputs_and_non_tensor_arguments():
    @custom_gradient
    def scaled_mul(a, b, scale):
        return a * b * scale, lambda dy: (dy * b * 10, dy * a)

    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    ga, gb = torch.autograd.grad(scaled_mul(a, b, 2.0).sum(), [a, b])
    assert torch.equal(ga, torch.tensor([30.0, 40.0]))
    assert torch.equal(gb, torch.tensor([1.0, 2.0]))


def test_nested_custom_gradients():
    @custom_gradient
    def outer(x):
        return log1pexp(x) * 2, lambda dy: dy * 5

    x = torch.tensor(1.0, requires_grad=True)
    (g,) = torch.autograd.grad(outer(x), x)
    assert g.item() == 5.0


def test_errors():
    @custom_gradient
    def bad_return(x):
        return x * 2

    with pytest.raises(
        TypeError,
        match=r"custom_gradient\(bad_return\): return value: "
        r"expected \(y, grad_fn\)",
    ):
        bad_return(torch.ones(1, requires_grad=True))

    @custom_gradient
    def too_many(x):
        return x * 2, lambda dy: (dy, dy)

    x = torch.ones(1, requires_grad=True)
    with pytest.raises(ValueError, match=r"grad_fn\(\*dys\): expected 1 gradient"):
        too_many(x).sum().backward()


def test_jacobian_auto_falls_back_to_reverse_without_forward_rule():
    @custom_gradient
    def tile(x):
        return x.repeat(5), lambda dy: dy.view(5, -1).sum(0)

    x = torch.ones(2)
    want = torch.eye(2).repeat(5, 1)
    assert torch.equal(jacobian(tile, x), want)  # 10 outputs > 2 inputs: forward preferred
    with pytest.raises(NotImplementedError, match="jvp"):
        jacobian(tile, x, mode="forward")
    from gradkit.func import batch_jacobian

    @custom_gradient
    def tile_rows(x):
        return x.repeat(1, 5), lambda dy: dy.view(-1, 5, 2).sum(1)

    assert torch.equal(batch_jacobian(tile_rows, torch.ones(3, 2)), want.expand(3, 10, 2))

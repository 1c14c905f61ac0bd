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


# -- captured tensors (TensorFlow's ``variables``) ---------------------------------------------


def _linear_tanh_problem():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    return lin, x


def test_captured_module_weights_get_their_gradient_through_variables():
    lin, x = _linear_tanh_problem()
    seen = []

    @custom_gradient
    def layer(t):
        y = torch.tanh(lin(t))

        def grad_fn(dy, variables=None):
            seen.append(variables)
            dz = dy * (1 - y**2)
            return dz @ lin.weight, [dz.T @ t, dz.sum(0)]

        return y, grad_fn

    from gradkit.func import gradients

    # oracle: plain autograd of the same function without a custom gradient
    ref = torch.autograd.grad(torch.tanh(lin(x)).sum(), [x, lin.weight, lin.bias])
    got = gradients(layer(x).sum(), [x, lin.weight, lin.bias])
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r)
    assert seen[-1][0] is lin.weight and seen[-1][1] is lin.bias
    lin.zero_grad()
    x.grad = None
    layer(x).sum().backward()
    assert torch.allclose(lin.weight.grad, ref[1]) and torch.allclose(lin.bias.grad, ref[2])
    assert torch.allclose(x.grad, ref[0])


def test_a_grad_fn_without_variables_is_a_type_error_naming_the_tensors():
    lin, x = _linear_tanh_problem()

    @custom_gradient
    def layer(t):
        return lin(t), lambda dy: dy @ lin.weight

    with pytest.raises(TypeError, match=r"custom_gradient\(layer\): grad_fn: .*uses lin.weight, "):
        layer(x)
    with torch.no_grad():  # no gradient can be lost: no error
        assert torch.allclose(layer(x), lin(x))
    lin.requires_grad_(False)  # frozen weights are constants: no error either
    (g,) = torch.autograd.grad(layer(x).sum(), x)
    assert torch.allclose(g, torch.ones(4, 2, dtype=torch.float64) @ lin.weight)


class _Holder:
    pass


def test_a_tensor_reached_through_an_object_is_found_by_the_forward():
    holder = _Holder()
    holder.w = torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    calls = []

    def scale(t):
        return t * holder.w

    @custom_gradient
    def scaled(t):
        calls.append(1)
        return scale(t), lambda dy, variables: (dy * holder.w, [(dy * t).sum(0)])

    _, x = _linear_tanh_problem()
    scaled(x).sum().backward()
    ref = torch.autograd.grad((x * holder.w).sum(), holder.w)[0]
    assert torch.allclose(holder.w.grad, ref)
    assert len(calls) == 2  # found on the first call, remembered after
    scaled(x)
    assert len(calls) == 3


def test_variable_gradient_count_and_shape_are_checked():
    lin, x = _linear_tanh_problem()

    @custom_gradient
    def too_few(t):
        return lin(t), lambda dy, variables: (dy @ lin.weight, [dy.T @ t])

    with pytest.raises(ValueError, match=r"expected 2 variable gradient\(s\), one per tensor"):
        too_few(x).sum().backward()

    @custom_gradient
    def wrong_shape(t):
        return lin(t), lambda dy, variables: (dy @ lin.weight, [dy.T @ t, dy])

    with pytest.raises(ValueError, match=r"variable gradient 1: expected a tensor of shape \(2,\)"):
        wrong_shape(x).sum().backward()


def test_tensors_created_inside_the_function_are_not_captured():
    @custom_gradient
    def f(t):
        w = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
        return t * w, lambda dy: dy * w

    _, x = _linear_tanh_problem()
    (g,) = torch.autograd.grad(f(x).sum(), x)
    assert torch.equal(g, torch.full_like(x, 2.0))


def test_decorating_a_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match=r"custom_gradient\(f\): f: expected a callable"):
        custom_gradient(3)


def test_keyword_arguments_are_passed_through_and_not_differentiated():
    @custom_gradient
    def scaled(x, shift, scale=2.0):
        return x * scale + shift, lambda dy: (dy * scale, dy)

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    shift = torch.ones(3, dtype=torch.float64, requires_grad=True)
    out = scaled(x, shift, scale=3.0)
    torch.testing.assert_close(out, x.detach() * 3 + 1)
    gx, gshift = torch.autograd.grad(out.sum(), [x, shift])
    torch.testing.assert_close(gx, torch.full((3,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(gshift, torch.ones(3, dtype=torch.float64))
    g = grad(lambda t: scaled(t, shift.detach(), scale=4.0).sum())(x.detach())
    torch.testing.assert_close(g, torch.full((3,), 4.0, dtype=torch.float64))
    # a keyword tensor that requires grad would silently get no gradient: refused
    with pytest.raises(TypeError, match=r"keyword argument 'shift'.*pass it by position"):
        scaled(x, shift=shift)
    with torch.no_grad():  # nothing is differentiated: any tensor may go by keyword
        torch.testing.assert_close(scaled(x, shift=shift), x * 2 + 1)


def test_hvp_in_forward_over_reverse_through_a_custom_gradient_names_the_fix():
    """Under vmap, hvp runs forward over reverse, which a custom_gradient cannot: torch's bare
    NotImplementedError named neither the call nor the way out."""
    from gradkit import GradkitError
    from gradkit.func import hvp

    @custom_gradient
    def softplus(x):
        return torch.nn.functional.softplus(x), lambda dy: dy * torch.sigmoid(x)

    x = torch.randn(3, dtype=torch.float64)
    eye = torch.eye(3, dtype=torch.float64)
    with pytest.raises(GradkitError, match=r"hvp\(.*method='reverse_over_reverse'"):
        torch.func.vmap(lambda v: hvp(lambda t: softplus(t).sum(), x, v)[1])(eye)
    with pytest.raises(GradkitError, match="forward over reverse: asked for"):
        hvp(lambda t: softplus(t).sum(), x, eye[0], method="forward_over_reverse")
    rows = [hvp(lambda t: softplus(t).sum(), x, v, method="reverse_over_reverse")[1] for v in eye]
    s = torch.sigmoid(x)
    torch.testing.assert_close(torch.stack(rows), torch.diag(s * (1 - s)))


def test_a_gradient_shaped_unlike_its_argument_is_refused():
    """torch's autograd sums a larger gradient down to the input's shape: a grad_fn returning
    ones(4, 2) for an input of shape (2,) gave [4., 4.] without a word."""

    @custom_gradient
    def bad(x):
        return x * 2, lambda dy: torch.ones(4, *x.shape)

    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"gradient 0 of grad_fn\(\*dys\).*shape \(2,\)"):
        bad(x).sum().backward()

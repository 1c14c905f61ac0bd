"""grad, value_and_grad, jvp, vjp, jacobian, batch_jacobian, hessian vs torch.func, gradcheck and
finite differences (float64)."""

import pytest
import torch
from torch import nn

from gradkit import GradkitError
from gradkit.func import (
    batch_jacobian,
    custom_gradient,
    grad,
    hessian,
    jacobian,
    jvp,
    stop_gradient,
    value_and_grad,
    vjp,
)
from gradkit.testing import assert_close, finite_difference_jacobian

D = torch.float64


def mlp(n_in, n_out, hidden=16):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).to(D)


# -- grad / value_and_grad -------------------------------------------------------------------


def test_grad_vs_finite_differences_and_gradcheck():
    f = lambda x: (x.sin() * x).sum()
    x = torch.randn(5, dtype=D)
    assert_close(grad(f)(x), finite_difference_jacobian(f, x), rtol=1e-7, atol=1e-9)
    assert torch.autograd.gradcheck(grad(f), (x.clone().requires_grad_(),))


def test_grad_argnums_and_has_aux():
    f = lambda x, y: ((x * y).sum(), {"prod": x * y})
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    gx, aux = grad(f, has_aux=True)(x, y)
    assert_close([gx, aux["prod"]], [y, x * y])
    (gx, gy), aux = grad(f, argnums=(0, 1), has_aux=True)(x, y)
    assert_close([gx, gy], [y, x])
    (value, aux), gy = value_and_grad(f, argnums=1, has_aux=True)(x, y)
    assert_close([value, gy, aux["prod"]], [torch.tensor(11.0), x, x * y])
    assert_close(grad(f, argnums=-1, has_aux=True)(x, y)[0], x)


def test_grad_errors():
    x = torch.ones(2)
    with pytest.raises(
        ValueError,
        match=r"grad\(<lambda>\): argnums: expected indices in "
        r"\[-1, 1\) \(f was given 1 positional argument\), got 2",
    ):
        grad(lambda x: x.sum(), argnums=2)(x)
    with pytest.raises(TypeError, match="argnums: expected an int or a tuple of ints"):
        grad(lambda x: x.sum(), argnums="0")(x)
    with pytest.raises(ValueError, match="argnums: expected distinct indices"):
        grad(lambda x, y: x.sum(), argnums=(0, -2))(x, x)
    with pytest.raises(ValueError, match="expected a function returning a scalar tensor"):
        grad(lambda x: x * 2)(x)
    with pytest.raises(TypeError, match=r"argument 0: expected a floating-point tensor"):
        grad(lambda x: x.sum())(torch.ones(2, dtype=torch.long))
    with pytest.raises(TypeError, match="has_aux: expected f to return"):
        grad(lambda x: x.sum(), has_aux=True)(x)
    with pytest.raises(TypeError, match="f: expected a callable"):
        grad(3)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_grad_of_a_one_element_output_is_that_of_its_scalar(shape):
    """The scalar check accepted ``[1]`` and torch then raised its own "Expected f(*args) to
    return a scalar Tensor", naming grad_and_value; hvp and hessian take it as its scalar."""
    x = torch.tensor([1.0, 2.0], dtype=D)
    f = lambda v: (v**3).sum().reshape(shape)
    want = 3 * x**2
    assert_close(grad(f)(x), want)
    value, g = value_and_grad(f)(x)
    assert value.shape == () and float(value) == 9.0
    assert_close(g, want)
    (value, aux), g = value_and_grad(lambda v: (f(v), v), has_aux=True)(x)
    assert value.shape == () and torch.equal(aux, x)
    assert_close(g, want)


def test_grad_unused_argument_gives_zeros():
    gx, gy = grad(lambda x, y: x.sum(), argnums=(0, 1))(torch.ones(2), torch.ones(3))
    assert_close(gy, torch.zeros(3))


def test_stop_gradient():
    f = lambda x: (x * stop_gradient(x)).sum()
    x = torch.tensor([3.0, -1.0])
    assert_close(grad(f)(x), x)
    xr = x.clone().requires_grad_()
    f(xr).backward()
    assert_close(xr.grad, x)


# -- jvp / vjp --------------------------------------------------------------------------------


def test_jvp_vjp_vs_jacobian():
    net = mlp(4, 3)
    x, v, u = torch.randn(4, dtype=D), torch.randn(4, dtype=D), torch.randn(3, dtype=D)
    J = finite_difference_jacobian(net, x)
    out, jv = jvp(net, x, v)
    assert_close([out, jv], [net(x), J @ v], rtol=1e-7, atol=1e-9)
    out, uj = vjp(net, x, u)
    assert_close(uj, u @ J, rtol=1e-7, atol=1e-9)


def test_jvp_vjp_tuples_and_errors():
    f = lambda a, b: a * b.sum()
    a, b = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    _, (ga, gb) = vjp(f, (a, b), torch.ones(3, dtype=D))
    assert_close(
        [ga, gb],
        [torch.full((3,), b.sum().item(), dtype=D), torch.full((2,), a.sum().item(), dtype=D)],
    )
    _, t = jvp(f, (a, b), (torch.ones(3, dtype=D), torch.zeros(2, dtype=D)))
    assert_close(t, torch.full((3,), b.sum().item(), dtype=D))
    with pytest.raises(ValueError, match=r"jvp\(<lambda>\): v: expected 2 tensors"):
        jvp(f, (a, b), (a,))
    with pytest.raises(ValueError, match=r"v\[1\]: expected shape \(2,\)"):
        jvp(f, (a, b), (a, a))
    with pytest.raises(ValueError, match=r"vjp\(<lambda>\): v\[0\]: expected shape \(3,\)"):
        vjp(f, (a, b), torch.ones(2))
    with pytest.raises(TypeError, match="args: expected a tensor or a tuple of tensors"):
        vjp(f, [a, 3], torch.ones(3))


# -- jacobian ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n_in,n_out", [(10, 3), (3, 10)])
@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("vectorize", [True, False])
def test_jacobian_modes_agree_with_finite_differences(n_in, n_out, mode, vectorize):
    net = mlp(n_in, n_out)
    x = torch.randn(n_in, dtype=D)
    J = jacobian(net, x, mode=mode, vectorize=vectorize)
    assert J.shape == (n_out, n_in)
    assert_close(J, finite_difference_jacobian(net, x), rtol=1e-7, atol=1e-9)
    assert_close(J, torch.func.jacrev(net)(x))


def test_jacobian_tf_example_and_shapes():
    assert_close(
        jacobian(lambda x: x * x, torch.tensor([1.0, 2.0])), torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    )
    x = torch.randn(2, 3, dtype=D)
    J = jacobian(lambda x: x.sin().sum(0), x)  # [3] from [2, 3]
    assert J.shape == (3, 2, 3)
    assert_close(J, torch.func.jacfwd(lambda x: x.sin().sum(0))(x))


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_jacobian_argnums_tuple_and_chunks(mode):
    f = lambda a, b: torch.cat([a * b.sum(), b.exp()])
    a, b = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    Ja, Jb = jacobian(f, a, b, argnums=(0, 1), mode=mode, chunk_size=2)
    want = torch.func.jacrev(f, argnums=(0, 1))(a, b)
    assert_close([Ja, Jb], list(want))
    assert_close(jacobian(f, a, b, argnums=1, mode=mode), want[1])


def test_jacobian_auto_picks_by_size(monkeypatch):
    import gradkit.func._jacobian as T

    calls = []
    real_fwd, real_rev = T._forward_cols, T._reverse_rows
    monkeypatch.setattr(T, "_forward_cols", lambda *a: calls.append("forward") or real_fwd(*a))
    monkeypatch.setattr(T, "_reverse_rows", lambda *a: calls.append("reverse") or real_rev(*a))
    jacobian(mlp(10, 3), torch.randn(10, dtype=D))
    jacobian(mlp(3, 10), torch.randn(3, dtype=D))
    assert calls == ["reverse", "forward"]


def test_jacobian_auto_remembers_output_size(monkeypatch):
    import gradkit.func._jacobian as T

    probes = []
    real = T._vjp
    monkeypatch.setattr(T, "_vjp", lambda *a: probes.append(1) or real(*a))
    wide = mlp(3, 10)
    x = torch.randn(3, dtype=D)
    first = jacobian(wide, x)
    assert len(probes) == 1  # learned the output size from one reverse-mode forward
    second = jacobian(wide, x)
    assert len(probes) == 1  # forward mode straight away
    assert_close(first, second)
    jacobian(wide, torch.randn(2, 3, dtype=D))  # new shapes: probe again
    assert len(probes) == 2


def test_jacobian_errors():
    x = torch.ones(2)
    with pytest.raises(
        ValueError,
        match=r"jacobian\(<lambda>\): mode: expected one of 'auto', "
        r"'forward', 'reverse', got 'fwd'",
    ):
        jacobian(lambda x: x, x, mode="fwd")
    with pytest.raises(ValueError, match="chunk_size: expected None or an int >= 1, got 0"):
        jacobian(lambda x: x, x, chunk_size=0)
    with pytest.raises(ValueError, match=r"argnums: expected indices in \[-1, 1\)"):
        jacobian(lambda x: x, x, argnums=1)
    with pytest.raises(TypeError, match="f: expected a function returning one tensor"):
        jacobian(lambda x: (x, x), x)


# -- batch_jacobian ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_in,n_out", [(6, 2), (2, 6)])
@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_batch_jacobian_equals_loop_of_jacobians(n_in, n_out, mode):
    net = mlp(n_in, n_out)
    X = torch.randn(5, n_in, dtype=D)
    Jb = batch_jacobian(net, X, mode=mode)
    assert Jb.shape == (5, n_out, n_in)
    assert_close(Jb, torch.stack([jacobian(net, x) for x in X]))


def test_batch_jacobian_tf_example_and_rank():
    X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert_close(
        batch_jacobian(lambda x: x * x, X),
        torch.tensor([[[2.0, 0.0], [0.0, 4.0]], [[6.0, 0.0], [0.0, 8.0]]]),
    )
    X = torch.randn(4, 2, 3, dtype=D)
    f = lambda x: x.sin().sum(-1, keepdim=True) * x
    Jb = batch_jacobian(f, X, chunk_size=2)
    assert Jb.shape == (4, 2, 3, 2, 3)
    assert_close(Jb, torch.func.vmap(torch.func.jacrev(f))(X))


def test_batch_jacobian_errors():
    with pytest.raises(ValueError, match=r"f\(x\): expected leading dimension 3"):
        batch_jacobian(lambda x: x.sum(0, keepdim=True), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"f\(x\): expected leading dimension 3"):
        batch_jacobian(lambda x: x.sum(), torch.ones(3, 2))
    with pytest.raises(ValueError, match="x: expected a tensor with a leading batch dimension"):
        batch_jacobian(lambda x: x, torch.tensor(1.0))


# -- hessian ----------------------------------------------------------------------------------


def test_hessian_quadratic_convention():
    A = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 3.0, 4.0], [0.5, 0.0, 2.0]], dtype=D)
    H = hessian(lambda x: 0.5 * x @ A @ x, torch.randn(3, dtype=D))
    assert_close(H, (A + A.T) / 2)


def test_hessian_vs_torch_func_and_finite_differences():
    net = mlp(4, 1)
    f = lambda x: net(x).squeeze() ** 2
    x = torch.randn(4, dtype=D)
    H = hessian(f, x)
    assert_close(H, torch.func.hessian(f)(x))
    assert_close(H, finite_difference_jacobian(torch.func.grad(f), x), rtol=1e-6, atol=1e-8)
    assert_close(H, H.T)
    assert_close(hessian(f, x, chunk_size=1), H)


def test_hessian_blocks_and_shapes():
    f = lambda a, b: (a.sin().sum() * b.cos()).sum() + (a**2).sum()
    a, b = torch.randn(2, 2, dtype=D), torch.randn(3, dtype=D)
    blocks = hessian(f, a, b, argnums=(0, 1))
    want = torch.func.hessian(f, argnums=(0, 1))(a, b)
    assert blocks[0][1].shape == (2, 2, 3)
    assert_close(blocks, want)
    # non-scalar output: O + X + X
    g = lambda x: x**3
    assert hessian(g, torch.ones(2, dtype=D)).shape == (2, 2, 2)


def test_hessian_errors():
    with pytest.raises(TypeError, match="arguments of one dtype"):
        hessian(
            lambda a, b: a.sum() + b.sum(), torch.ones(2), torch.ones(2, dtype=D), argnums=(0, 1)
        )


# -- inputs whose elements share memory -------------------------------------------------------


def _overlapping_inputs():
    """{id: input}: an expanded tensor (stride 0) and an as_strided view of overlapping
    windows; each logical element is its own variable."""
    torch.manual_seed(0)
    return {
        "expanded": torch.randn(3, dtype=D).expand(2, 3),
        "as_strided": torch.randn(4, dtype=D).as_strided((3, 2), (1, 1)),
    }


_OVERLAP_FUNCTIONS = {
    "repeat": lambda x: x.repeat(4, 2),  # more outputs than inputs: auto picks forward
    "sum0": lambda x: (x * 2).sum(0),
    "nonlinear": lambda x: (x.sin() * x.prod()).repeat(2, 3),
}


@pytest.mark.parametrize("x_id", ["expanded", "as_strided"])
@pytest.mark.parametrize("f_id", sorted(_OVERLAP_FUNCTIONS))
@pytest.mark.parametrize("mode", ["auto", "forward"])
def test_jacobian_of_overlapping_input_equals_reverse_mode(x_id, f_id, mode):
    x, f = _overlapping_inputs()[x_id], _OVERLAP_FUNCTIONS[f_id]
    want = torch.autograd.functional.jacobian(f, x)
    assert_close(jacobian(f, x, mode="reverse"), want)
    assert_close(jacobian(f, x, mode=mode), want)
    assert_close(jacobian(f, x, mode=mode, vectorize=False), want)


@pytest.mark.parametrize("x_id", ["expanded", "as_strided"])
def test_jvp_and_batch_jacobian_of_overlapping_input(x_id):
    x = _overlapping_inputs()[x_id]
    f = _OVERLAP_FUNCTIONS["nonlinear"]
    v = torch.randn(x.shape, dtype=D)
    full = torch.autograd.functional.jacobian(f, x)
    value, jv = jvp(f, x, v)
    assert_close(value, f(x))
    assert_close(jv, (full.reshape(-1, v.numel()) @ v.reshape(-1)).reshape(value.shape))
    g = lambda x: (x.sin() * 3).repeat(1, 2)  # rows to rows
    per_row = torch.autograd.functional.jacobian(g, x)
    want = torch.stack([per_row[i, :, i] for i in range(x.shape[0])])
    for mode in ("auto", "forward", "reverse"):
        assert_close(batch_jacobian(g, x, mode=mode), want)


@pytest.mark.parametrize("x_id", ["expanded", "as_strided"])
def test_hessian_of_overlapping_input(x_id):
    x = _overlapping_inputs()[x_id]
    f = lambda x: (x**3).sum() + x.prod()
    assert_close(hessian(f, x), torch.autograd.functional.hessian(f, x))


# -- outputs without a derivative -------------------------------------------------------------


_INTEGER_OUTPUT = (
    r"f: expected a function returning floating-point or complex tensors, got an output of "
    r"dtype torch.int64; return the floating-point value"
)


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_integer_output_is_refused_in_every_mode(mode):
    x = torch.randn(2, 3, dtype=D)
    f = lambda x: (x > 0).long()
    with pytest.raises(TypeError, match=r"jacobian\(<lambda>\): " + _INTEGER_OUTPUT):
        jacobian(f, x, mode=mode)
    with pytest.raises(TypeError, match=r"batch_jacobian\(<lambda>\): " + _INTEGER_OUTPUT):
        batch_jacobian(f, x, mode=mode)
    with pytest.raises(TypeError, match=r"vjp\(<lambda>\): " + _INTEGER_OUTPUT):
        vjp(f, x, torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"hessian\(<lambda>\): " + _INTEGER_OUTPUT):
        hessian(lambda x: (x > 0).long().sum(), x)
    with pytest.raises(TypeError, match=r"jacobian\(<lambda>\): .* dtype torch.bool"):
        jacobian(lambda x: x > 0, x, mode=mode)


def test_torch_errors_about_f_name_the_call():
    x = torch.randn(3, dtype=D)
    with pytest.raises(GradkitError, match=r"jacobian\(<lambda>\): f: expected a determin"):
        jacobian(lambda x: torch.nn.functional.dropout(x, 0.5).repeat(2), x, mode="forward")
    with pytest.raises(GradkitError, match=r"batch_jacobian\(<lambda>\): .*mode='reverse'"):
        batch_jacobian(lambda x: torch.nn.functional.dropout(x, 0.5).repeat(1, 3), x[:, None])
    with pytest.raises(GradkitError, match=r"jacobian\(<lambda>\): f: .* in place"):
        jacobian(lambda x: x.mul_(2), x.clone(), mode="reverse")


@pytest.mark.parametrize("mode", ["auto", "reverse", "forward"])
def test_complex_jacobians_are_refused_not_conjugated_by_mode(mode):
    """f(z) = z^2 gave 2z in forward mode and its conjugate in reverse mode, and "auto" picked
    the mode by the output's size: the sign of the imaginary part followed it, silently."""
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    with pytest.raises(TypeError, match=r"argument 0: expected a real floating-point tensor"):
        jacobian(lambda t: t * t, z, mode=mode)
    with pytest.raises(TypeError, match=r"x: expected a real floating-point tensor"):
        batch_jacobian(lambda t: t * t, z[:, None], mode=mode)
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    with pytest.raises(TypeError, match=r"f's output: expected a real floating-point tensor"):
        jacobian(lambda t: t * (1 + 1j), x, mode=mode)
    real = jacobian(
        lambda r: torch.view_as_real(torch.view_as_complex(r) ** 2),
        torch.view_as_real(z),
        mode=mode,
    )
    assert_close(real[0, 0, 0, 0], torch.tensor(2.0, dtype=torch.float64))  # d Re(z^2) / d Re z


@pytest.mark.parametrize("fn", ["jacobian", "batch_jacobian"])
def test_a_jacobian_s_dtype_is_the_same_in_every_mode(fn):
    """A float32 input times a float64 constant: reverse mode gave float32, forward mode
    float64, and "auto" picks by the output's size. Every mode gives the wider dtype."""
    const = torch.ones(3, dtype=torch.float64)
    x = torch.randn(2, 3)
    for f in (
        lambda t: t * const,
        lambda t: (t * const).repeat(1, 2),
        lambda t: t.double().float(),
    ):
        got = [
            jacobian(f, x, mode=m) if fn == "jacobian" else batch_jacobian(f, x, mode=m)
            for m in ("reverse", "forward", "auto")
        ]
        assert {g.dtype for g in got} == {torch.promote_types(x.dtype, f(x).dtype)}
        assert_close(got[0], got[1])
        assert_close(got[0], got[2])


# -- torch.func's wrong second derivatives, symmetric ones included ------------------------------


def _log1pexp_custom():
    @custom_gradient
    def log1pexp(x):
        return torch.log1p(torch.exp(x)), lambda dy: dy * torch.sigmoid(x)

    return log1pexp


def _fixed(*shape, seed):
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=D)


def _layer_norm_scaled(s):
    """A scalar scaling a layer_norm's input and its weight: torch.func's Hessian is 9.4 off,
    and (of one variable) symmetric."""
    x, w, b = _fixed(4, 6, seed=0), _fixed(6, seed=1), _fixed(6, seed=2)
    return (nn.functional.layer_norm(x * s, (6,), weight=w * s, bias=b).sin() ** 2).sum()


def _batch_norm_gains(w):
    """Gains feeding a training-mode batch_norm's input and weight: 2.0 off, symmetric."""
    out = nn.functional.batch_norm(_fixed(4, 6, seed=0) * w, None, None, weight=w, training=True)
    return (out.tanh() ** 3).sum()


def _softplus_squared(x):
    return (_log1pexp_custom()(x) ** 2).sum()


@pytest.mark.parametrize(
    "f, point",
    [
        (_layer_norm_scaled, lambda: torch.tensor(0.7, dtype=D)),
        (_batch_norm_gains, lambda: _fixed(6, seed=3)),
        (_softplus_squared, lambda: torch.tensor([0.3, -1.2], dtype=D)),
    ],
    ids=["layer_norm-scalar", "batch_norm-train", "custom_gradient"],
)
def test_hessian_is_checked_by_a_double_backward_product(f, point, caplog):
    x = point()
    n = x.numel()
    with caplog.at_level("WARNING", logger="gradkit.func._transforms"):
        H = hessian(f, x).reshape(n, n)
    want = torch.autograd.functional.hessian(f, x).reshape(n, n)  # double backward
    fd = finite_difference_jacobian(lambda v: torch.func.grad(f)(v).reshape(-1), x).reshape(n, n)
    assert_close(want, fd, rtol=1e-6, atol=1e-6)  # the oracle itself is right
    assert_close(H, want, rtol=1e-10, atol=1e-10)
    raw = torch.func.jacrev(torch.func.jacrev(f))(x).reshape(n, n)
    if (raw - want).abs().max() > 1e-6:  # torch.func is wrong here in this torch
        assert "disagrees with double backward" in caplog.text


def _square_custom():
    @custom_gradient
    def sq(x):
        return x**2, lambda dy: dy * 2 * x

    return sq


def _sqrt_at_zero(square):
    """torch.func drops a custom_gradient's curvature; the sqrt at 0 gives an infinite
    entry, which switched the check off: the finite entries came back 0 for 2, silently."""
    return lambda x: square(x[:2]).sum() + x[2].sqrt()


def _where_nan(square):
    """The same with torch.where's NaN pitfall in one column (rows 0-1 came back 0, NaN)."""

    def f(x):
        tail = x[2:]
        return square(x[:2]).sum() + torch.where(tail > 0, tail.sqrt(), 0.0 * tail).sum()

    return f


def _small_beside_large(square):
    """A wrong entry of 2e-7 beside one of 108 was within the check's tolerance, taken from
    the largest entry (came back 0, silently)."""
    return lambda x: 1e-7 * square(x[0]) + x[1] ** 4


@pytest.mark.parametrize(
    "make, point",
    [
        (_sqrt_at_zero, [1.0, 2.0, 0.0]),
        (_where_nan, [1.0, 2.0, -1.0]),
        (_small_beside_large, [1.0, 3.0]),
    ],
    ids=["inf-entry", "nan-column", "small-entry"],
)
def test_hessian_check_sees_finite_and_small_entries(make, point):
    x = torch.tensor(point, dtype=D)
    H = hessian(make(_square_custom()), x)
    # the oracle: torch's double backward of the same function with the square written out
    want = torch.autograd.functional.hessian(make(lambda t: t**2), x)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(H), finite)
    assert torch.equal(torch.isnan(H), torch.isnan(want))
    assert_close(H[finite], want[finite], rtol=1e-12, atol=0.0)


def test_hessian_under_vmap_is_refused_with_a_worded_error():
    f = lambda v: (v**3).sum()
    with pytest.raises(GradkitError, match="outside torch.func.vmap") as info:
        torch.func.vmap(lambda v: hessian(f, v))(torch.ones(3, 2, dtype=D))
    assert "gradkit.func.hvp" in str(info.value)
    # jacrev of it still works (the symmetry check runs inside a grad transform)
    assert_close(torch.func.jacrev(lambda v: hessian(f, v))(torch.ones(2, dtype=D)).sum(), 12.0)

"""gradients() and hessians(): TensorFlow's contract (reference cases 32-44) on PyTorch graphs."""

import pytest
import torch
from torch import nn

from gradkit.func import AggregationMethod, gradients, hessians
from gradkit.testing import assert_close, finite_difference_jacobian


def test_sums_over_ys():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (g,) = gradients([(x * x).sum(), (3 * x).sum()], x)
    assert_close(g, torch.tensor([5.0, 7.0]))


def test_returns_list_for_single_x():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = gradients((x * x).sum(), x)
    assert isinstance(out, list) and len(out) == 1


def test_non_scalar_y_default_ones_and_explicit_grad_ys():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = x * x
    assert_close(gradients(y, [x]), [torch.tensor([2.0, 4.0])])
    assert_close(gradients(y, [x], [torch.tensor([1.0, 0.0])]), [torch.tensor([2.0, 0.0])])
    # a None entry means ones
    assert_close(
        gradients([y, 3 * x], [x], [None, torch.tensor([1.0, 0.0])]), [torch.tensor([5.0, 4.0])]
    )


def test_grad_ys_length_mismatch():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=r"gradients\(ys, xs\): grad_ys: expected one entry per "
        r"y \(1\), got 2 entries",
    ):
        gradients([x * 2], [x], [torch.ones(2), torch.ones(2)])


def test_grad_ys_shape_mismatch():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"grad_ys\[0\]: expected shape \(2,\)"):
        gradients(x * 2, x, torch.ones(3))


def test_complex_y_needs_grad_ys():
    x = torch.ones(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(TypeError, match="complex"):
        gradients(x * 2, x)
    (g,) = gradients(x * 2, x, torch.ones(2, dtype=torch.complex64))
    assert g is not None and g.dtype == torch.complex64


@pytest.mark.parametrize(
    "mode,expected",
    [("none", lambda: None), ("zero", lambda: torch.zeros(1, 2))],
    ids=["none", "zero"],
)
def test_unconnected(mode, expected):
    # TF's docstring example: ys = ones[3, 1], xs = ones[1, 2]
    x = torch.ones(1, 2, requires_grad=True)
    y = torch.ones(3, 1, requires_grad=True) * 2
    assert_close(gradients(y, [x], unconnected_gradients=mode), [expected()])


def test_unconnected_bad_value():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=r"unconnected_gradients: expected one of 'none', "
        r"'zero', got 'bogus'",
    ):
        gradients(x * 2, x, unconnected_gradients="bogus")


def test_x_without_grad_is_refused_not_reported_unconnected():
    # tf.gradients differentiates w.r.t. any tensor of the graph: d(w.x)/dx = w. PyTorch
    # recorded nothing about an x without requires_grad, so None would be a wrong answer.
    x = torch.ones(2)
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"xs\[0\]: expected a tensor that requires grad"):
        gradients((w * x).sum(), [x, w])
    with pytest.raises(ValueError, match=r"hessians\(ys, xs\): xs\[0\]: .*requires_grad_\(\)"):
        hessians((w * x).sum(), [x])
    # an x that requires grad but that ys do not use is unconnected: None, as in TensorFlow
    u = torch.ones(2, requires_grad=True)
    assert gradients((w * x).sum(), [u, w])[0] is None


def test_stop_gradients_tf_example_and_no_hook_left():
    a = torch.tensor(0.0, requires_grad=True)
    b = 2 * a
    assert_close(
        gradients(a + b, [a, b], stop_gradients=[a, b]), [torch.tensor(1.0), torch.tensor(1.0)]
    )
    assert_close(gradients(a + b, [a, b]), [torch.tensor(3.0), torch.tensor(1.0)])
    # and again with the stop: the graph is reusable (retained) and unchanged
    assert_close(gradients(a + b, [a, b], stop_gradients=b), [torch.tensor(1.0), torch.tensor(1.0)])
    assert_close(gradients(a + b, [a, b]), [torch.tensor(3.0), torch.tensor(1.0)])
    # a plain backward sees no hook either
    (a + b).backward()
    assert_close(a.grad, torch.tensor(3.0))


def test_stop_on_intermediate_x():
    x = torch.tensor(2.0, requires_grad=True)
    h = x * x  # non-leaf
    y = h * 3 + x
    # stopped h: gradient still reported at h, but not propagated through it to x
    assert_close(gradients(y, [x, h], stop_gradients=[h]), [torch.tensor(1.0), torch.tensor(3.0)])
    assert_close(gradients(y, [x, h]), [torch.tensor(13.0), torch.tensor(3.0)])


@pytest.mark.parametrize("mode", ["none", "zero"])
def test_stop_on_only_path_gives_unconnected(mode):
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    h = x.exp()
    y = (h * 2).sum()
    (g,) = gradients(y, [x], stop_gradients=[h], unconnected_gradients=mode)
    if mode == "none":
        assert g is None
    else:
        assert_close(g, torch.zeros(2))


class _CustomSqrt(torch.autograd.Function):
    """sqrt as an autograd.Function: its backward runs on zeros for an undefined gradient."""

    @staticmethod
    def forward(ctx, x):
        out = x.sqrt()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g / (2 * out)


# {id: (x, stopped(x), y(x, s))}: behind each stop is a derivative that is infinite at x = 0,
# where a zero gradient flowing through it would give 0 * inf = NaN
_STOP_CASES = {
    "sqrt": ([0.0, 4.0], torch.sqrt, lambda x, s: (s + x).sum()),
    "log": ([0.0, 1.0], torch.log, lambda x, s: (s.exp() * 0 + x).sum()),
    "deep": ([0.0, 1.0], lambda x: (3 * x.sqrt()).sin(), lambda x, s: (s * x + x).sum()),
    # what the stop was computed from (2 * x) also reaches x directly
    "shared": ([0.0, 1.0], lambda x: (2 * x).sqrt(), None),
    "custom_function": ([0.0, 4.0], _CustomSqrt.apply, lambda x, s: (s * x + x).sum()),
}


@pytest.mark.parametrize("case", sorted(_STOP_CASES))
def test_stop_gradients_equal_detach_oracle(case):
    """Nothing flows past a stopped tensor: the gradient is that of the graph where the stop
    is ``.detach()``ed, finite where a zero pushed through the stop would have made NaN."""
    values, stop, combine = _STOP_CASES[case]
    x = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    if case == "shared":
        a = 2 * x
        s = a.sqrt()
        y = (s * a + a).sum()
        x2 = x.detach().clone().requires_grad_(True)
        a2 = 2 * x2
        y2 = (a2.sqrt().detach() * a2 + a2).sum()
    else:
        s = stop(x)
        y = combine(x, s)
        x2 = x.detach().clone().requires_grad_(True)
        y2 = combine(x2, stop(x2).detach())
    (want,) = torch.autograd.grad(y2, x2)
    assert torch.isfinite(want).all()
    got = gradients(y, [x, s], stop_gradients=[s])
    (want_s,) = torch.autograd.grad(y, s, retain_graph=True)  # a stopped x keeps its own
    assert_close(got, [want, want_s])
    assert_close(gradients(y, x, stop_gradients=s, create_graph=True), [want])
    # the hooks are gone: without the stop, the gradient goes through it again
    assert_close(gradients(y, x), list(torch.autograd.grad(y, x, retain_graph=True)))


def test_stop_cut_path_with_infinite_derivative_is_unconnected():
    x = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    s = x.sqrt()
    assert gradients(s.sum(), x, stop_gradients=s) == [None]
    assert_close(
        gradients(s.sum(), x, stop_gradients=s, unconnected_gradients="zero"),
        [torch.zeros(2, dtype=torch.float64)],
    )


def test_stop_multi_output_op_stops_all_outputs():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    p, q = (x * 1).split(2)  # one op, two outputs
    y = (p * 2).sum() + (q * 3).sum()
    (g,) = gradients(y, [x], stop_gradients=[p])
    assert g is None  # TF stops the op, so q is stopped too


def test_integer_path_is_constant():
    x = torch.tensor([1.2, 2.7], requires_grad=True)
    y = (x.round().long().float() * 5).sum()
    assert gradients(y, [x]) == [None]
    assert_close(gradients(y, [x], unconnected_gradients="zero"), [torch.zeros(2)])
    # mixed: an integer path plus a float path
    y2 = y + (x * 2).sum()
    assert_close(gradients(y2, [x]), [torch.full((2,), 2.0)])


def test_integer_y_and_x():
    x = torch.tensor([1.0], requires_grad=True)
    n = torch.tensor([3])
    assert gradients([n], [x]) == [None]
    assert gradients([x * 2], [n]) == [None]


@pytest.mark.parametrize(
    "method",
    [
        None,
        AggregationMethod.ADD_N,
        AggregationMethod.DEFAULT,
        AggregationMethod.EXPERIMENTAL_TREE,
        AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
        "add_n",
    ],
)
def test_aggregation_methods_identical(method):
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    ys = [x.sin().sum(), (x * x).sum(), x.exp().sum()]
    want = torch.autograd.grad(sum(ys), x, retain_graph=True)[0]
    assert torch.equal(gradients(ys, [x], aggregation_method=method)[0], want)


@pytest.mark.parametrize("method", [3, "fast", True, 1.5])
def test_aggregation_method_invalid(method):
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="aggregation_method"):
        gradients(x * 2, x, aggregation_method=method)


def test_bad_types():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match=r"xs\[1\]: expected a torch.Tensor"):
        gradients(x * 2, [x, 3.0])
    with pytest.raises(TypeError, match="ys: expected a tensor or a list of tensors"):
        gradients(3.0, [x])


def test_matches_finite_differences_float64():
    torch.manual_seed(1)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64)

    def loss(w_, b_):
        return torch.tanh(x @ w_.T + b_).pow(2).sum()

    gw, gb = gradients(loss(w, b), [w, b])
    assert_close(
        gw, finite_difference_jacobian(lambda z: loss(z, b.detach()), w), rtol=1e-7, atol=1e-8
    )
    assert_close(
        gb, finite_difference_jacobian(lambda z: loss(w.detach(), z), b), rtol=1e-7, atol=1e-8
    )


def test_create_graph_gives_second_derivative():
    x = torch.tensor(2.0, requires_grad=True)
    (g,) = gradients(x**3, x, create_graph=True)
    (h,) = gradients(g, x)
    assert_close(h, torch.tensor(12.0))


def test_sparse_embedding_gradient_is_coalesced():
    emb = nn.Embedding(10, 3, sparse=True)
    idx = torch.tensor([1, 4, 1, 1])
    (g,) = gradients(emb(idx).sum(), [emb.weight])
    assert g is not None and g.is_sparse and g.is_coalesced()
    dense = torch.zeros(10, 3)
    dense[1] = 3.0
    dense[4] = 1.0
    assert_close(g.to_dense(), dense)


def test_hessians_any_rank():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    (h,) = hessians((x**3).sum(), x)
    assert h.shape == (2, 3, 2, 3)
    assert_close(h.reshape(6, 6), torch.diag(6 * x.detach().reshape(-1)))


def test_hessians_blocks_without_cross_terms_and_vs_torch_func():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(a, c):
        return (a.sin().sum() * c.cos().sum()) + (a**2).sum()

    hx, hz = hessians(f(x, z), [x, z])
    full = torch.func.hessian(f, argnums=(0, 1))(x.detach(), z.detach())
    assert_close([hx, hz], [full[0][0], full[1][1]])


def test_hessians_through_group_norm_fall_back_to_one_row_at_a_time():
    """group_norm's batched double backward fails with a shape error that names no vmap."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(0.5, 1.5, 4, dtype=torch.float64)
    f = lambda t: (nn.functional.group_norm(t, 2, w) ** 3).sum()
    (h,) = hessians(f(x), x)
    assert_close(h, torch.autograd.functional.hessian(f, x.detach()))


def test_hessians_chunked_and_linear_and_unconnected():
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (h1,) = hessians((x.exp()).sum(), x)
    (h2,) = hessians((x.exp()).sum(), x, chunk_size=3)
    assert_close(h1, h2)
    (lin,) = hessians((3 * x).sum(), x)
    assert_close(lin, torch.zeros(4, 4, dtype=torch.float64))
    u = torch.ones(2, requires_grad=True)
    assert hessians((3 * x).sum(), [u]) == [None]
    assert_close(hessians((3 * x).sum(), [u], unconnected_gradients="zero"), [torch.zeros(2, 2)])


def test_hessians_scalar_x_and_linear_scalar():
    x = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    assert_close(hessians(x**3, x), [torch.tensor(12.0, dtype=torch.float64)])
    assert_close(hessians(3 * x, x), [torch.tensor(0.0, dtype=torch.float64)])

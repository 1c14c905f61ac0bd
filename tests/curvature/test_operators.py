"""Hessian and GGN operators against dense float64 oracles (curvature.md 4.3, cases 1-4 and
9-12): every product route, symmetry, linear models, parameters, buffers, reductions, batches,
custom autograd Functions, float32 bands, conversions and error messages."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import GGN, CurvatureOperator, Fisher, Hessian
from gradkit.testing import assert_close, finite_difference_hvp

from ._oracles import D, Flat, ce_problem, dense_ggn, dense_hessian, mlp, mse_problem


class Point(nn.Module):
    """``model(x) = theta`` (one example), for quadratics of the parameters."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.randn(n, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.theta[None] + 0 * x


def test_quadratic_with_nonsymmetric_matrix_pins_the_convention():
    # f = 1/2 theta^T A theta, A not symmetric: H = (A + A^T)/2, H v = (A + A^T) v / 2
    A = torch.tensor([[1.0, 2.0, 0.0], [-3.0, 4.0, 1.0], [0.5, 0.0, 2.0]], dtype=D)
    model = Point(3)
    data = (torch.zeros(1, 1, dtype=D), torch.zeros(1))
    loss = lambda out, _: 0.5 * out[0] @ A @ out[0]
    H, G = Hessian(model, loss, data), GGN(model, loss, data)
    v = torch.tensor([1.0, -2.0, 0.5], dtype=D)
    S = (A + A.T) / 2
    assert_close([H @ v, H.dense(), G @ v, G.dense()], [S @ v, S, S @ v, S])


PROBLEMS = {
    "tanh-ce": lambda: ce_problem(act=nn.Tanh),
    "relu-ce": lambda: ce_problem(act=nn.ReLU),
    "tanh-mse": lambda: mse_problem(act=nn.Tanh),
    "relu-mse": lambda: mse_problem(act=nn.ReLU),
}


@pytest.mark.parametrize("vectorize", [True, False])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_every_product_route_matches_the_dense_matrices(name, vectorize):
    model, loss_fn, batch = PROBLEMS[name]()
    H_ref, G_ref = dense_hessian(model, loss_fn, [batch]), dense_ggn(model, loss_fn, batch)
    P = H_ref.shape[0]
    v, V = torch.randn(P, dtype=D), torch.randn(P, 5, dtype=D)
    for op, ref in ((Hessian, H_ref), (GGN, G_ref)):
        C = op(model, loss_fn, batch, vectorize=vectorize, chunk_size=2)
        assert C.vectorize is vectorize and C.shape == (P, P)
        d = C.as_dict(v)
        assert_close(
            [C @ v, C.matvec(v), C @ V, C.matmat(V), C.dense(), C.flatten(C @ d)],
            [ref @ v, ref @ v, ref @ V, ref @ V, ref, ref @ v],
        )
        lin = C.to_scipy()  # numpy in and out, on the host
        assert_close(torch.from_numpy(lin @ v.cpu().numpy()), (ref @ v).cpu())
        assert_close(torch.from_numpy(lin.matmat(V.cpu().numpy())), (ref @ V).cpu())


def test_batched_products_through_group_norm_fall_back_to_the_loop():
    """group_norm's batched double backward fails with a shape error that names no vmap ("The
    size of tensor a (4) must match the size of tensor b (2)"); one vector at a time works."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(36, 3)
    ).to(D)
    x, y = torch.randn(4, 2, 5, 5, dtype=D), torch.randint(0, 3, (4,))
    H_ref = dense_hessian(model, F.cross_entropy, [(x, y)])
    G_ref = dense_ggn(model, F.cross_entropy, (x, y))
    V = torch.randn(H_ref.shape[0], 5, dtype=D)
    for op, ref in ((Hessian, H_ref), (GGN, G_ref)):
        C = op(model, F.cross_entropy, (x, y))
        assert C.vectorize
        assert_close([C @ V, C.dense()], [ref @ V, ref])


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_relu_network_ggn_equals_the_hessian_on_layer_blocks(loss):
    # A ReLU network is linear in each layer's (weight, bias) for a fixed activation pattern, so
    # the residual term of the Hessian vanishes on those blocks: with MSE, layer blocks of the
    # GGN and the Hessian are equal. The cross-layer blocks differ (the output is bilinear in
    # two layers' weights), so the full GGN is *not* the Hessian.
    model, loss_fn, batch = (mse_problem if loss == "mse" else ce_problem)(act=nn.ReLU)
    H = Hessian(model, loss_fn, batch, blocks="layer").dense()
    G = GGN(model, loss_fn, batch, blocks="layer").dense()
    assert_close(G, H)
    assert (
        float(
            (dense_ggn(model, loss_fn, batch) - dense_hessian(model, loss_fn, [batch])).abs().max()
        )
        > 1e-3
    )


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_dense_matrices_are_symmetric(name):
    model, loss_fn, batch = PROBLEMS[name]()
    for C in (
        Hessian(model, loss_fn, batch),
        GGN(model, loss_fn, batch),
        Fisher(model, loss_fn, batch, samples=3),
        Fisher(model, loss_fn, batch, kind="empirical"),
    ):
        M = C.dense()
        assert float((M - M.T).abs().max()) <= 1e-12


def test_linear_model_with_summed_mse():
    # H = 2 (I kron X^T X) for W [out, in] flattened row by row; the GGN equals it
    X, Y = torch.randn(7, 4, dtype=D), torch.randn(7, 3, dtype=D)
    model = nn.Linear(4, 3, bias=False).to(D)
    loss = nn.MSELoss(reduction="sum")
    expected = 2 * torch.kron(torch.eye(3, dtype=D), X.T @ X)
    H = Hessian(model, loss, (X, Y), reduction="sum").dense()
    G = GGN(model, loss, (X, Y), reduction="sum").dense()
    assert_close([H, G], [expected, expected])


def test_mean_and_sum_reductions_scale_by_the_batch_size():
    model, _, (x, y) = ce_problem(n=9)
    H_mean = Hessian(model, F.cross_entropy, (x, y)).dense()
    loss_sum = lambda o, t: F.cross_entropy(o, t, reduction="sum")
    for op in (Hessian, GGN):
        C = op(model, loss_sum, (x, y), reduction="sum").dense()
        ref = H_mean if op is Hessian else GGN(model, F.cross_entropy, (x, y)).dense()
        assert_close(C, 9 * ref)
    with pytest.raises(ValueError, match=r"reduction: expected the reduction loss_fn uses \('sum'"):
        Hessian(model, nn.CrossEntropyLoss(reduction="sum"), (x, y))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_several_batches_equal_one_big_batch(reduction):
    model, _, (x, y) = ce_problem(n=10)
    loss = nn.CrossEntropyLoss(reduction=reduction)
    parts = [(x[:3], y[:3]), (x[3:4], y[3:4]), (x[4:], y[4:])]
    v = torch.randn(sum(p.numel() for p in model.parameters()), 3, dtype=D)
    for make in (
        lambda d: Hessian(model, loss, d, reduction=reduction),
        lambda d: GGN(model, loss, d, reduction=reduction),
        lambda d: Fisher(model, loss, d, kind="empirical", reduction=reduction),
        lambda d: Hessian(model, loss, d, reduction=reduction, blocks="layer"),
    ):
        one, many = make((x, y)), make(parts)
        assert many.num_examples == one.num_examples == 10
        assert_close(many @ v, one @ v)
    assert_close(
        dense_hessian(model, loss, parts), Hessian(model, loss, parts, reduction=reduction).dense()
    )


class _WithSpare(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.spare = nn.Linear(2, 2).to(D)  # registered, never called

    def forward(self, x):
        return self.net(x)


def test_unused_parameters_get_zero_rows_and_a_warning_frozen_are_skipped():
    model = _WithSpare(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D))
    model.net[0].bias.requires_grad_(False)
    x, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    for op in (Hessian, GGN):
        with pytest.warns(UserWarning, match=r"\['spare.weight', 'spare.bias'\] do not affect"):
            C = op(model, F.cross_entropy, (x, y))
        assert C.names == [
            "net.0.weight",
            "net.2.weight",
            "net.2.bias",
            "spare.weight",
            "spare.bias",
        ]
        M = C.dense()
        assert M[-6:].abs().max() == 0 and M[:, -6:].abs().max() == 0
        assert M[:-6, :-6].abs().max() > 0
    sub = Hessian(model, F.cross_entropy, (x, y), params=["net.2.bias", "net.2.weight"])
    assert sub.names == ["net.2.weight", "net.2.bias"] and sub.shape == (10, 10)
    with pytest.raises(ValueError, match=r"params: expected parameters with requires_grad=True"):
        Hessian(model, F.cross_entropy, (x, y), params=["net.0.bias"])
    with pytest.raises(ValueError, match=r"params: expected names from model.named_parameters"):
        Hessian(model, F.cross_entropy, (x, y), params=["nope"])


def test_buffers_are_untouched_and_batchnorm_in_training_mode_works():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    before = {n: b.clone() for n, b in model.named_buffers()}
    H = Hessian(model, F.cross_entropy, (x, y))
    G = GGN(model, F.cross_entropy, [(x, y), (x, y)])
    # oracle: finite differences of the gradient (torch.func's Hessian through batch_norm in
    # training mode is wrong on torch 2.13: asymmetric, off by up to 0.4 here)
    oracle = copy.deepcopy(model)
    oracle[1].track_running_stats = False
    oracle[1].running_mean = oracle[1].running_var = None
    f = Flat(oracle)
    v = torch.randn(H.shape[0], dtype=D)
    ref = finite_difference_hvp(lambda t: F.cross_entropy(f.out(t, x), y), f.theta, v)
    assert_close(H @ v, ref, rtol=1e-6, atol=1e-8)
    M = H.dense()
    assert float((M - M.T).abs().max()) <= 1e-12
    G @ v
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    model.eval()  # running statistics: no functional_call, a plain forward
    f = Flat(model)
    ref = finite_difference_hvp(lambda t: F.cross_entropy(f.out(t, x), y), f.theta, v)
    assert_close(Hessian(model, F.cross_entropy, (x, y)) @ v, ref, rtol=1e-6, atol=1e-8)


class _Tanh(torch.autograd.Function):
    """tanh with a differentiable backward and no jvp (reverse mode only)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _OnceTanh(_Tanh):
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _Act(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


def test_custom_function_without_jvp_uses_double_backward_once_differentiable_is_refused():
    model, loss_fn, batch = ce_problem()
    custom = mlp(lambda: _Act(_Tanh))
    custom.load_state_dict(model.state_dict())
    for op in (Hessian, GGN):
        assert_close(op(custom, loss_fn, batch).dense(), op(model, loss_fn, batch).dense())
    once = mlp(lambda: _Act(_OnceTanh))
    for op in (Hessian, GGN):
        with pytest.raises(GradkitError, match=r"cannot be differentiated again.*once_diff"):
            op(once, loss_fn, batch)


def test_float32_products_within_the_documented_band():
    model, loss_fn, batch = ce_problem(n=16, sizes=(8, 16, 4))
    H64 = dense_hessian(model, loss_fn, [batch])
    G64 = dense_ggn(model, loss_fn, batch)
    m32 = model.float()
    b32 = (batch[0].float(), batch[1])
    v = torch.randn(H64.shape[0], dtype=D)
    for op, ref in ((Hessian, H64), (GGN, G64)):
        res = op(m32, loss_fn, b32) @ v.float()
        assert res.dtype == torch.float32
        assert_close(res, (ref @ v).float(), rtol=1e-4, atol=1e-6)


def test_operator_conversions_and_repr():
    model, loss_fn, batch = ce_problem()
    H = Hessian(model, loss_fn, batch, blocks="param")
    assert isinstance(H, CurvatureOperator) and type(H).__module__ == "gradkit.curvature"
    assert repr(H).startswith("Hessian(shape=(51, 51), dtype=torch.float64")
    assert H.blocks == [["0.weight"], ["0.bias"], ["2.weight"], ["2.bias"]]
    v = torch.arange(51, dtype=D)
    assert_close(H.flatten(H.unflatten(v)), v)
    assert H.unflatten(torch.zeros(51, 2, dtype=D))[0].shape == (6, 4, 2)
    assert H.dense(max_size=51).shape == (51, 51)
    assert (H @ torch.zeros(51, 0, dtype=D)).shape == (51, 0)
    op = H.to_scipy()
    assert op.shape == (51, 51) and op.dtype == np.float64


def test_check_deterministic():
    model, loss_fn, batch = ce_problem()
    Hessian(model, loss_fn, [batch, batch]).check_deterministic()
    noisy = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).to(D)
    with pytest.raises(GradkitError, match=r"check_deterministic\(\): two evaluations.*dropout"):
        GGN(noisy, loss_fn, batch).check_deterministic()


def test_errors_name_the_call_the_argument_and_the_fix():
    model, loss_fn, (x, y) = ce_problem()
    with pytest.raises(TypeError, match=r"Hessian\(Sequential\): data: expected a pair"):
        Hessian(model, loss_fn, [(x, y), (x,)])
    with pytest.raises(TypeError, match=r"data: expected a pair .* one-shot iterator"):
        Hessian(model, loss_fn, iter([(x, y)]))
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module"):
        Hessian(lambda t: t, loss_fn, (x, y))
    with pytest.raises(ValueError, match=r"loss_fn: expected a loss returning a floating-point"):
        Hessian(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), (x, y))
    with pytest.raises(ValueError, match=r"blocks: expected 'full', 'layer', 'param' or lists"):
        Hessian(model, loss_fn, (x, y), blocks=[["0.weight"]])
    with pytest.raises(ValueError, match=r"reduction: expected one of 'mean', 'sum'"):
        GGN(model, loss_fn, (x, y), reduction="none")
    H = Hessian(model, loss_fn, (x, y))
    with pytest.raises(ValueError, match=r"Hessian\(Sequential\) @ v: v: expected a tensor of"):
        H @ torch.ones(3, dtype=D)
    with pytest.raises(ValueError, match=r"flatten: tensors: expected exactly the keys"):
        H @ {"0.weight": torch.ones(6, 4)}
    with pytest.raises(GradkitError, match=r"dense\(\): max_size: expected at least the number"):
        H.dense(max_size=10)
    tupled = nn.Sequential(nn.Linear(4, 3), nn.Unflatten(1, (3, 1))).to(D)
    with pytest.raises(
        TypeError, match=r"GGN\(_Pair\): model: expected a model returning one floating"
    ):
        GGN(_Pair(tupled), loss_fn, (x, y))


class _Pair(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x), x


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2).to(D), nn.Linear(1, 2).to(D)

    def forward(self, x1, x2):
        return torch.tanh(self.a(x1)) + self.b(x2)


def test_tuple_inputs_and_no_grad_callers():
    model = _TwoInputs()
    x1, x2, y = torch.randn(5, 3, dtype=D), torch.randn(5, 1, dtype=D), torch.randn(5, 2, dtype=D)
    with torch.no_grad():
        H = Hessian(model, F.mse_loss, ((x1, x2), y))
        G = GGN(model, F.mse_loss, [((x1, x2), y)])
        v = torch.randn(H.shape[0], dtype=D)
        Hv, Gv = H @ v, G @ v
    f = lambda t: F.mse_loss(
        torch.func.functional_call(
            model, dict(zip(H.names, H.unflatten(t), strict=True)), (x1, x2)
        ),
        y,
    )
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert_close(Hv, torch.func.hessian(f)(theta) @ v)
    assert_close(Gv, G.dense() @ v)

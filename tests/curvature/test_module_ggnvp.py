"""``gradkit.func.module_ggnvp``: one GGN-vector product, against the dense float64 oracle
``J^T H_out J`` (``torch.func`` on a flat parameter vector), on the layer-output path and on
every case that must leave it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.curvature import GGN
from gradkit.func import module_ggnvp, module_hvp

from ._oracles import D, ce_problem, dense_ggn, dense_hessian, mse_problem


def _flat(d, names):
    return torch.cat([d[n].reshape(-1) for n in names])


def _vector(model, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return {
        n: torch.randn(p.shape, dtype=p.dtype, generator=g)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _check(model, loss_fn, batch, *, rtol=1e-10):
    v = _vector(model)
    names = list(v)
    got = module_ggnvp(model, loss_fn, batch, v)
    assert list(got) == names
    want = dense_ggn(model, loss_fn, batch) @ _flat(v, names)
    torch.testing.assert_close(_flat(got, names), want, rtol=rtol, atol=1e-12)
    return got, v


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class _Direct(nn.Module):
    """``a.weight`` also read directly (not through a call of ``a``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(torch.tanh(F.linear(h, self.a.weight)))


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.fc(x))))


@pytest.mark.parametrize("problem", [ce_problem, mse_problem])
def test_mlp_on_the_layer_output_path(problem):
    torch.manual_seed(0)
    _check(*problem())


def test_convolution_and_linear():
    torch.manual_seed(0)
    model = _Conv().to(D)
    x, y = torch.randn(5, 2, 4, 4, dtype=D), torch.randint(0, 4, (5,))
    _check(model, F.cross_entropy, (x, y))


def test_other_layers_use_the_plain_trick():
    torch.manual_seed(0)
    model = _Norm().to(D)
    x, y = torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D)
    _check(model, F.mse_loss, (x, y))


def test_a_weight_used_outside_its_layer_leaves_the_layer_path():
    torch.manual_seed(0)
    model = _Direct().to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    _check(model, F.mse_loss, (x, y))


def test_module_hvp_counts_a_weight_used_outside_its_layer():
    """The layer-output HVP once missed the direct use of ``a.weight`` (off by 0.25)."""
    torch.manual_seed(0)
    model = _Direct().to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    v = _vector(model)
    got = module_hvp(model, F.mse_loss, (x, y), v)
    want = dense_hessian(model, F.mse_loss, [(x, y)]) @ _flat(v, list(v))
    torch.testing.assert_close(_flat(got, list(v)), want, rtol=1e-10, atol=1e-12)


def test_inplace_activation_after_a_layer_leaves_the_layer_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2)).to(D)
    x, y = torch.randn(7, 3, dtype=D), torch.randn(7, 2, dtype=D)
    _check(model, F.mse_loss, (x, y))


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2.0 * super().forward(x)


class _SquaredLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight**2, self.bias)


class _StandardizedConv(nn.Conv2d):
    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class _Square(nn.Module):
    """A parametrization: the weight is the square of the parameter."""

    def forward(self, w):
        return w**2


def _not_plain(variant):
    """A model one of whose Linear or Conv layers computes something else than its torch
    class, and its batch."""
    x, y = torch.randn(8, 4, dtype=D), torch.randint(0, 3, (8,))
    first = nn.Linear(4, 6)
    if variant == "subclass":
        first = _ScaledLinear(4, 6)
    elif variant == "squared-weight":
        first = _SquaredLinear(4, 6)
    elif variant == "forward-hook":
        first.register_forward_hook(lambda m, a, out: 2.0 * out)
    elif variant == "forward-pre-hook":
        first.register_forward_pre_hook(lambda m, a: (a[0].sin(),))
    elif variant == "standardized-conv":
        model = nn.Sequential(
            _StandardizedConv(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(27, 3)
        ).to(D)
        return model, (torch.randn(6, 2, 5, 5, dtype=D), torch.randint(0, 3, (6,)))
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(6, 3)).to(D)
    if variant == "parametrized":
        nn.utils.parametrize.register_parametrization(model[0], "weight", _Square())
    return model, (x, y)


@pytest.mark.parametrize(
    "variant",
    [
        "subclass",
        "squared-weight",
        "forward-hook",
        "forward-pre-hook",
        "standardized-conv",
        "parametrized",
        "global-hook",
    ],
)
def test_layers_that_are_not_plain_torch_layers_leave_the_layer_path(variant):
    """The layer-output path recomputes a layer's output with torch's own function: only for
    layers computing exactly that (no overridden forward, no hooks, no parametrization)."""
    torch.manual_seed(0)
    model, batch = _not_plain(variant)
    hook = None
    if variant == "global-hook":
        hook = nn.modules.module.register_module_forward_hook(
            lambda m, a, out: 2.0 * out if isinstance(m, nn.Linear) else None
        )
    try:
        v = _vector(model)
        names = list(v)
        # every parameter, and the first layer's bias with the second layer's parameters
        for chosen in (names, [n for n in names if n[0] != "0" or n.endswith("bias")]):
            sub = {n: v[n] for n in chosen}
            flat_v = torch.cat([(v[n] * (n in chosen)).reshape(-1) for n in names])
            for product, dense in (
                (module_hvp, dense_hessian(model, F.cross_entropy, [batch])),
                (module_ggnvp, dense_ggn(model, F.cross_entropy, batch)),
            ):
                got = product(model, F.cross_entropy, batch, sub)
                assert list(got) == chosen
                parts = (dense @ flat_v).split([v[n].numel() for n in names])
                want = torch.cat([t for n, t in zip(names, parts, strict=True) if n in chosen])
                torch.testing.assert_close(_flat(got, chosen), want, rtol=1e-10, atol=1e-12)
    finally:
        if hook is not None:
            hook.remove()


def test_keys_of_v_pick_the_parameters_and_frozen_ones_are_refused():
    torch.manual_seed(0)
    model, loss_fn, batch = ce_problem()
    full = dense_ggn(model, loss_fn, batch)
    names = [n for n, _ in model.named_parameters()]
    v = _vector(model)
    sub = {"2.weight": v["2.weight"], "0.bias": v["0.bias"]}
    got = module_ggnvp(model, loss_fn, batch, sub)
    assert list(got) == ["2.weight", "0.bias"]  # the order of v, as module_hvp
    sizes = [p.numel() for p in model.parameters()]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    idx = {n: torch.arange(bounds[i], bounds[i + 1]) for i, n in enumerate(names)}
    rows = torch.cat([idx["2.weight"], idx["0.bias"]])
    want = full[rows][:, rows] @ torch.cat([sub["2.weight"].reshape(-1), sub["0.bias"]])
    torch.testing.assert_close(_flat(got, list(got)), want, rtol=1e-10, atol=1e-12)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"module_ggnvp\(Sequential\).*params"):
        module_ggnvp(model, loss_fn, batch, {"0.weight": v["0.weight"]})


def test_equals_the_operator_and_float32_stays_float32():
    torch.manual_seed(0)
    model, loss_fn, batch = ce_problem(n=16, sizes=(8, 16, 4))
    v = _vector(model)
    op = GGN(model, loss_fn, batch)
    want = op @ op.flatten(v)
    torch.testing.assert_close(_flat(module_ggnvp(model, loss_fn, batch, v), op.names), want)
    m32 = model.float()
    with pytest.raises(TypeError, match=r"v\['0.weight'\]: expected dtype torch.float32"):
        module_ggnvp(m32, loss_fn, (batch[0].float(), batch[1]), v)  # not rounded silently
    v32 = {k: t.float() for k, t in v.items()}
    got = module_ggnvp(m32, loss_fn, (batch[0].float(), batch[1]), v32)
    assert all(t.dtype == torch.float32 for t in got.values())
    torch.testing.assert_close(_flat(got, op.names), want.float(), rtol=1e-4, atol=1e-6)


def test_a_loss_linear_in_the_output_gives_zero():
    torch.manual_seed(0)
    model, _, (x, _) = ce_problem()
    got = module_ggnvp(model, lambda out, t: out.sum(), (x, x), _vector(model))
    assert all(t.abs().max() == 0 for t in got.values())


def test_bad_arguments_name_the_call():
    torch.manual_seed(0)
    model, loss_fn, batch = ce_problem()
    v = _vector(model)
    with pytest.raises(TypeError, match=r"module_ggnvp\(Sequential\).*v: expected a dict"):
        module_ggnvp(model, loss_fn, batch, torch.zeros(3))
    with pytest.raises(ValueError, match=r"v\['0.weight'\]: expected shape \(6, 4\)"):
        module_ggnvp(model, loss_fn, batch, {**v, "0.weight": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"batch: expected a pair"):
        module_ggnvp(model, loss_fn, batch[0], v)
    with pytest.raises(TypeError, match=r"model: expected a model returning one floating-point"):
        module_ggnvp(_Pair(model), loss_fn, batch, {"m." + k: t for k, t in v.items()})


class _Pair(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x), x


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def test_attention_reads_out_proj_without_calling_it():
    """``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling ``out_proj``: with
    only Linear parameters chosen, the layer-output path once dropped its terms (off by 0.3)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = _Encoder().to(D)
    x, y = torch.randn(4, 5, 8, dtype=D), torch.randint(0, 3, (4,))
    names = [n for n, _ in model.named_parameters()]
    linear = [n for n in names if "linear" in n or "out_proj" in n or n.startswith("head")]
    v = {n: t for n, t in _vector(model).items() if n in linear}
    for n, p in model.named_parameters():
        p.requires_grad_(n in linear)
    with sdpa_kernel(SDPBackend.MATH):  # the fused kernels have no double backward on the CPU
        ggn = dense_ggn(model, F.cross_entropy, (x, y))
        hess = dense_hessian(model, F.cross_entropy, [(x, y)])
        got_g = module_ggnvp(model, F.cross_entropy, (x, y), v)
        got_h = module_hvp(model, F.cross_entropy, (x, y), v)
    flat_v = _flat(v, linear)
    torch.testing.assert_close(_flat(got_g, linear), ggn @ flat_v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_flat(got_h, linear), hess @ flat_v, rtol=1e-10, atol=1e-12)

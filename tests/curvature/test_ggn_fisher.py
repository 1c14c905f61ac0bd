"""GGN and Fisher against J^T H_out J, per-example gradients and each other; exact diagonals;
block-diagonal operators (curvature.md 4.3, cases 5 and 6)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import GGN, Fisher, Hessian, diagonal, trace
from gradkit.testing import assert_close

from ._oracles import D, ce_problem, dense_ggn, dense_hessian, mlp, mse_problem, per_example, rel


def _gen(seed: int) -> torch.Generator:
    """A seeded generator on the device under test."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def _bce(out, target):
    return F.binary_cross_entropy_with_logits(out, target)


def _sine(out, target):  # separable over examples, not convex in the output
    return (out.sin() * target).sum() / out.shape[0]


LOSSES = {
    "ce": lambda: ce_problem(),
    "mse": lambda: mse_problem(),
    "bce": lambda: (lambda m, _, b: (m, _bce, (b[0], torch.rand_like(b[1]))))(*mse_problem()),
    "sine": lambda: (lambda m, _, b: (m, _sine, b))(*mse_problem()),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_ggn_is_jt_hout_j_psd_for_convex_losses_and_its_diagonal_is_exact(name):
    model, loss_fn, batch = LOSSES[name]()
    G = GGN(model, loss_fn, batch)
    ref = dense_ggn(model, loss_fn, batch)
    assert_close(G.dense(), ref)
    if name != "sine":
        assert float(torch.linalg.eigvalsh(ref).min()) >= -1e-10
    else:
        assert float(torch.linalg.eigvalsh(ref).min()) < -1e-3  # the negative columns path
    d = diagonal(G)
    assert d.probes == 0 and float(d.stderr.abs().max()) == 0
    assert_close(d.value, ref.diagonal())


def test_empirical_fisher_is_the_mean_outer_product_of_individual_gradients():
    """``(1/Z) sum_n g_n g_n^T`` with ``g_n`` the gradient of example ``n``'s terms of the
    summed loss and ``Z`` what the mean divides by: the ``N`` examples of a cross entropy, the
    ``N * D`` entries of an MSE (it was ``N``, a factor ``D`` off for the MSE)."""
    for problem, entries in ((ce_problem, 1), (mse_problem, 3)):
        model, loss_fn, batch = problem(n=7)
        loss_sum = lambda o, t, f=loss_fn: f(o, t, reduction="sum")
        g = per_example(model, loss_sum, batch)  # [N, P]
        z = 7 * entries
        EF = Fisher(model, loss_fn, batch, kind="empirical")
        assert_close([EF.dense(), diagonal(EF).value], [g.T @ g / z, (g * g).sum(0) / z])
        EF_sum = Fisher(model, loss_sum, batch, kind="empirical", reduction="sum")
        assert_close(EF_sum.dense(), g.T @ g)


@pytest.mark.parametrize("problem", [ce_problem, mse_problem])
def test_monte_carlo_fisher_converges_to_the_ggn(problem):
    model, loss_fn, batch = problem(n=64)
    ref = dense_ggn(model, loss_fn, batch)
    errors = []
    for samples in (1, 10, 100):
        gen = _gen(samples)
        Fmc = Fisher(model, loss_fn, batch, samples=samples, generator=gen)
        M = Fmc.dense()
        assert float((M - M.T).abs().max()) <= 1e-12
        assert_close(diagonal(Fmc).value, M.diagonal())
        errors.append(rel(M, ref))
    assert errors[2] < 0.05 and errors[2] < errors[1] < errors[0]
    # the same generator seed gives the same operator; a fixed operator (samples drawn once)
    gen = _gen(3)
    a = Fisher(model, loss_fn, batch, samples=2, generator=gen)
    b = Fisher(model, loss_fn, batch, samples=2, generator=_gen(3))
    v = torch.randn(a.shape[0], dtype=D)
    assert torch.equal(a @ v, b @ v) and torch.equal(a @ v, a @ v)


def test_monte_carlo_fisher_over_batches_is_fixed_and_unbiased():
    model, loss_fn, (x, y) = ce_problem(n=40)
    parts = [(x[:25], y[:25]), (x[25:], y[25:])]
    Fmc = Fisher(model, loss_fn, parts, samples=200, generator=_gen(0))
    v = torch.randn(Fmc.shape[0], dtype=D)
    assert torch.equal(Fmc @ v, Fmc @ v)  # the same samples in every product
    assert rel(Fmc.dense(), dense_ggn(model, loss_fn, (x, y))) < 0.05


def test_likelihood_callable_soft_targets_and_errors():
    model, loss_fn, (x, y) = ce_problem(n=32)
    ref = dense_ggn(model, loss_fn, (x, y))

    def sample(out, gen):
        return torch.multinomial(out.softmax(1), 1, generator=gen)[:, 0]

    F_call = Fisher(model, loss_fn, (x, y), samples=300, likelihood=sample)
    assert rel(F_call.dense(), ref) < 0.06
    soft = F.one_hot(y, 3).to(D)
    F_soft = Fisher(model, loss_fn, (x, soft), samples=300)
    assert rel(F_soft.dense(), ref) < 0.06
    with pytest.raises(ValueError, match=r"likelihood: expected 'categorical', 'gaussian' or a"):
        Fisher(model, lambda o, t: F.cross_entropy(o, t), (x, y))
    smooth = nn.CrossEntropyLoss(label_smoothing=0.1)
    with pytest.raises(GradkitError, match=r"likelihood: expected a loss_fn that is a positive"):
        Fisher(model, smooth, (x, y))
    with pytest.raises(ValueError, match=r"samples: expected 1 for kind='empirical'"):
        Fisher(model, loss_fn, (x, y), kind="empirical", samples=3)
    with pytest.raises(ValueError, match=r"kind: expected one of 'mc', 'empirical'"):
        Fisher(model, loss_fn, (x, y), kind="true")
    with pytest.raises(TypeError, match=r"Fisher\(Sequential\): generator: expected a torch\."):
        Fisher(model, loss_fn, (x, y), generator=0)
    seq = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (3, 2))).to(D)
    with pytest.raises(ValueError, match=r"logits of shape \[N, C\]"):
        Fisher(seq, loss_fn, (x, y[:, None].expand(32, 2)))


def test_exact_diagonals_of_every_operator_and_over_batches():
    model, loss_fn, (x, y) = ce_problem(n=10)
    parts = [(x[:4], y[:4]), (x[4:], y[4:])]
    H_ref = dense_hessian(model, loss_fn, [(x, y)])
    assert_close(diagonal(Hessian(model, loss_fn, parts)).value, H_ref.diagonal())
    assert_close(
        diagonal(GGN(model, loss_fn, parts)).value, dense_ggn(model, loss_fn, (x, y)).diagonal()
    )
    EF = Fisher(model, loss_fn, parts, kind="empirical")
    g = per_example(model, loss_fn, (x, y))
    assert_close(diagonal(EF).value, (g * g).mean(0))


@pytest.mark.parametrize("act", [nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU, nn.Softplus])
def test_exact_hessian_diagonal_of_sequential_mlps_and_the_unit_vector_fallback(act):
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(6, 7), act(), nn.Linear(7, 5), act(), nn.Linear(5, 3)
    ).to(D)
    x, y = torch.randn(9, 2, 3, dtype=D), torch.randint(0, 3, (9,))
    t = torch.randn(9, 3, dtype=D)
    for loss_fn, targets in ((F.cross_entropy, y), (F.mse_loss, t), (_sine, t)):
        parts = [(x[:4], targets[:4]), (x[4:], targets[4:])]
        H = Hessian(model, loss_fn, parts)
        d = diagonal(H, max_size=10)  # the MLP sweep has no size limit
        assert_close(d.value, dense_hessian(model, loss_fn, parts).diagonal())
    coupled = lambda o, t: ((o - t).sum(0) ** 2).sum()  # falls back to unit vectors
    H = Hessian(model, coupled, (x, t))
    assert_close(diagonal(H).value, dense_hessian(model, coupled, [(x, t)]).diagonal())
    with pytest.raises(GradkitError, match=r"max_size: expected at least the number of param"):
        diagonal(H, max_size=10)


@pytest.mark.parametrize(
    "act",
    [nn.ReLU, nn.ELU, lambda inplace: nn.LeakyReLU(0.1, inplace), nn.Hardtanh, nn.SiLU],
    ids=["relu", "elu", "leaky_relu", "hardtanh", "silu"],
)
def test_exact_diagonals_of_mlps_with_in_place_activations(act):
    """An activation with inplace=True writes into its input: the MLP sweep keeps its own
    pre-activations (autograd refused the in-place change of its leaf, in a bare error)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, dtype=D), torch.randint(0, 2, (8,))
    parts = [(x, y)]
    model = nn.Sequential(nn.Linear(3, 5), act(inplace=True), nn.Linear(5, 2)).to(D)
    H, G = Hessian(model, F.cross_entropy, parts), GGN(model, F.cross_entropy, parts)
    want_h = dense_hessian(model, F.cross_entropy, parts)
    assert_close(diagonal(H).value, want_h.diagonal())
    assert_close(trace(H, method="exact").value, want_h.trace())
    assert_close(diagonal(G).value, dense_ggn(model, F.cross_entropy, (x, y)).diagonal())


def test_exact_diagonal_refuses_what_it_cannot_do():
    model, _, (x, y) = mse_problem(n=6)
    coupled = lambda o, t: ((o - t).sum(0) ** 2).sum()  # mixes examples
    with pytest.raises(GradkitError, match=r"the loss couples examples .* method='hutchinson'"):
        diagonal(GGN(model, coupled, (x, y)))
    with pytest.raises(GradkitError, match=r"max_memory: expected room for the per-example loss"):
        diagonal(GGN(model, F.mse_loss, (x, y)), max_memory=10)
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(D)
    with pytest.raises(GradkitError, match=r"per-example gradients are not available .*BatchNorm"):
        diagonal(GGN(bn, F.mse_loss, (x, y)))
    est = diagonal(GGN(bn, F.mse_loss, (x, y)), method="hutchinson", probes=4)
    assert est.value.shape == (21,)


@pytest.mark.parametrize("op", [Hessian, GGN, Fisher])
def test_block_operators_are_exactly_zero_off_the_blocks(op):
    model, loss_fn, batch = ce_problem()

    def make(**kw):
        if op is Fisher:
            kw["generator"] = _gen(0)
        return op(model, loss_fn, batch, **kw)

    M = make().dense()
    groups = [["0.weight", "2.bias"], ["0.bias", "2.weight"]]
    layouts = [
        ("layer", [range(0, 30), range(30, 51)]),
        (groups, [[*range(0, 24), *range(48, 51)], range(24, 48)]),
    ]
    for blocks, layout in layouts:
        B = make(blocks=blocks).dense()
        mask = torch.zeros(51, 51, dtype=torch.bool)
        for idx in layout:
            i = torch.tensor(list(idx))
            mask[i[:, None], i[None, :]] = True
        assert torch.equal(B[~mask], torch.zeros_like(B[~mask]))
        assert_close(B[mask], M[mask])


class _Wrapped(nn.Module):
    """The same MLP behind a module that is no nn.Sequential: exact diagonals take the
    per-example route (one backward per column) instead of the sweep through the layers."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


# Tanh, Sigmoid, ReLU and LeakyReLU take closed-form slopes in the sweep, GELU autograd's
@pytest.mark.parametrize("act", [nn.Tanh, nn.ReLU, nn.GELU, nn.Sigmoid, lambda: nn.LeakyReLU(0.2)])
@pytest.mark.parametrize("name", ["ce", "mse", "sine", "fisher_mc", "fisher_empirical"])
def test_the_mlp_sweep_equals_per_example_gradients_and_the_dense_diagonal(name, act):
    torch.manual_seed(1)
    sweep_model = nn.Sequential(
        nn.Flatten(), nn.Linear(6, 7), act(), nn.Linear(7, 5), act(), nn.Linear(5, 3)
    ).to(D)
    x = torch.randn(9, 2, 3, dtype=D)
    y = (
        torch.randint(0, 3, (9,))
        if name != "mse" and name != "sine"
        else torch.randn(9, 3, dtype=D)
    )
    loss_fn = {"mse": F.mse_loss, "sine": _sine}.get(name, F.cross_entropy)
    parts = [(x[:4], y[:4]), (x[4:], y[4:])]

    def op(model):
        if name.startswith("fisher"):
            kind = name.split("_")[1]
            gen = _gen(0)
            samples = 3 if kind == "mc" else 1
            return Fisher(model, loss_fn, parts, kind=kind, samples=samples, generator=gen)
        return GGN(model, loss_fn, parts)

    swept = diagonal(op(sweep_model)).value
    per_ex = diagonal(op(_Wrapped(sweep_model))).value
    assert_close(swept, per_ex)
    if not name.startswith("fisher"):
        flat_x = x.flatten(1)
        assert_close(swept, dense_ggn(sweep_model, loss_fn, (flat_x.view(9, 2, 3), y)).diagonal())


def test_the_exact_ggn_diagonal_of_a_cnn_takes_per_example_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).to(
        D
    )
    x, y = torch.randn(5, 1, 6, 6, dtype=D), torch.randint(0, 3, (5,))
    d = diagonal(GGN(model, F.cross_entropy, (x, y)))
    assert_close(d.value, dense_ggn(model, F.cross_entropy, (x, y)).diagonal())


@pytest.mark.parametrize("problem", [ce_problem, mse_problem])
def test_float32_exact_diagonals_and_traces_of_sequential_mlps(problem):
    """The MLP sweep computes in float64 for a float32 model too, and returns float32."""
    from gradkit.curvature import trace

    torch.manual_seed(4)
    model, loss_fn, batch = problem(n=16, sizes=(5, 8, 3))
    refs = {
        Hessian: dense_hessian(model, loss_fn, [batch]),
        GGN: dense_ggn(model, loss_fn, batch),
    }
    m32 = model.float()
    b32 = (batch[0].float(), batch[1].float() if batch[1].is_floating_point() else batch[1])
    for op, ref in refs.items():
        A = op(m32, loss_fn, b32)
        d = diagonal(A).value
        t = trace(A, method="exact").value
        assert d.dtype == torch.float32
        assert_close(d, ref.diagonal().float(), rtol=1e-4, atol=1e-6)
        assert_close(t.double(), ref.trace(), rtol=1e-4, atol=1e-6)


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class _SquaredLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight**2, self.bias)


class _DoubledTanh(nn.Tanh):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).repeat(1, 2)[:, : x.shape[1]] + x.flip(1).tanh()


class _Square(nn.Module):
    """A parametrization: the weight is the square of the parameter."""

    def forward(self, w):
        return w**2


def _not_plain_mlp(variant: str) -> nn.Sequential:
    """An ``nn.Sequential`` MLP one of whose layers computes something else than its torch
    class (the closed forms of the MLP sweep do not hold for it)."""
    first: nn.Module = nn.Linear(4, 6)
    act: nn.Module = nn.Tanh()
    if variant == "subclass":
        first = _ScaledLinear(4, 6)
    elif variant == "squared-weight":
        first = _SquaredLinear(4, 6)
    elif variant == "coupling-activation":
        act = _DoubledTanh()
    elif variant == "forward-hook":
        first.register_forward_hook(lambda m, a, out: 2.0 * out)
    elif variant == "forward-pre-hook":
        first.register_forward_pre_hook(lambda m, a: (a[0].sin(),))
    elif variant == "activation-hook":
        act.register_forward_hook(lambda m, a, out: 0.5 * out)
    model = nn.Sequential(first, act, nn.Linear(6, 3)).to(D)
    if variant == "parametrized":
        nn.utils.parametrize.register_parametrization(model[0], "weight", _Square())
    return model


@pytest.mark.parametrize(
    "variant",
    [
        "subclass",
        "squared-weight",
        "coupling-activation",
        "forward-hook",
        "forward-pre-hook",
        "activation-hook",
        "parametrized",
        "global-hook",
    ],
)
def test_exact_diagonals_of_layers_that_are_not_plain_torch_layers(variant):
    """The MLP sweep's closed forms hold for layers computing exactly what nn.Linear and the
    activations compute; for anything else the exact diagonal and trace take the generic
    route and stay exact."""
    from gradkit.curvature import trace

    torch.manual_seed(3)
    model = _not_plain_mlp(variant)
    x, y = torch.randn(10, 4, dtype=D), torch.randint(0, 3, (10,))
    hook = None
    if variant == "global-hook":
        hook = nn.modules.module.register_module_forward_hook(
            lambda m, a, out: 2.0 * out if isinstance(m, nn.Linear) else None
        )
    try:
        H_ref = dense_hessian(model, F.cross_entropy, [(x, y)])
        G_ref = dense_ggn(model, F.cross_entropy, (x, y))
        g = per_example(model, F.cross_entropy, (x, y))
        EF_ref = g.T @ g / 10
        ops = [
            (Hessian(model, F.cross_entropy, (x, y)), H_ref),
            (GGN(model, F.cross_entropy, (x, y)), G_ref),
            (Fisher(model, F.cross_entropy, (x, y), kind="empirical"), EF_ref),
        ]
        if variant == "global-hook":  # the Hessian's sweep; the others go per example
            ops = ops[:1]
        for op, ref in ops:
            assert_close(diagonal(op).value, ref.diagonal())
            assert_close(trace(op, method="exact").value, ref.trace())
    finally:
        if hook is not None:
            hook.remove()


@pytest.mark.parametrize(
    "options",
    [
        lambda: {},
        lambda: {"reduction": "sum"},
        lambda: {"weight": torch.tensor([0.5, 2.0, 1.0], dtype=D)},
        lambda: {"ignore_index": 1},
        lambda: {"label_smoothing": 0.2},
    ],
    ids=["mean", "sum", "class-weights", "ignore-index", "label-smoothing"],
)
def test_cross_entropy_factors_in_closed_form_are_exact(monkeypatch, options):
    """A softmax cross entropy's output Hessian is c_n (diag(p) - p p^T): its factors come in
    closed form (no eigendecomposition), for every option of the loss."""
    import gradkit.curvature._ggn as ggn

    def refuse(*args, **kwargs):
        raise AssertionError("the general eigendecomposition was used")

    monkeypatch.setattr(ggn, "loss_hessian_blocks", refuse)
    torch.manual_seed(2)
    kwargs = options()
    loss_fn = lambda o, t: F.cross_entropy(o, t, **kwargs)
    for model in (mlp(), _Wrapped(mlp())):  # the MLP sweep and the per-example route
        x, y = torch.randn(8, 4, dtype=D), torch.randint(0, 3, (8,))
        d = diagonal(GGN(model, loss_fn, (x, y)))
        assert_close(d.value, dense_ggn(model, loss_fn, (x, y)).diagonal())


def test_other_losses_fall_back_to_the_eigendecomposition():
    import gradkit.curvature._ggn as ggn

    model, loss_fn, batch = mse_problem(n=6)
    assert ggn._softmax_factors(GGN(model, loss_fn, batch)._data, model(batch[0]), batch[1]) is None
    model, loss_fn, batch = LOSSES["sine"]()
    assert ggn._softmax_factors(GGN(model, loss_fn, batch)._data, model(batch[0]), batch[1]) is None


class _Center(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True)


@pytest.mark.parametrize("kind", ["ggn", "empirical", "mc"])
def test_exact_diagonals_refuse_a_model_that_mixes_examples(kind):
    # found by a probe: centering over the batch between two Linears gave exact diagonals
    # 17 to 47 % off the operator's own products, and traces up to 40 % off, silently
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), _Center(), nn.Linear(6, 3)).to(D)
    x, y = torch.randn(9, 5, dtype=D), torch.randint(0, 3, (9,))
    if kind == "ggn":
        op = GGN(model, F.cross_entropy, (x, y))
    elif kind == "empirical":
        op = Fisher(model, F.cross_entropy, (x, y), kind="empirical")
    else:
        op = Fisher(model, F.cross_entropy, (x, y), samples=4, generator=_gen(0))
    with pytest.raises(GradkitError, match=r"per-example gradients are not available .*mix"):
        diagonal(op)
    with pytest.raises(GradkitError, match=r"per-example gradients are not available .*mix"):
        trace(op, method="exact")
    dense = op @ torch.eye(sum(p.numel() for p in model.parameters()), dtype=D)
    est = diagonal(op, method="hutchinson", probes=4000, generator=_gen(1))
    assert_close(est.value, dense.diagonal(), rtol=0.2, atol=0.05)


def test_the_empirical_fisher_leaves_the_random_stream_as_it_was():
    """Only the Monte Carlo Fisher samples; the empirical one drew a seed all the same, which
    moved the caller's next dropout mask."""
    model, loss_fn, batch = ce_problem()

    def states() -> list[torch.Tensor]:  # the CPU's generator and CUDA's, where there
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return [torch.get_rng_state(), *cuda]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(s, t) for s, t in zip(a, b, strict=True))

    torch.manual_seed(0)
    want = states()
    F_emp = Fisher(model, loss_fn, batch, kind="empirical")
    assert same(states(), want)
    Fisher(model, loss_fn, batch, kind="mc")  # draws its seed (the CPU's), as documented
    assert not same(states(), want)
    assert F_emp.dense().shape[0] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("inputs", ["dict", "list"])
def test_inputs_that_are_not_a_tensor_or_tuple_are_named(inputs):
    model, loss_fn, (x, y) = ce_problem()
    given = {"x": x} if inputs == "dict" else [x]
    with pytest.raises(TypeError, match=rf"data\[0\]: expected the inputs .* got a {inputs}"):
        Hessian(model, loss_fn, (given, y))

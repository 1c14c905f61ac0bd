"""Module helpers: training-mode BatchNorm, one-element losses, dtypes of v, detached results.

Oracles: central finite differences (float64) of gradients computed by plain autograd on a
functional copy of the model, and torch.func where it is right (no layer_norm, no
buffers)."""

import copy

import pytest
import torch
from torch import nn

from gradkit import GradkitError
from gradkit.func import (
    module_ggnvp,
    module_grad,
    module_hessian,
    module_hvp,
    module_hvp_operator,
    module_jacobian,
    module_value_and_grad,
)
from gradkit.testing import assert_close

D = torch.float64
MSE = nn.functional.mse_loss


def bn_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    model = model.to(D).train()
    batch = (torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D))
    return model, batch


def functional(model):
    """``(theta0, out_of)``: the model's output as a function of its flat parameters, on fresh
    copies of its buffers (plain autograd, no torch.func transform)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]

    def out_of(theta, x):
        state = {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes, strict=True)}
        state.update({n: b.clone() for n, b in model.named_buffers()})
        return torch.func.functional_call(model, state, (x,))

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), out_of


def fd_hessian(model, batch, eps=1e-5):
    theta0, out_of = functional(model)

    def grad_at(theta):
        theta = theta.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(MSE(out_of(theta, batch[0]), batch[1]), theta)
        return g

    cols = []
    for k in range(theta0.numel()):
        e = torch.zeros_like(theta0)
        e[k] = eps
        cols.append((grad_at(theta0 + e) - grad_at(theta0 - e)) / (2 * eps))
    return torch.stack(cols, dim=1)


def fd_jacobian(model, x, eps=1e-6):
    theta0, out_of = functional(model)
    cols = []
    with torch.no_grad():
        for k in range(theta0.numel()):
            e = torch.zeros_like(theta0)
            e[k] = eps
            cols.append((out_of(theta0 + e, x) - out_of(theta0 - e, x)) / (2 * eps))
    return torch.stack(cols, dim=-1)


HELPERS = {
    "grad": lambda m, b: module_grad(m, MSE, b),
    "value_and_grad": lambda m, b: module_value_and_grad(m, MSE, b),
    "hvp": lambda m, b: module_hvp(
        m, MSE, b, {n: torch.ones_like(p) for n, p in m.named_parameters()}
    ),
    "ggnvp": lambda m, b: module_ggnvp(
        m, MSE, b, {n: torch.ones_like(p) for n, p in m.named_parameters()}
    ),
    "hvp_operator": lambda m, b: module_hvp_operator(m, MSE, b).to_dense(),
    "hessian": lambda m, b: module_hessian(m, MSE, b, flat=True),
    "jacobian": lambda m, b: module_jacobian(m, b[0]),
}


@pytest.mark.parametrize("helper", list(HELPERS))
def test_train_mode_batchnorm_writes_nothing_to_the_model(helper):
    """The helpers updated running_mean, running_var and num_batches_tracked (module_grad,
    module_hvp, module_ggnvp, module_hvp_operator) or refused the model (module_hessian,
    module_jacobian); they run on copies of the buffers."""
    model, batch = bn_setup()
    before = copy.deepcopy(model.state_dict())
    HELPERS[helper](model, batch)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.training and model[1].training


def test_train_mode_batchnorm_hessian_matches_finite_differences():
    model, batch = bn_setup()
    want = fd_hessian(model, batch)
    H = module_hessian(model, MSE, batch, flat=True)
    assert H.shape == want.shape == (34, 34)
    assert_close(H, want, atol=1e-6, rtol=1e-6)
    # and the batch statistics are those of the batch: the eval-mode Hessian is another one
    assert (
        H - module_hessian(copy.deepcopy(model).eval(), MSE, batch, flat=True)
    ).abs().max() > 1e-2
    blocks = module_hessian(model, MSE, batch)
    assert blocks["1.weight"]["0.bias"].shape == (4, 4)
    assert_close(blocks["1.weight"]["0.bias"], want[16:20, 12:16], atol=1e-6, rtol=1e-6)
    v = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    hv = module_hvp(model, MSE, batch, v)
    assert_close(
        torch.cat([t.reshape(-1) for t in hv.values()]),
        want @ torch.cat([t.reshape(-1) for t in v.values()]),
        atol=1e-6,
        rtol=1e-6,
    )


def test_train_mode_batchnorm_layer_output_route_matches_finite_differences():
    # v on the Linear layers only: module_hvp and module_ggnvp stop at the layer outputs
    model, batch = bn_setup()
    want = fd_hessian(model, batch)
    names = ["0.weight", "0.bias", "3.weight", "3.bias"]
    v = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    mask = torch.cat(
        [torch.full((p.numel(),), float(n in names), dtype=D) for n, p in model.named_parameters()]
    )
    hv = want @ (torch.cat([t.reshape(-1) for t in v.values()]) * mask)
    got = module_hvp(model, MSE, batch, {n: v[n] for n in names})
    sizes = [p.numel() for p in model.parameters()]
    split = dict(zip([n for n, _ in model.named_parameters()], hv.split(sizes), strict=True))
    for n in names:
        assert_close(got[n].reshape(-1), split[n], atol=1e-6, rtol=1e-6)
    before = copy.deepcopy(model.state_dict())
    module_ggnvp(model, MSE, batch, {n: v[n] for n in names})
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_errors_of_the_inner_transform_name_the_module_helper():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    with pytest.raises(
        GradkitError,
        match=r"^module_jacobian\(Sequential\): model: expected a deterministic function",
    ):
        module_jacobian(model, torch.randn(5, 3), mode="forward")
    with pytest.raises(
        TypeError,
        match=r"^module_hessian\(Sequential\): loss_fn\(model\(inputs\), targets\): expected a "
        r"function returning floating-point",
    ):
        module_hessian(model.eval(), lambda o, t: (o > 0).sum(), (torch.randn(5, 3), None))


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_train_mode_batchnorm_jacobian_matches_finite_differences(mode):
    model, batch = bn_setup()
    want = fd_jacobian(model, batch[0])
    J = module_jacobian(model, batch[0], mode=mode)
    got = torch.cat([J[n].reshape(6, 2, -1) for n, _ in model.named_parameters()], dim=-1)
    assert_close(got, want, atol=1e-7, rtol=1e-7)
    assert not any(t.requires_grad for t in J.values())


def test_a_one_element_loss_is_the_scalar():
    """A loss of shape [1] gave module_hessian(flat=True) a [1, P, P] Hessian and made the dict
    form raise torch's split_with_sizes error."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(D)
    batch = (torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D))

    def loss(o, t):
        return ((o - t) ** 2).sum().reshape(1)

    theta0, out_of = functional(model)
    want = torch.func.hessian(lambda th: ((out_of(th, batch[0]) - batch[1]) ** 2).sum())(theta0)
    H = module_hessian(model, loss, batch, flat=True)
    assert H.shape == (8, 8)
    assert_close(H, want)
    blocks = module_hessian(model, loss, batch)
    assert_close(blocks["weight"]["weight"], want[:6, :6].reshape(2, 3, 2, 3))
    assert_close(blocks["bias"]["weight"], want[6:, :6].reshape(2, 2, 3))
    value, _ = module_value_and_grad(model, loss, batch)
    assert value.shape == ()
    assert module_hvp_operator(model, loss, batch).value.shape == ()


def test_hessian_and_jacobian_of_a_subset_are_detached():
    """module_hessian(params=subset) returned a tensor attached to the graph of the other
    parameters (module_hvp's results are detached)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    batch = (torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D))
    names = ["0.weight", "2.bias"]
    H = module_hessian(model, MSE, batch, params=names, flat=True)
    assert not H.requires_grad and H.grad_fn is None
    theta0, out_of = functional(model)
    idx = torch.cat([torch.arange(0, 12), torch.arange(24, 26)])
    want = torch.func.hessian(lambda th: MSE(out_of(th, batch[0]), batch[1]))(theta0)
    want = want[idx][:, idx]
    assert_close(H, want)
    blocks = module_hessian(model, MSE, batch, params=names)
    assert not any(b.requires_grad for row in blocks.values() for b in row.values())
    J = module_jacobian(model, batch[0], params=names)
    assert not any(t.requires_grad for t in J.values())
    Jw = torch.func.jacrev(lambda th: out_of(th, batch[0]))(theta0)
    assert_close(J["0.weight"], Jw[..., :12].reshape(5, 2, 4, 3))


def test_module_jacobian_of_a_tuple_output_names_the_call():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x), self.lin(x).sum()

    # the functional route, and the autograd route of a model updating its buffers
    for model in (Pair(), nn.Sequential(nn.BatchNorm1d(2), Pair()).train()):
        with pytest.raises(
            TypeError,
            match=r"^module_jacobian\((Pair|Sequential)\): model: expected a model returning one "
            r"tensor, got tuple\[Tensor",
        ):
            module_jacobian(model, torch.randn(3, 2))

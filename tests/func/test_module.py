"""Module helpers: results keyed like named_parameters, vs functional oracles."""

import pytest
import torch
from torch import nn

from gradkit.func import (
    hessian,
    module_grad,
    module_hessian,
    module_hvp,
    module_hvp_operator,
    module_jacobian,
    module_value_and_grad,
)
from gradkit.testing import assert_close

D = torch.float64


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    return model, nn.functional.cross_entropy, batch


def flat_loss(model, loss_fn, batch):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]

    def f(theta):
        params = {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes, strict=True)}
        return loss_fn(torch.func.functional_call(model, params, (batch[0],)), batch[1])

    return f, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_grad_matches_backward_and_leaves_grad_alone():
    model, loss_fn, batch = setup()
    loss, g = module_value_and_grad(model, loss_fn, batch)
    assert all(p.grad is None for p in model.parameters())
    loss_fn(model(batch[0]), batch[1]).backward()
    assert_close(g, {n: p.grad for n, p in model.named_parameters()})
    assert list(module_grad(model, loss_fn, batch)) == [n for n, _ in model.named_parameters()]


def test_frozen_and_selected_params():
    model, loss_fn, batch = setup()
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in module_grad(model, loss_fn, batch)
    g = module_grad(model, loss_fn, batch, params=["2.bias"])
    assert list(g) == ["2.bias"]
    with pytest.raises(
        ValueError,
        match=r"params: expected names from "
        r"model.named_parameters\(\), got \['nope'\]",
    ):
        module_grad(model, loss_fn, batch, params=["nope"])


def test_hessian_hvp_operator_agree_with_flat_oracle():
    model, loss_fn, batch = setup()
    f, theta = flat_loss(model, loss_fn, batch)
    H = hessian(f, theta)
    assert_close(module_hessian(model, loss_fn, batch, flat=True), H)
    blocks = module_hessian(model, loss_fn, batch)
    assert blocks["0.weight"]["2.bias"].shape == (4, 3, 2)
    assert_close(blocks["0.weight"]["0.weight"].reshape(12, 12), H[:12, :12])
    op = module_hvp_operator(model, loss_fn, batch)
    v = torch.randn(theta.numel(), dtype=D)
    assert_close(op @ v, H @ v)
    assert op.names == [n for n, _ in model.named_parameters()]
    vd = op.as_dict(v)
    hv = module_hvp(model, loss_fn, batch, vd)
    assert_close(hv, op.as_dict(H @ v))


def test_unused_parameter_gives_zero_block_not_error():
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(2, 1)
            self.spare = nn.Linear(2, 1)

        def forward(self, x):
            return self.used(x)

    model = WithSpare().to(D)
    batch = (torch.randn(4, 2, dtype=D), torch.randn(4, 1, dtype=D))
    g = module_grad(model, nn.functional.mse_loss, batch)
    assert_close(g["spare.weight"], torch.zeros(1, 2, dtype=D))
    op = module_hvp_operator(model, nn.functional.mse_loss, batch)
    dense = op.to_dense()
    assert torch.count_nonzero(dense[3:, :]) == 0 and torch.count_nonzero(dense[:3, :3]) > 0


def test_jacobian_wrt_params():
    model, _, batch = setup()
    J = module_jacobian(model, batch[0][:2])
    for n, p in model.named_parameters():
        assert J[n].shape == (2, 2, *p.shape)
    names = [n for n, _ in model.named_parameters()]
    want = torch.func.jacrev(
        lambda ps: torch.func.functional_call(
            model, dict(zip(names, ps, strict=True)), (batch[0][:2],)
        )
    )(tuple(p.detach() for p in model.parameters()))
    assert_close([J[n] for n in names], list(want))


def test_buffers_untouched_and_errors():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).to(D).eval()
    before = model[1].running_mean.clone()
    batch = (torch.randn(5, 3, dtype=D), torch.randn(5, 1, dtype=D))
    module_hessian(model, nn.functional.mse_loss, batch)
    assert torch.equal(model[1].running_mean, before)
    with pytest.raises(TypeError, match=r"batch: expected a pair \(inputs, targets\)"):
        module_grad(model, nn.functional.mse_loss, batch[0])
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        module_grad(lambda x: x, nn.functional.mse_loss, batch)
    with pytest.raises(ValueError, match=r"v\['0.weight'\]: expected shape \(3, 3\)"):
        module_hvp(model, nn.functional.mse_loss, batch, {"0.weight": torch.ones(2)})
    with pytest.raises(ValueError, match="expected a function returning a scalar tensor"):
        module_grad(model, lambda o, t: o - t, batch)


def _dense_hvp_check(model, loss_fn, batch, names=None):
    f, theta = flat_loss(model, loss_fn, batch)
    H = hessian(f, theta)
    all_names = [n for n, _ in model.named_parameters()]
    v_flat = torch.randn(theta.numel(), dtype=D)
    sizes = [p.numel() for p in model.parameters()]
    v_all = dict(
        zip(
            all_names,
            [t.view(p.shape) for t, p in zip(v_flat.split(sizes), model.parameters(), strict=True)],
            strict=True,
        )
    )
    hv_all = dict(
        zip(
            all_names,
            [
                t.view(p.shape)
                for t, p in zip((H @ v_flat).split(sizes), model.parameters(), strict=True)
            ],
            strict=True,
        )
    )
    if names is None:
        assert_close(module_hvp(model, loss_fn, batch, v_all), hv_all)
    else:  # a subset: H restricted to it
        mask = torch.cat(
            [
                torch.full((p.numel(),), float(n in names), dtype=D)
                for n, p in model.named_parameters()
            ]
        )
        hv_sub = H @ (v_flat * mask)
        want = dict(
            zip(
                all_names,
                [
                    t.view(p.shape)
                    for t, p in zip(hv_sub.split(sizes), model.parameters(), strict=True)
                ],
                strict=True,
            )
        )
        got = module_hvp(model, loss_fn, batch, {n: v_all[n] for n in names})
        assert_close(got, {n: want[n] for n in names})


@pytest.mark.parametrize("kind", ["conv", "inplace_relu", "twice", "layernorm", "subset"])
def test_module_hvp_layer_output_route_and_fallbacks(kind):
    torch.manual_seed(0)
    if kind == "conv":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
        ).to(D)
        batch = (torch.randn(5, 2, 4, 4, dtype=D), torch.randint(0, 2, (5,)))
    elif kind == "inplace_relu":
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).to(D)
        batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    elif kind == "twice":
        lin = nn.Linear(3, 3).to(D)
        model = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(3, 2).to(D))
        batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    elif kind == "layernorm":
        model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(D)
        batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    else:
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
        batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    names = ["0.weight", "2.bias"] if kind == "subset" else None
    if kind == "twice":  # the reference: double backward on the model itself
        op = module_hvp_operator(model, nn.functional.cross_entropy, batch)
        v = torch.randn(op.shape[0], dtype=D)
        got = module_hvp(model, nn.functional.cross_entropy, batch, op.as_dict(v))
        assert_close(got, op.as_dict(op @ v))
        return
    _dense_hvp_check(model, nn.functional.cross_entropy, batch, names)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reused_module_hessian_and_jacobian_match_the_model_itself(seed):
    # functional_call does not reproduce a module object used twice: the helpers must not
    # silently differentiate another function
    torch.manual_seed(seed)
    lin = nn.Linear(3, 3).to(D)
    model = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(3, 2).to(D))
    batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    dense = module_hvp_operator(model, nn.functional.cross_entropy, batch).to_dense()
    assert_close(module_hessian(model, nn.functional.cross_entropy, batch, flat=True), dense)
    J = module_jacobian(model, batch[0][:2])
    out = model(batch[0][:2])
    for name, p in model.named_parameters():
        want = torch.stack(
            [
                torch.autograd.grad(out.reshape(-1)[k], p, retain_graph=True)[0]
                for k in range(out.numel())
            ]
        ).reshape(*out.shape, *p.shape)
        assert_close(J[name], want)


def test_hessian_survives_torch_func_layer_norm_bug(caplog):
    # torch.func's reverse-over-reverse Hessian through layer_norm with affine parameters
    # after a Linear is asymmetric and wrong (torch 2.13); gradkit detects the asymmetry and
    # recomputes by double backward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(D)
    batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    dense = module_hvp_operator(model, nn.functional.cross_entropy, batch).to_dense()
    with caplog.at_level("WARNING", logger="gradkit.func._transforms"):
        H = module_hessian(model, nn.functional.cross_entropy, batch, flat=True)
    assert_close(H, dense)
    assert_close(H, H.T)
    raw = torch.func.jacrev(
        torch.func.jacrev(flat_loss(model, nn.functional.cross_entropy, batch)[0])
    )(flat_loss(model, nn.functional.cross_entropy, batch)[1])
    if (raw - raw.T).abs().max() > 1e-8:  # the bug is present in this torch
        assert "disagrees with double backward" in caplog.text


def test_a_vector_output_s_hessians_are_checked_too():
    """torch.func's wrong layer_norm second derivative was caught for scalar outputs only: the
    Hessians of a vector output came back 0.36 off (cross terms of weight and gain), silently.
    Each output entry's Hessian is checked, and all are recomputed by double backward."""
    from gradkit.func import hessian

    torch.manual_seed(0)
    X, Y = torch.randn(5, 3, dtype=D), torch.randn(5, 4, dtype=D)
    W0, g0, b0 = torch.randn(4, 3, dtype=D), torch.randn(4, dtype=D), torch.randn(4, dtype=D)

    def losses(W, g):
        h = nn.functional.layer_norm(X @ W.T, (4,), g, b0)
        return torch.stack([nn.functional.mse_loss(h, Y), (h.tanh() ** 2).mean()])

    got = hessian(losses, W0, g0, argnums=(0, 1))
    params = [W0.clone().requires_grad_(), g0.clone().requires_grad_()]
    out = losses(*params)
    for k in range(2):
        grads = torch.autograd.grad(out[k], params, create_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        for i, pi in enumerate(params):
            rows = torch.stack(
                [
                    torch.autograd.grad(flat[r], pi, retain_graph=True)[0]
                    for r in range(flat.numel())
                ]
            )
            for j, pj in enumerate(params):
                start = 0 if j == 0 else W0.numel()
                want = rows[start : start + pj.numel()].reshape(*pj.shape, *pi.shape)
                assert_close(got[j][i][k], want)

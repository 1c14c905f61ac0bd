"""Trajectories of the functional optimizers against ``torch.optim``, step by step, over 100
steps on a small tanh MLP in float64, for every option (eps placement, dampening, Nesterov,
weight decay, AMSGrad, centering, momentum, maximize)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradkit import optim
from gradkit.testing import assert_close

D = torch.float64

CASES = [
    ("sgd", "SGD", {"lr": 0.1}),
    ("sgd", "SGD", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", "SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
    ("sgd", "SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True}),
    ("sgd", "SGD", {"lr": 0.1, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.01}),
    ("sgd", "SGD", {"lr": 0.05, "nesterov": True, "momentum": 0.9, "weight_decay": 0.1}),
    ("sgd", "SGD", {"lr": 0.01, "momentum": 0.9, "maximize": True}),
    ("adam", "Adam", {"lr": 0.01}),
    ("adam", "Adam", {"lr": 0.01, "eps": 1e-3}),  # eps placement matters at this size
    ("adam", "Adam", {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1}),
    ("adam", "Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    ("adam", "Adam", {"lr": 0.01, "maximize": True, "eps": 1e-6}),
    ("adam", "Adam", {"lr": 0.01, "betas": (0.3, 0.9)}),  # beta1 < 0.5: lerp's other branch
    ("adamw", "AdamW", {"lr": 0.01}),
    ("adamw", "AdamW", {"lr": 0.01, "weight_decay": 0.5, "amsgrad": True}),
    ("adamw", "AdamW", {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-4, "betas": (0.5, 0.9)}),
    ("rmsprop", "RMSprop", {"lr": 0.01}),
    ("rmsprop", "RMSprop", {"lr": 0.01, "alpha": 0.9, "eps": 1e-4}),
    ("rmsprop", "RMSprop", {"lr": 0.01, "centered": True}),
    ("rmsprop", "RMSprop", {"lr": 0.005, "momentum": 0.9}),
    ("rmsprop", "RMSprop", {"lr": 0.005, "momentum": 0.5, "centered": True, "weight_decay": 0.1}),
    ("rmsprop", "RMSprop", {"lr": 0.005, "maximize": True, "alpha": 0.95}),
]


def _problem():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(D)
    X, y = torch.randn(16, 4, dtype=D), torch.randint(0, 3, (16,))

    def loss(params):
        return nn.functional.cross_entropy(torch.func.functional_call(net, params, (X,)), y)

    return net, loss


def grad_of(loss):
    def grad(params):
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        return dict(
            zip(leaves, torch.autograd.grad(loss(leaves), list(leaves.values())), strict=True)
        )

    return grad


@pytest.mark.parametrize(("name", "torch_name", "kwargs"), CASES, ids=lambda c: str(c))
def test_trajectory_matches_torch_optim(name, torch_name, kwargs):
    net, loss = _problem()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    reference = getattr(torch.optim, torch_name)(net.parameters(), **kwargs)
    opt = getattr(optim, name)(**kwargs)
    state = opt.init(params)
    grad = grad_of(loss)
    for step in range(100):
        reference.zero_grad()
        loss(dict(net.named_parameters())).backward()
        reference.step()
        params, state = opt.update(grad(params), state, params)
        assert state.step == step + 1
        expected = {n: p.detach() for n, p in net.named_parameters()}
        # one-ulp differences (fused multiply-adds inside torch's kernels) grow along the
        # trajectory to at most ~1e-10; the contract is 1e-6
        assert_close(params, expected, rtol=1e-8, atol=1e-9, name=f"{name} step {step}")
    for slot in opt.slots:
        torch_key = "max_exp_avg_sq" if slot == "max_exp_avg_sq" else slot
        expected = {n: reference.state[p][torch_key] for n, p in net.named_parameters()}
        assert_close(getattr(state, slot), expected, rtol=1e-8, atol=1e-9, name=f"state.{slot}")


def test_float32_matches_torch_and_keeps_dtype():
    net, _ = _problem()
    net = net.float()
    X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def loss(params):
        return nn.functional.cross_entropy(torch.func.functional_call(net, params, (X,)), y)

    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    reference = torch.optim.Adam(net.parameters(), lr=0.01)
    opt = optim.adam(lr=torch.tensor(0.01, dtype=D))  # a float64 tensor keeps float32 params
    state = opt.init(params)
    for _ in range(100):
        reference.zero_grad()
        loss(dict(net.named_parameters())).backward()
        reference.step()
        params, state = opt.update(grad_of(loss)(params), state, params)
    assert all(p.dtype == torch.float32 for p in params.values())
    assert all(v.dtype == torch.float32 for v in state.exp_avg.values())
    assert_close(params, {n: p.detach() for n, p in net.named_parameters()}, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_float32_tensor_hyperparameters_in_a_float64_run_are_not_rounded(name: str) -> None:
    """A float32 ``torch.tensor(0.9)`` beta beside float64 parameters: the bias corrections
    ``1 - beta**t`` were computed in float32 (the weights 1.9e-6 off after 20 steps)."""
    f32 = torch.float32
    lr, b1, b2, wd = (torch.tensor(v, dtype=f32) for v in (0.1, 0.9, 0.999, 0.05))
    opt = getattr(optim, name)(lr=lr, betas=(b1, b2), weight_decay=wd)
    w0 = torch.tensor([1.0, -2.0, 3.0], dtype=D)
    g = torch.tensor([0.3, 0.1, -0.7], dtype=D)
    params = {"w": w0.clone()}
    state = opt.init(params)
    ref = w0.clone().requires_grad_(True)
    torch_opt = getattr(torch.optim, "Adam" if name == "adam" else "AdamW")(
        [ref], lr=float(lr), betas=(float(b1), float(b2)), weight_decay=float(wd)
    )
    for t in range(20):
        params, state = opt.update({"w": g * (1 + 0.1 * t)}, state, params)
        ref.grad = g * (1 + 0.1 * t)
        torch_opt.step()
    assert params["w"].dtype == D
    assert_close(params["w"], ref.detach(), rtol=1e-14, atol=1e-15)

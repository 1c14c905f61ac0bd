"""A module given as the initial parameters contributes its trainable parameters, as
``torch.optim`` trains them: a frozen one (``requires_grad=False``) stays the module's constant.
It was trained with the rest (1.3 % off the hypergradient of a finite-difference oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from gradkit import hyper, optim

D = torch.float64
STEPS = 5


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model[0].weight.requires_grad_(False)
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    x, xv = torch.randn(16, 4, generator=gen, dtype=D), torch.randn(8, 4, generator=gen, dtype=D)
    y, yv = torch.randint(0, 3, (16,), generator=gen), torch.randint(0, 3, (8,), generator=gen)

    def inner(p, _):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    def outer(p):
        return F.cross_entropy(functional_call(model, p, (xv,)), yv)

    return model, inner, outer


def _plain(model, inner, outer, lr: float) -> float:
    """SGD over the trainable parameters, by hand."""
    p = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    for _ in range(STEPS):
        q = {k: v.requires_grad_(True) for k, v in p.items()}
        grads = torch.autograd.grad(inner(q, None), list(q.values()))
        p = {k: (v - lr * g).detach() for (k, v), g in zip(q.items(), grads, strict=True)}
    return float(outer(p))


@pytest.mark.parametrize("engine", ["reverse", "forward"])
def test_a_frozen_parameter_of_a_module_stays_constant(engine: str) -> None:
    model, inner, outer = _problem()
    frozen = model[0].weight.detach().clone()
    lr = torch.tensor(0.3, dtype=D)
    run = getattr(hyper, engine)
    res = run(
        inner, outer, model, optim.sgd(lr=lr), steps=STEPS, hyper={"lr": lr}, full_output=True
    )
    assert "0.weight" not in res.params and set(res.params) == {"0.bias", "2.weight", "2.bias"}
    eps = 1e-6
    want = (_plain(model, inner, outer, 0.3 + eps) - _plain(model, inner, outer, 0.3 - eps)) / (
        2 * eps
    )
    assert abs(float(res.grads["lr"]) - want) <= 1e-7 * max(1.0, abs(want))
    assert torch.equal(model[0].weight, frozen)


def test_a_module_with_every_parameter_frozen_is_refused() -> None:
    model = nn.Linear(2, 2).double().requires_grad_(False)
    lr = torch.tensor(0.1, dtype=D)
    with pytest.raises(ValueError, match=r"params0: expected parameters of which at least one"):
        hyper.reverse(
            lambda p, b: p["weight"].sum(),
            lambda p: p["weight"].sum(),
            model,
            optim.sgd(lr=lr),
            steps=2,
            hyper={"lr": lr},
        )


@pytest.mark.parametrize("engine", ["reverse", "forward", "truncated"])
def test_an_inner_loss_updating_the_modules_buffers_is_refused(engine: str) -> None:
    """BatchNorm in training mode updates its running statistics at each call: the replayed
    steps updated them again (a second call gave another hypergradient), and the
    hypergradient left their dependence on the hyperparameters out (0.5 % off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()
    x, y = torch.randn(16, 4, dtype=D), torch.randint(0, 3, (16,))

    def inner(p, _):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    lr = torch.tensor(0.3, dtype=D)
    options = {"last": 2} if engine == "truncated" else {}

    def run():  # type: ignore[no-untyped-def]
        outer = lambda p: inner(p, None)
        sgd = optim.sgd(lr=lr)
        return getattr(hyper, engine)(
            inner, outer, model, sgd, steps=3, hyper={"lr": lr}, **options
        )

    with pytest.raises(ValueError, match=r"inner_loss: expected a loss that leaves the module's"):
        run()
    model.eval()  # running statistics read, not updated: fine
    run()

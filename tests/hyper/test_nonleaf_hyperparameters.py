"""A hyperparameter reached through the user's own graph (``lr = log_lr.exp()`` built once,
before the call): every engine and plan gives the same hypergradient, again on a second call,
and leaves that graph usable (it was freed by the first backward pass through it)."""

from __future__ import annotations

import pytest
import torch

from gradkit import hyper, optim
from gradkit.testing import assert_close

D = torch.float64


def _problem():
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    X = torch.randn(20, 3, generator=gen, dtype=D)
    y = torch.randn(20, generator=gen, dtype=D)

    def inner(p, batch):
        return ((X @ p["w"] - y) ** 2).mean()

    def outer(p):
        return ((X[:5] @ p["w"] - y[:5]) ** 2).mean()

    return inner, outer, {"w": torch.zeros(3, dtype=D)}


def _hypergradient(engine: str, inner, outer, p0, log_lr: torch.Tensor) -> torch.Tensor:
    opt = optim.sgd(log_lr.exp(), 0.9)  # a non-leaf: its graph belongs to the caller
    h = {"log_lr": log_lr}
    if engine == "forward":
        return hyper.forward(inner, outer, p0, opt, steps=5, hyper=h)["log_lr"]
    if engine == "truncated":
        return hyper.truncated(inner, outer, p0, opt, steps=5, last=5, hyper=h)["log_lr"]
    budget = {"reverse": "auto", "reverse_replayed": None}[engine]
    return hyper.reverse(inner, outer, p0, opt, steps=5, hyper=h, memory_budget=budget)["log_lr"]


def _finite_difference(inner, outer, p0, value: float, eps: float = 1e-6) -> float:
    def loss(v: float) -> float:  # 5 steps of SGD with momentum 0.9 (torch.optim.SGD's form)
        lr = torch.tensor(v, dtype=D).exp()
        w, buf = p0["w"].clone().requires_grad_(), None
        for _ in range(5):
            (g,) = torch.autograd.grad(inner({"w": w}, None), w)
            buf = g if buf is None else 0.9 * buf + g
            w = (w - lr * buf).detach().requires_grad_()
        return float(outer({"w": w.detach()}))

    return (loss(value + eps) - loss(value - eps)) / (2 * eps)


@pytest.mark.parametrize("engine", ["forward", "reverse", "reverse_replayed", "truncated"])
def test_a_hyperparameter_behind_the_users_graph_twice(engine):
    inner, outer, p0 = _problem()
    log_lr = torch.tensor(-2.0, dtype=D, requires_grad=True)
    lr = log_lr.exp()
    opt = optim.sgd(lr, 0.9)
    first = hyper.reverse(
        inner, outer, p0, opt, steps=5, hyper={"log_lr": log_lr}, memory_budget=None
    )["log_lr"]
    again = hyper.reverse(
        inner, outer, p0, opt, steps=5, hyper={"log_lr": log_lr}, memory_budget=None
    )["log_lr"]
    assert_close(again, first, rtol=0, atol=0)
    got = _hypergradient(engine, inner, outer, p0, log_lr)
    assert_close(got, first, rtol=1e-10, atol=1e-14)
    assert abs(float(got) - _finite_difference(inner, outer, p0, -2.0)) < 1e-6
    lr.backward()  # the caller's graph was kept
    assert_close(log_lr.grad, lr.detach(), rtol=1e-15, atol=0)


def test_implicit_with_a_hyperparameter_behind_the_users_graph():
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    X, y = torch.randn(30, 4, generator=gen, dtype=D), torch.randn(30, generator=gen, dtype=D)
    Xv, yv = torch.randn(10, 4, generator=gen, dtype=D), torch.randn(10, generator=gen, dtype=D)
    log_l2 = torch.tensor(-1.0, dtype=D, requires_grad=True)
    l2 = log_l2.exp()

    def inner(p, batch):
        return 0.5 * ((X @ p["w"] - y) ** 2).mean() + 0.5 * l2 * (p["w"] ** 2).sum()

    def outer(p):
        return 0.5 * ((Xv @ p["w"] - yv) ** 2).mean()

    def solve(value: torch.Tensor) -> torch.Tensor:
        A = X.T @ X / 30 + value * torch.eye(4, dtype=D)
        return torch.linalg.solve(A, X.T @ y / 30)

    w_star = {"w": solve(l2.detach())}
    results = [hyper.implicit(inner, outer, w_star, {"log_l2": log_l2})["log_l2"] for _ in range(2)]
    assert_close(results[1], results[0], rtol=0, atol=0)
    eps = 1e-6
    value = lambda v: float(0.5 * ((Xv @ solve(torch.tensor(v, dtype=D).exp()) - yv) ** 2).mean())
    expected = (value(-1.0 + eps) - value(-1.0 - eps)) / (2 * eps)
    assert abs(float(results[0]) - expected) < 1e-7
    l2.backward()  # the caller's graph was kept
    assert log_l2.grad is not None


@pytest.mark.parametrize("engine", ["forward", "reverse", "reverse_replayed", "truncated"])
def test_results_carry_no_graph(engine):
    inner, outer, p0 = _problem()
    log_lr = torch.tensor(-2.0, dtype=D, requires_grad=True)
    got = _hypergradient(engine, inner, outer, p0, log_lr)
    assert not got.requires_grad and got.grad_fn is None

"""Dense float64 oracles for the curvature tests: Hessian, GGN = J^T H_out J and empirical
Fisher from ``torch.func`` (``jacrev``, ``hessian``) on a flat parameter vector, and small
models shared by the test files."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, hessian, jacrev

D = torch.float64


def mlp(act: type[nn.Module] = nn.Tanh, sizes: tuple[int, ...] = (4, 6, 3)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        if i:
            layers.append(act())
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
    return nn.Sequential(*layers).to(D)


def ce_problem(n: int = 12, sizes: tuple[int, ...] = (4, 6, 3), act: type[nn.Module] = nn.Tanh):
    model = mlp(act, sizes)
    x = torch.randn(n, sizes[0], dtype=D)
    y = torch.randint(0, sizes[-1], (n,))
    return model, F.cross_entropy, (x, y)


def mse_problem(n: int = 12, sizes: tuple[int, ...] = (4, 6, 3), act: type[nn.Module] = nn.Tanh):
    model = mlp(act, sizes)
    x = torch.randn(n, sizes[0], dtype=D)
    y = torch.randn(n, sizes[-1], dtype=D)
    return model, F.mse_loss, (x, y)


class Flat:
    """``model`` as a function of the flat vector of its trainable parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.theta = torch.cat([p.detach().reshape(-1) for _, p in named])

    def out(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        parts = theta.split(self.sizes)
        ps = {n: t.view(s) for n, t, s in zip(self.names, parts, self.shapes, strict=True)}
        return functional_call(self.model, ps, (x,))


def dense_hessian(model: nn.Module, loss_fn: Callable, batches) -> torch.Tensor:
    f = Flat(model)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    # reverse over reverse: torch.func.hessian (forward over reverse) is asymmetric through
    # batch_norm in training mode on torch 2.13
    return jacrev(jacrev(lambda t: loss_fn(f.out(t, x), y)))(f.theta)


def dense_ggn(model: nn.Module, loss_fn: Callable, batch) -> torch.Tensor:
    f = Flat(model)
    x, y = batch
    out = f.out(f.theta, x).detach()
    J = jacrev(lambda t: f.out(t, x))(f.theta).reshape(out.numel(), -1)
    H_out = hessian(lambda o: loss_fn(o.view(out.shape), y))(out.reshape(-1))
    return J.T @ H_out @ J


def per_example(model: nn.Module, loss_fn: Callable, batch) -> torch.Tensor:
    """``[N, P]``: the gradient of ``loss_fn`` on each example alone (its mean over a batch of
    one is the example's loss)."""
    f = Flat(model)
    x, y = batch
    rows = []
    for i in range(x.shape[0]):
        rows.append(
            torch.func.grad(lambda t, i=i: loss_fn(f.out(t, x[i : i + 1]), y[i : i + 1]))(f.theta)
        )
    return torch.stack(rows)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))

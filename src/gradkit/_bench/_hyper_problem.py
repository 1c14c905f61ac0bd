"""The hyper suite's problem (data hyper-cleaning on digits with an MLP and heavy-ball SGD) and
its methods: the plain unrolled graph, gradkit.hyper's engines, ``higher`` and TorchOpt, each
returning the hypergradient(s) as one flat tensor; :data:`CASES` names the methods of each case.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradkit import hyper, optim

__all__ = [
    "BUDGETS",
    "CASES",
    "LR",
    "MOMENTUM",
    "N_TRAIN",
    "N_VAL",
    "PEERS",
    "Problem",
    "gradkit_engine",
    "higher_unroll",
    "installed",
    "torchopt_unroll",
    "unroll",
]

LR, MOMENTUM = 0.1, 0.9
N_TRAIN, N_VAL, HIDDEN, CLASSES, FEATURES = 1000, 500, 256, 10, 64
PEERS = ("higher", "torchopt")

Params = list[torch.Tensor]


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, -1) - logits.gather(1, y[:, None])[:, 0]


def _logits(p: Any, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = (p[k] for k in ("w1", "b1", "w2", "b2")) if isinstance(p, dict) else p
    return torch.relu(x @ w1.T + b1) @ w2.T + b2


@dataclass
class Problem:
    """Data, initial weights (``nn.Linear`` initialization, seeded) and hyperparameters."""

    x: torch.Tensor
    y: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    params0: dict[str, torch.Tensor]
    module: torch.nn.Module

    @classmethod
    def make(cls, seed: int) -> Problem:
        from gradkit._digits import bundled_digits

        gen = torch.Generator().manual_seed(seed)
        values, y = bundled_digits()
        x = values / 16.0
        order = torch.randperm(len(y), generator=gen)
        tr, va = order[:N_TRAIN], order[N_TRAIN : N_TRAIN + N_VAL]
        y_train = y[tr].clone()
        bad = torch.randperm(N_TRAIN, generator=gen)[: N_TRAIN // 2]
        y_train[bad] = (y_train[bad] + torch.randint(1, CLASSES, (len(bad),), generator=gen)) % 10
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = torch.nn.Sequential(
                torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
            )
        names = ("w1", "b1", "w2", "b2")
        params0 = {n: p.detach().clone() for n, p in zip(names, module.parameters(), strict=True)}
        return cls(x[tr], y_train, x[va], y[va], params0, module)

    @property
    def state_bytes(self) -> int:
        """``|s|`` in bytes: the weights and one momentum buffer, float32."""
        return 2 * sum(p.numel() for p in self.params0.values()) * 4

    def hypers(self) -> dict[str, torch.Tensor]:
        """Fresh hyperparameter tensors: per-example weights (ones), lr, momentum."""
        return {
            "w": torch.ones(N_TRAIN),
            "lr": torch.tensor(LR),
            "momentum": torch.tensor(MOMENTUM),
        }

    def losses(
        self, h: dict[str, torch.Tensor]
    ) -> tuple[Callable[[Any, Any], torch.Tensor], Callable[[Any], torch.Tensor]]:
        def inner(p: Any, batch: Any) -> torch.Tensor:
            return (h["w"] * _cross_entropy(_logits(p, self.x), self.y)).mean()

        def outer(p: Any) -> torch.Tensor:
            return _cross_entropy(_logits(p, self.x_val), self.y_val).mean()

        return inner, outer


# -- the methods: each returns the hypergradient(s) as one flat tensor ----------------------------


def unroll(problem: Problem, steps: int, names: tuple[str, ...]) -> torch.Tensor:
    """The whole unrolled graph (``create_graph=True`` at every step), then one backward."""
    h = {k: v.requires_grad_(k in names) for k, v in problem.hypers().items()}
    inner, outer = problem.losses(h)
    ps = [p.clone().requires_grad_(True) for p in problem.params0.values()]
    bufs: Params = []
    for t in range(steps):
        gs = torch.autograd.grad(inner(ps, None), ps, create_graph=True)
        bufs = (
            list(gs) if t == 0 else [h["momentum"] * b + g for b, g in zip(bufs, gs, strict=True)]
        )
        ps = [p - h["lr"] * b for p, b in zip(ps, bufs, strict=True)]
    grads = torch.autograd.grad(outer(ps), [h[k] for k in names])
    return torch.cat([g.reshape(-1) for g in grads])


BUDGETS = {"reverse": None, "reverse_graphs": "8GB", "reverse_part": "1GB", "reverse_small": "20MB"}
"""The memory budget of each ``reverse`` method: every state stored (no graph), room for every
step's graph, for part of them (the last steps' graphs, the other states stored), and for
checkpoints only."""


def gradkit_engine(
    problem: Problem, steps: int, names: tuple[str, ...], engine: str
) -> torch.Tensor:
    """``forward``, ``reverse`` checkpointed every sqrt(T) steps, or ``reverse`` within one of
    the :data:`BUDGETS`."""
    h = problem.hypers()
    inner, outer = problem.losses(h)
    opt = optim.sgd(lr=h["lr"], momentum=h["momentum"])
    chosen = {k: h[k] for k in names}
    if engine == "forward":
        grads = hyper.forward(inner, outer, problem.params0, opt, steps=steps, hyper=chosen)
    elif engine == "reverse_ckpt":
        grads = hyper.reverse(
            inner, outer, problem.params0, opt, steps=steps, hyper=chosen, checkpoint_every="sqrt"
        )
    else:
        grads = hyper.reverse(
            inner,
            outer,
            problem.params0,
            opt,
            steps=steps,
            hyper=chosen,
            memory_budget=BUDGETS[engine],
        )
    return torch.cat([grads[k].reshape(-1) for k in names])


def _engine(engine: str) -> Callable[[Problem, int, tuple[str, ...]], torch.Tensor]:
    return lambda p, t, n: gradkit_engine(p, t, n, engine)


def higher_unroll(problem: Problem, steps: int, names: tuple[str, ...]) -> torch.Tensor:
    """``higher.innerloop_ctx`` with ``torch.optim.SGD`` (per-example weights only)."""
    import higher

    h = {k: v.requires_grad_(k in names) for k, v in problem.hypers().items()}
    module = problem.module
    with torch.no_grad():
        for p, p0 in zip(module.parameters(), problem.params0.values(), strict=True):
            p.copy_(p0)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    with higher.innerloop_ctx(module, opt, copy_initial_weights=True) as (fmodel, diffopt):
        for _ in range(steps):
            diffopt.step((h["w"] * _cross_entropy(fmodel(problem.x), problem.y)).mean())
        value = _cross_entropy(fmodel(problem.x_val), problem.y_val).mean()
        grads = torch.autograd.grad(value, [h[k] for k in names])
    return torch.cat([g.reshape(-1) for g in grads])


def torchopt_unroll(problem: Problem, steps: int, names: tuple[str, ...]) -> torch.Tensor:
    """TorchOpt's functional ``sgd`` with ``inplace=False`` (per-example weights only)."""
    import torchopt

    h = {k: v.requires_grad_(k in names) for k, v in problem.hypers().items()}
    inner, outer = problem.losses(h)
    opt = torchopt.sgd(lr=LR, momentum=MOMENTUM)
    ps = tuple(p.clone().requires_grad_(True) for p in problem.params0.values())
    state = opt.init(ps)
    for _ in range(steps):
        gs = torch.autograd.grad(inner(list(ps), None), ps, create_graph=True)
        updates, state = opt.update(gs, state, params=ps, inplace=False)
        ps = tuple(torchopt.apply_updates(ps, updates, inplace=False))
    grads = torch.autograd.grad(outer(list(ps)), [h[k] for k in names])
    return torch.cat([g.reshape(-1) for g in grads])


_WEIGHTS: dict[str, tuple[str, Callable[[Problem, int, tuple[str, ...]], torch.Tensor]]] = {
    "unroll": ("plain unrolled graph (torch autograd, create_graph at every step)", unroll),
    "reverse": (
        "gradkit.hyper.reverse, memory_budget=None (stored states)",
        _engine("reverse"),
    ),
    "reverse_graphs": (
        "gradkit.hyper.reverse, memory_budget='8GB' (every graph kept)",
        _engine("reverse_graphs"),
    ),
    "reverse_part": (
        "gradkit.hyper.reverse, memory_budget='1GB' (the last graphs, stored states)",
        _engine("reverse_part"),
    ),
    "reverse_small": (
        "gradkit.hyper.reverse, memory_budget='20MB' (checkpoints)",
        _engine("reverse_small"),
    ),
    "reverse_ckpt": ("gradkit.hyper.reverse, checkpoint_every='sqrt'", _engine("reverse_ckpt")),
    "higher": ("higher.innerloop_ctx + torch.optim.SGD", higher_unroll),
    "torchopt": ("torchopt.sgd, functional, inplace=False", torchopt_unroll),
}
_LR_MOMENTUM: dict[str, tuple[str, Callable[[Problem, int, tuple[str, ...]], torch.Tensor]]] = {
    "unroll": _WEIGHTS["unroll"],
    "reverse": _WEIGHTS["reverse"],
    "reverse_graphs": _WEIGHTS["reverse_graphs"],
    "forward": (
        "gradkit.hyper.forward (one run, 2 directions)",
        _engine("forward"),
    ),
}
CASES = {
    "hyper_weights": (("w",), _WEIGHTS),
    "hyper_lr_momentum": (("lr", "momentum"), _LR_MOMENTUM),
}


def installed(key: str) -> bool:
    """Whether method ``key`` can run here (a peer's package is importable; ours always)."""
    return key not in PEERS or importlib.util.find_spec(key) is not None

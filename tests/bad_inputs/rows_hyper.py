"""Bad inputs to gradkit.hyper: step counts, truncation and checkpoint strides of the engines,
implicit's own arguments and its stationarity check, HyperOptimizer's options and resuming,
projections, and rows whose answer must follow torch.optim (parameters without a gradient at
some steps). A failing call must leave the hyperparameter tensors and params0 as they were."""

from __future__ import annotations

import itertools
import math
import warnings
from functools import cache
from typing import Any

import torch

from gradkit import hyper, optim
from gradkit.hyper._implicit import NotStationaryWarning

from ._case import Case

D = torch.float64


@cache
def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    return torch.randn(12, 3, generator=gen, dtype=D), torch.randn(12, generator=gen, dtype=D)


def _x() -> torch.Tensor:
    return _xy()[0]


def _y() -> torch.Tensor:
    return _xy()[1]


# the hyperparameters and initial weights: the same tensors in every call and every row
@cache
def _lr() -> torch.Tensor:
    return torch.tensor(0.1, dtype=D)


@cache
def _l2() -> torch.Tensor:
    return torch.tensor(0.05, dtype=D)


@cache
def _p0() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, dtype=D)}


REV = "reverse(inner_loss, outer_loss, params0, opt)"
FWD = "forward(inner_loss, outer_loss, params0, opt)"
TRUNC = "truncated(inner_loss, outer_loss, params0, opt)"
IMP = "implicit(inner_loss, outer_loss, params_star, hyper)"


def inner(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    return ((_x() @ p["w"] - _y()) ** 2).mean() + _l2() * (p["w"] ** 2).sum()


def outer(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((_x()[:4] @ p["w"] - _y()[:4]) ** 2).mean()


def _kept() -> list[torch.Tensor]:
    return [_lr(), _l2(), _p0()["w"]]


def _engine(engine: Any, **over: Any) -> Any:
    kw: dict[str, Any] = {"steps": 3, "hyper": {"lr": _lr(), "l2": _l2()}}
    kw.update(over)
    return engine(inner, outer, _p0(), optim.sgd(lr=_lr()), **kw)


def _optimum() -> dict[str, torch.Tensor]:
    X, Y = _xy()
    A = 2 * X.T @ X / 12 + 2 * _l2() * torch.eye(3, dtype=D)
    return {"w": torch.linalg.solve(A, 2 * X.T @ Y / 12)}


def _implicit(**options: Any) -> Any:
    return hyper.implicit(inner, outer, _optimum(), {"l2": _l2()}, **options)


def _not_stationary_warns() -> None:
    point = {"w": _optimum()["w"] + 0.1}
    leaf = point["w"].clone().requires_grad_(True)
    (oracle,) = torch.autograd.grad(inner({"w": leaf}, None), leaf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = hyper.implicit(inner, outer, point, {"l2": _l2()}, full_output=True)
    assert any(issubclass(w.category, NotStationaryWarning) for w in caught), caught
    assert "not a stationary point" in str(caught[0].message)
    torch.testing.assert_close(res.inner_grad_norm, oracle.norm(), rtol=1e-12, atol=0)


def _stationary_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = hyper.implicit(inner, outer, _optimum(), {"l2": _l2()}, full_output=True)
    assert float(res.inner_grad_norm) < 1e-12


def _hopt(**over: Any) -> hyper.HyperOptimizer:
    kw: dict[str, Any] = {"steps": 3}
    kw.update(over)
    return hyper.HyperOptimizer(inner, outer, _p0(), optim.sgd(lr=_lr()), {"l2": _l2()}, **kw)


def _late_parameter_follows_torch() -> None:
    """A bias used from step 2 on: the trajectory reverse differentiates is Adam's."""
    p0 = {"w": torch.zeros(3, dtype=D), "b": torch.zeros((), dtype=D)}

    def late(p: dict[str, torch.Tensor], t: int) -> torch.Tensor:
        z = _x() @ p["w"] + (p["b"] if t >= 2 else 0.0)
        return ((z - _y()) ** 2).mean()

    res = hyper.reverse(
        late,
        lambda p: ((_x() @ p["w"] + p["b"] - _y()) ** 2).mean(),
        p0,
        optim.adam(lr=_lr()),
        steps=5,
        hyper={"lr": _lr()},
        batches=lambda t: t,
        full_output=True,
    )
    net = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    reference = torch.optim.Adam(list(net.values()), lr=float(_lr()), foreach=False)
    for t in range(5):
        reference.zero_grad(set_to_none=True)
        late(net, t).backward()
        reference.step()
    for k in p0:
        torch.testing.assert_close(res.params[k], net[k].detach(), rtol=1e-12, atol=1e-14)


def _fresh_batches() -> Any:
    """A batches callable that gives step t another batch on every call (as drawing fresh
    random indices would): the replayed steps differ from the forward pass."""
    calls = itertools.count()
    return lambda t: (next(calls) * 5 + t) % 12


def _load_missing() -> None:
    _hopt().load_state_dict({"format": "gradkit.hyper.HyperOptimizer/1"})


ROWS = [
    Case(
        id="hyper.reverse.steps_zero",
        run=lambda: _engine(hyper.reverse, steps=0),
        raises=ValueError,
        words=(REV, "steps: expected an int >= 1", "got 0"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.reverse.steps_float",
        run=lambda: _engine(hyper.reverse, steps=3.0),
        raises=TypeError,
        words=(REV, "steps: expected an int", "3.0"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.reverse.steps_bool",
        run=lambda: _engine(hyper.reverse, steps=True),
        raises=TypeError,
        words=(REV, "steps: expected an int", "True"),
    ),
    Case(
        id="hyper.forward.steps_negative",
        run=lambda: _engine(hyper.forward, steps=-2),
        raises=ValueError,
        words=(FWD, "steps: expected an int >= 1", "-2"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.truncated.last_above_steps",
        run=lambda: _engine(hyper.truncated, last=4),
        raises=ValueError,
        words=(TRUNC, "last", "[0, steps=3]", "4"),
    ),
    Case(
        id="hyper.truncated.last_float",
        run=lambda: _engine(hyper.truncated, last=1.0),
        raises=TypeError,
        words=(TRUNC, "last: expected an int", "1.0"),
    ),
    Case(
        id="hyper.reverse.checkpoint_every_bool",
        run=lambda: _engine(hyper.reverse, checkpoint_every=True),
        raises=TypeError,
        words=(REV, "checkpoint_every", "an int >= 1, or 'sqrt'", "True"),
    ),
    Case(
        id="hyper.reverse.checkpoint_every_zero",
        run=lambda: _engine(hyper.reverse, checkpoint_every=0),
        raises=ValueError,
        words=(REV, "checkpoint_every", "got 0"),
    ),
    Case(
        id="hyper.reverse.full_output_string",
        run=lambda: _engine(hyper.reverse, full_output="yes"),
        raises=TypeError,
        words=(REV, "full_output: expected a bool", "'yes'"),
    ),
    Case(
        id="hyper.reverse.torch_optimizer",
        run=lambda: hyper.reverse(
            inner, outer, _p0(), torch.optim.SGD([_lr()], lr=0.1), steps=2, hyper={"l2": _l2()}
        ),
        raises=TypeError,
        words=(REV, "opt: expected a gradkit.optim optimizer", "torch.optim.sgd.SGD"),
    ),
    Case(
        id="hyper.reverse.inner_loss_without_gradient",
        run=lambda: hyper.reverse(
            lambda p, b: ((_x() @ p["w"].detach() - _y()) ** 2).mean() + _l2(),
            outer,
            _p0(),
            optim.sgd(lr=_lr()),
            steps=2,
            hyper={"l2": _l2()},
        ),
        raises=ValueError,
        words=(REV, "inner_loss", "depends on the parameters", "no gradient for any parameter"),
        unchanged=_kept,
    ),
    Case(id="hyper.reverse.late_parameter_follows_torch_optim", run=_late_parameter_follows_torch),
    Case(
        id="hyper.reverse.batches_not_replayable",
        run=lambda: hyper.reverse(
            lambda p, b: ((_x()[b:] @ p["w"] - _y()[b:]) ** 2).mean(),
            outer,
            _p0(),
            optim.sgd(lr=_lr()),
            steps=4,
            hyper={"lr": _lr()},
            batches=_fresh_batches(),
            memory_budget=None,  # states stored and replayed (kept graphs replay nothing)
        ),
        raises=ValueError,
        words=(REV, "batches", "the same batch whenever step t is asked for", "replayed"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.implicit.optimizer_hyperparameter_listed",
        run=lambda: hyper.implicit(inner, outer, _optimum(), {"l2": _l2(), "lr": _lr()}),
        raises=ValueError,
        words=(IMP, "hyper['lr']", "inner_loss or outer_loss", "do not move"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.implicit.tol_nan",
        run=lambda: _implicit(tol=math.nan),
        raises=ValueError,
        words=(IMP, "tol: expected a finite number >= 0", "nan"),
    ),
    Case(
        id="hyper.implicit.alpha_zero",
        run=lambda: _implicit(method="neumann", alpha=0.0),
        raises=ValueError,
        words=(IMP, "alpha", "> 0", "0.0"),
    ),
    Case(
        id="hyper.implicit.maxiter_float",
        run=lambda: _implicit(maxiter=10.0),
        raises=TypeError,
        words=(IMP, "maxiter: expected an int", "10.0"),
    ),
    Case(
        id="hyper.implicit.alpha_diverges",
        run=lambda: _implicit(method="neumann", alpha=50.0, maxiter=300),
        raises=ValueError,
        words=(IMP, "alpha", "a solve that converges", "inf/nan", "lower alpha"),
    ),
    Case(id="hyper.implicit.not_stationary_warns", run=_not_stationary_warns),
    Case(id="hyper.implicit.stationary_is_silent", run=_stationary_is_silent),
    Case(
        id="hyper.HyperOptimizer.steps_zero",
        run=lambda: _hopt(steps=0),
        raises=ValueError,
        words=("HyperOptimizer: steps", ">= 1", "got 0"),
    ),
    Case(
        id="hyper.HyperOptimizer.implicit_options_string",
        run=lambda: _hopt(method="implicit", implicit_options="cg"),
        raises=TypeError,
        words=("HyperOptimizer: implicit_options", "None or a dict", "'cg'"),
    ),
    Case(
        id="hyper.HyperOptimizer.run_iterations_float",
        run=lambda: _hopt().run(1.5),
        raises=TypeError,
        words=("HyperOptimizer.run: iterations", "an int", "1.5"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.HyperOptimizer.load_state_dict_missing_entries",
        run=_load_missing,
        raises=ValueError,
        words=("HyperOptimizer.load_state_dict: state_dict", "entries state_dict() writes"),
        unchanged=_kept,
    ),
    Case(
        id="hyper.project_capped_simplex.nan_entry",
        run=lambda: hyper.project_capped_simplex(torch.tensor([0.5, math.nan]), radius=1.0),
        raises=ValueError,
        words=("project_capped_simplex", "x: expected finite entries", "nan"),
    ),
]

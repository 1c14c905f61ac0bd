"""Bad input to the engines raises errors that name the call, the argument, what was expected,
what was received, and what to do."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from gradkit import hyper, optim

D = torch.float64


@functools.cache
def _xy():
    return torch.randn(10, 3, dtype=D), torch.randn(10, dtype=D)


def _x():
    return _xy()[0]


def _y():
    return _xy()[1]


# the learning rate and the initial weights: the same tensors in every call
@functools.cache
def _lr():
    return torch.tensor(0.1, dtype=D)


@functools.cache
def _p0():
    return {"w": torch.zeros(3, dtype=D)}


def inner(p, batch):
    return ((_x() @ p["w"] - _y()) ** 2).mean()


def outer(p):
    return (p["w"] ** 2).sum()


REV = r"reverse\(inner_loss, outer_loss, params0, opt\): "


def call(**overrides):
    kw = {
        "inner_loss": inner,
        "outer_loss": outer,
        "params0": _p0(),
        "opt": optim.sgd(lr=_lr()),
        "steps": 3,
        "hyper": {"lr": _lr()},
    }
    kw.update(overrides)
    args = [kw.pop(k) for k in ("inner_loss", "outer_loss", "params0", "opt")]
    engine = kw.pop("engine", hyper.reverse)
    return engine(*args, **kw)


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        (
            lambda: {"hyper": {}},
            TypeError,
            REV + r"hyper: expected a non-empty dict name -> tensor",
        ),
        (lambda: {"hyper": [_lr()]}, TypeError, REV + r"hyper: expected a non-empty dict"),
        (
            lambda: {"hyper": {"lr": 0.1}},
            TypeError,
            REV
            + r"hyper\['lr'\]: expected a floating-point tensor, got 0.1; pass the tensor itself",
        ),
        (
            lambda: {"hyper": {"lr": torch.tensor(1)}},
            TypeError,
            r"hyper\['lr'\]: expected a floating-point tensor, got Tensor\(shape=\(\), "
            r"dtype=torch.int64\)",
        ),
        (
            lambda: {"hyper": {"lr": _lr(), "again": _lr()}},
            ValueError,
            r"hyper\['again'\]: expected each tensor once, got the tensor of hyper\['lr'\] again",
        ),
        (
            lambda: {"opt": optim.sgd(lr=0.1)},
            ValueError,
            REV
            + r"hyper\['lr'\]: expected a tensor the optimizer or the losses use.*sgd\(lr=lr\), "
            r"not lr.item\(\)",
        ),
        (
            lambda: {"engine": hyper.forward, "opt": optim.sgd(lr=0.1)},
            ValueError,
            r"forward\(.*\): hyper\['lr'\]: expected a tensor the optimizer or the losses use",
        ),
        (
            lambda: {"opt": torch.optim.SGD},
            TypeError,
            REV
            + r"opt: expected a gradkit.optim optimizer, got .*; build it with gradkit.optim.sgd",
        ),
        (
            lambda: {"params0": torch.zeros(3)},
            TypeError,
            REV + r"params0: expected a dict name -> tensor or a tuple of tensors",
        ),
        (
            lambda: {"params0": {"w": torch.zeros(3, dtype=torch.int64)}},
            TypeError,
            REV + r"params0\['w'\]: expected a floating-point tensor",
        ),
        (
            lambda: {"params0": {"w": torch.zeros(3, dtype=D), "b": torch.zeros(1)}},
            TypeError,
            REV + r"params0: expected tensors of one dtype on one device \(the steps keep them "
            r"in one buffer\), got params0\['w'\] is torch.float64 on ([\w:]+), params0\['b'\] is "
            r"torch.float32 on \1",
        ),
        (
            lambda: {"inner_loss": lambda p, b: _x() @ p["w"]},
            ValueError,
            REV + r"inner_loss: expected a function returning a scalar floating-point tensor, got "
            r"Tensor\(shape=\(10,\)",
        ),
        (
            lambda: {"outer_loss": lambda p: p["w"]},
            ValueError,
            REV + r"outer_loss: expected a function returning a scalar",
        ),
        (
            lambda: {"outer_loss": None},
            TypeError,
            REV + r"outer_loss: expected a callable \(a function params -> scalar\), got None",
        ),
        (
            lambda: {"inner_loss": "loss"},
            TypeError,
            REV + r"inner_loss: expected a callable \(a function \(params, batch\) -> scalar\)",
        ),
        (lambda: {"steps": -1}, ValueError, REV + r"steps: expected an int >= 1, got -1"),
        (
            lambda: {"steps": 0},
            ValueError,
            REV + r"steps: expected an int >= 1, got 0; pass e.g. steps=",
        ),
        (lambda: {"steps": 2.0}, TypeError, REV + r"steps: expected an int.*, got 2.0"),
        (lambda: {"steps": True}, TypeError, REV + r"steps: expected an int.*, got True"),
        (lambda: {"steps": "3"}, TypeError, REV + r"steps: expected an int.*, got '3'"),
        (
            lambda: {"engine": hyper.forward, "steps": 0},
            ValueError,
            r"forward\(.*\): steps: expected an int >= 1, got 0",
        ),
        (
            lambda: {"engine": hyper.forward, "steps": 1.0},
            TypeError,
            r"forward\(.*\): steps: expected an int.*, got 1.0",
        ),
        (
            lambda: {"engine": hyper.forward, "chunk_size": 0},
            ValueError,
            r"forward\(.*\): chunk_size: expected an int >= 1, got 0; pass e.g. chunk_size=8",
        ),
        (
            lambda: {"engine": hyper.forward, "chunk_size": 2.0},
            TypeError,
            r"forward\(.*\): chunk_size: expected an int.*, got 2.0",
        ),
        (
            lambda: {"engine": hyper.truncated, "steps": 0, "last": 0},
            ValueError,
            r"truncated\(.*\): steps: expected an int >= 1, got 0",
        ),
        (
            lambda: {"engine": hyper.truncated, "last": True},
            TypeError,
            r"truncated\(.*\): last: expected an int.*, got True",
        ),
        (
            lambda: {"engine": hyper.truncated, "last": 2.0},
            TypeError,
            r"truncated\(.*\): last: expected an int.*, got 2.0",
        ),
        (lambda: {"checkpoint_every": True}, TypeError, REV + r"checkpoint_every: expected None"),
        (lambda: {"checkpoint_every": 2.5}, TypeError, REV + r"checkpoint_every: expected None"),
        (lambda: {"checkpoint_every": -3}, ValueError, REV + r"checkpoint_every: expected None"),
        (lambda: {"full_output": "yes"}, TypeError, REV + r"full_output: expected a bool"),
        (
            lambda: {"inner_loss": lambda p, b: (_x() @ p["w"].detach() - _y()).pow(2).mean()},
            ValueError,
            REV + r"inner_loss: expected a loss that depends on the parameters it is given",
        ),
        (
            lambda: {"checkpoint_every": 0},
            ValueError,
            REV + r"checkpoint_every: expected None \(store every state\), an int >= 1, or 'sqrt', "
            r"got 0",
        ),
        (lambda: {"checkpoint_every": "log"}, ValueError, REV + r"checkpoint_every: expected None"),
        (
            lambda: {"batches": []},
            TypeError,
            REV
            + r"batches: expected None, a non-empty list of batches, or a callable step -> batch",
        ),
        (lambda: {"batches": 5}, TypeError, REV + r"batches: expected None, a non-empty list"),
        (
            lambda: {"batches": (_x(), _y())},
            TypeError,
            r"batches: .*if this tuple is one batch, pass \[batch\]",
        ),
        (
            lambda: {"engine": hyper.truncated, "last": 4},
            ValueError,
            r"truncated\(.*\): last: expected an int in \[0, steps=3\], got 4",
        ),
        (
            lambda: {"engine": hyper.truncated, "last": -1},
            ValueError,
            r"truncated\(.*\): last: expected an int >= 0, got -1",
        ),
    ],
)
def test_bad_input_is_explained(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**overrides())


def test_params0_may_be_a_module_or_named_parameters_or_a_tuple():
    net = torch.nn.Linear(3, 1, bias=False).double()
    f = lambda p, b: ((_x() @ p["weight"][0] - _y()) ** 2).mean()
    o = lambda p: (p["weight"] ** 2).sum()
    a = hyper.reverse(f, o, net, optim.sgd(lr=_lr()), steps=3, hyper={"lr": _lr()})
    b = hyper.reverse(
        f, o, net.named_parameters(), optim.sgd(lr=_lr()), steps=3, hyper={"lr": _lr()}
    )
    c = hyper.reverse(
        lambda p, b: f({"weight": p[0]}, b),
        lambda p: o({"weight": p[0]}),
        (net.weight.detach(),),
        optim.sgd(lr=_lr()),
        steps=3,
        hyper={"lr": _lr()},
    )
    assert torch.equal(a["lr"], b["lr"]) and torch.equal(a["lr"], c["lr"])
    assert net.weight.grad is None


@pytest.mark.parametrize(
    "engine", [hyper.reverse, functools.partial(hyper.truncated, last=2)], ids=["reverse", "trunc"]
)
@pytest.mark.parametrize("every", [None, 2])
def test_batches_that_change_on_replay_are_caught(engine, every):
    """Before: a batches callable drawing fresh random indices on every call made the replayed
    steps differ from the forward pass, and the hypergradient mixed two trajectories silently."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    Xb, Yb = torch.randn(30, 3, generator=gen, dtype=D), torch.randn(30, generator=gen, dtype=D)
    f = lambda p, b: ((Xb[b] @ p["w"] - Yb[b]) ** 2).mean()
    kw = {"steps": 4, "hyper": {"lr": _lr()}, "checkpoint_every": every}
    if engine is hyper.reverse and every is None:
        kw["memory_budget"] = None  # every state stored: every step replayed
    with pytest.raises(
        ValueError,
        match=r"batches: expected the same batch whenever step t is asked for \(steps are "
        r"replayed backwards\), got an inner loss that changed by a relative .* when step \d "
        r"was replayed; derive sampling",
    ):
        calls = itertools.count()  # another batch on every call, as fresh random draws give
        fresh = lambda t: torch.arange(6) + (next(calls) * 7 + t) % 24
        engine(f, outer, _p0(), optim.sgd(lr=_lr()), batches=fresh, **kw)
    seeded = lambda t: torch.randint(
        0, 30, (6,), generator=torch.Generator(torch.get_default_device()).manual_seed(t)
    )
    engine(f, outer, _p0(), optim.sgd(lr=_lr()), batches=seeded, **kw)  # replayable: fine

"""Bad input to the engines raises errors that name the call, the argument, what was expected,
what was received, and what to do."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from gradkit import hyper, optim

D = torch.float64
X, Y = torch.randn(10, 3, dtype=D), torch.randn(10, dtype=D)
LR = torch.tensor(0.1, dtype=D)


def inner(p, batch):
    return ((X @ p["w"] - Y) ** 2).mean()


def outer(p):
    return (p["w"] ** 2).sum()


P0 = {"w": torch.zeros(3, dtype=D)}
REV = r"reverse\(inner_loss, outer_loss, params0, opt\): "


def call(**overrides):
    kw = {
        "inner_loss": inner,
        "outer_loss": outer,
        "params0": P0,
        "opt": optim.sgd(lr=LR),
        "steps": 3,
        "hyper": {"lr": LR},
    }
    kw.update(overrides)
    args = [kw.pop(k) for k in ("inner_loss", "outer_loss", "params0", "opt")]
    engine = kw.pop("engine", hyper.reverse)
    return engine(*args, **kw)


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"hyper": {}}, TypeError, REV + r"hyper: expected a non-empty dict name -> tensor"),
        ({"hyper": [LR]}, TypeError, REV + r"hyper: expected a non-empty dict"),
        (
            {"hyper": {"lr": 0.1}},
            TypeError,
            REV
            + r"hyper\['lr'\]: expected a floating-point tensor, got 0.1; pass the tensor itself",
        ),
        (
            {"hyper": {"lr": torch.tensor(1)}},
            TypeError,
            r"hyper\['lr'\]: expected a floating-point tensor, got Tensor\(shape=\(\), "
            r"dtype=torch.int64\)",
        ),
        (
            {"hyper": {"lr": LR, "again": LR}},
            ValueError,
            r"hyper\['again'\]: expected each tensor once, got the tensor of hyper\['lr'\] again",
        ),
        (
            {"opt": optim.sgd(lr=0.1)},
            ValueError,
            REV
            + r"hyper\['lr'\]: expected a tensor the optimizer or the losses use.*sgd\(lr=lr\), "
            r"not lr.item\(\)",
        ),
        (
            {"engine": hyper.forward, "opt": optim.sgd(lr=0.1)},
            ValueError,
            r"forward\(.*\): hyper\['lr'\]: expected a tensor the optimizer or the losses use",
        ),
        (
            {"opt": torch.optim.SGD},
            TypeError,
            REV
            + r"opt: expected a gradkit.optim optimizer, got .*; build it with gradkit.optim.sgd",
        ),
        (
            {"params0": torch.zeros(3)},
            TypeError,
            REV + r"params0: expected a dict name -> tensor or a tuple of tensors",
        ),
        (
            {"params0": {"w": torch.zeros(3, dtype=torch.int64)}},
            TypeError,
            REV + r"params0\['w'\]: expected a floating-point tensor",
        ),
        (
            {"params0": {"w": torch.zeros(3, dtype=D), "b": torch.zeros(1)}},
            TypeError,
            r"params: expected tensors of one dtype on one device \(they share one buffer\), "
            r"got torch.float32 on cpu, torch.float64 on cpu",
        ),
        (
            {"inner_loss": lambda p, b: X @ p["w"]},
            ValueError,
            REV + r"inner_loss: expected a function returning a scalar floating-point tensor, got "
            r"Tensor\(shape=\(10,\)",
        ),
        (
            {"outer_loss": lambda p: p["w"]},
            ValueError,
            REV + r"outer_loss: expected a function returning a scalar",
        ),
        (
            {"outer_loss": None},
            TypeError,
            REV + r"outer_loss: expected a callable \(a function params -> scalar\), got None",
        ),
        (
            {"inner_loss": "loss"},
            TypeError,
            REV + r"inner_loss: expected a callable \(a function \(params, batch\) -> scalar\)",
        ),
        ({"steps": -1}, ValueError, REV + r"steps: expected an int >= 1, got -1"),
        ({"steps": 0}, ValueError, REV + r"steps: expected an int >= 1, got 0; pass e.g. steps="),
        ({"steps": 2.0}, TypeError, REV + r"steps: expected an int.*, got 2.0"),
        ({"steps": True}, TypeError, REV + r"steps: expected an int.*, got True"),
        ({"steps": "3"}, TypeError, REV + r"steps: expected an int.*, got '3'"),
        (
            {"engine": hyper.forward, "steps": 0},
            ValueError,
            r"forward\(.*\): steps: expected an int >= 1, got 0",
        ),
        (
            {"engine": hyper.forward, "steps": 1.0},
            TypeError,
            r"forward\(.*\): steps: expected an int.*, got 1.0",
        ),
        (
            {"engine": hyper.forward, "chunk_size": 0},
            ValueError,
            r"forward\(.*\): chunk_size: expected an int >= 1, got 0; pass e.g. chunk_size=8",
        ),
        (
            {"engine": hyper.forward, "chunk_size": 2.0},
            TypeError,
            r"forward\(.*\): chunk_size: expected an int.*, got 2.0",
        ),
        (
            {"engine": hyper.truncated, "steps": 0, "last": 0},
            ValueError,
            r"truncated\(.*\): steps: expected an int >= 1, got 0",
        ),
        (
            {"engine": hyper.truncated, "last": True},
            TypeError,
            r"truncated\(.*\): last: expected an int.*, got True",
        ),
        (
            {"engine": hyper.truncated, "last": 2.0},
            TypeError,
            r"truncated\(.*\): last: expected an int.*, got 2.0",
        ),
        ({"checkpoint_every": True}, TypeError, REV + r"checkpoint_every: expected None"),
        ({"checkpoint_every": 2.5}, TypeError, REV + r"checkpoint_every: expected None"),
        ({"checkpoint_every": -3}, ValueError, REV + r"checkpoint_every: expected None"),
        ({"full_output": "yes"}, TypeError, REV + r"full_output: expected a bool"),
        (
            {"inner_loss": lambda p, b: (X @ p["w"].detach() - Y).pow(2).mean()},
            ValueError,
            REV + r"inner_loss: expected a loss that depends on the parameters it is given",
        ),
        (
            {"checkpoint_every": 0},
            ValueError,
            REV + r"checkpoint_every: expected None \(store every state\), an int >= 1, or 'sqrt', "
            r"got 0",
        ),
        ({"checkpoint_every": "log"}, ValueError, REV + r"checkpoint_every: expected None"),
        (
            {"batches": []},
            TypeError,
            REV
            + r"batches: expected None, a non-empty list of batches, or a callable step -> batch",
        ),
        ({"batches": 5}, TypeError, REV + r"batches: expected None, a non-empty list"),
        (
            {"batches": (X, Y)},
            TypeError,
            r"batches: .*if this tuple is one batch, pass \[batch\]",
        ),
        (
            {"engine": hyper.truncated, "last": 4},
            ValueError,
            r"truncated\(.*\): last: expected an int in \[0, steps=3\], got 4",
        ),
        (
            {"engine": hyper.truncated, "last": -1},
            ValueError,
            r"truncated\(.*\): last: expected an int >= 0, got -1",
        ),
    ],
)
def test_bad_input_is_explained(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**overrides)


def test_params0_may_be_a_module_or_named_parameters_or_a_tuple():
    net = torch.nn.Linear(3, 1, bias=False).double()
    f = lambda p, b: ((X @ p["weight"][0] - Y) ** 2).mean()
    o = lambda p: (p["weight"] ** 2).sum()
    a = hyper.reverse(f, o, net, optim.sgd(lr=LR), steps=3, hyper={"lr": LR})
    b = hyper.reverse(f, o, net.named_parameters(), optim.sgd(lr=LR), steps=3, hyper={"lr": LR})
    c = hyper.reverse(
        lambda p, b: f({"weight": p[0]}, b),
        lambda p: o({"weight": p[0]}),
        (net.weight.detach(),),
        optim.sgd(lr=LR),
        steps=3,
        hyper={"lr": LR},
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
    gen = torch.Generator().manual_seed(0)
    Xb, Yb = torch.randn(30, 3, generator=gen, dtype=D), torch.randn(30, generator=gen, dtype=D)
    f = lambda p, b: ((Xb[b] @ p["w"] - Yb[b]) ** 2).mean()
    kw = {"steps": 4, "hyper": {"lr": LR}, "checkpoint_every": every}
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
        engine(f, outer, P0, optim.sgd(lr=LR), batches=fresh, **kw)
    seeded = lambda t: torch.randint(0, 30, (6,), generator=torch.Generator().manual_seed(t))
    engine(f, outer, P0, optim.sgd(lr=LR), batches=seeded, **kw)  # replayable: fine

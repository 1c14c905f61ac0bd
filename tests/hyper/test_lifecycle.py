"""What a call leaves behind: nothing. No growth of live tensors over repeated calls, the
hyperparameters' flags, values and version counters as they were, detached results, and
hyperparameters that are non-leaf tensors of the caller's own graph."""

from __future__ import annotations

import gc

import pytest
import torch

from gradkit import hyper, optim
from gradkit.testing import assert_close

from ._problems import D, setting_named


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


ENGINES = {
    "reverse": lambda a, h: hyper.reverse(*a, steps=8, hyper=h),
    "reverse-checkpointed": lambda a, h: hyper.reverse(*a, steps=8, hyper=h, checkpoint_every=3),
    "truncated": lambda a, h: hyper.truncated(*a, steps=8, last=4, hyper=h),
    "forward": lambda a, h: hyper.forward(
        *a, steps=8, hyper={"lr": h["lr"], "momentum": h["momentum"]}
    ),
}


@pytest.mark.parametrize("engine", ENGINES, ids=list(ENGINES))
def test_no_growth_of_live_tensors_over_repeated_calls(engine):
    setting = setting_named("softmax-sgd-momentum")
    h = setting.fresh_hyper()
    inner, outer, opt = setting.build(h)
    args = (inner, outer, setting.params0(), opt)
    results = [ENGINES[engine](args, h) for _ in range(2)]  # warm-up (lazy initialization)
    del results
    before = _live_tensors()
    for _ in range(10):
        out = ENGINES[engine](args, h)
    del out
    assert _live_tensors() <= before


@pytest.mark.parametrize("engine", ["reverse", "reverse-checkpointed", "forward"])
def test_live_tensors_do_not_grow_with_the_step(engine):
    # the batch provider runs inside the engines, once per step and pass: count there
    setting = setting_named("mlp-nesterov-dampened-wd")
    h = setting.fresh_hyper()
    inner, outer, opt = setting.build(h)
    counts: dict[int, list[int]] = {}

    def batches(t):
        if t in (2, 8):
            counts.setdefault(t, []).append(_live_tensors())
        return None

    args = (inner, outer, setting.params0(), opt)
    if engine == "forward":
        hyper.forward(*args, steps=10, hyper={"lr": h["lr"]}, batches=batches)
    else:
        every = 3 if engine == "reverse-checkpointed" else None
        hyper.reverse(
            *args, steps=10, hyper=h, batches=batches, checkpoint_every=every, memory_budget=None
        )
    assert counts[8][0] <= counts[2][0]  # forward pass: no graph kept from step to step
    assert counts[2][-1] <= counts[8][-1]  # replay (runs t = 9, ..., 0): no graph kept either


def test_implicit_leaves_no_tensors_behind():
    X, y = torch.randn(20, 3, dtype=D), torch.randn(20, dtype=D)
    l2 = torch.tensor(0.1, dtype=D)
    inner = lambda p, b: ((X @ p["w"] - y) ** 2).mean() + l2 * p["w"] @ p["w"]
    outer = lambda p: (p["w"] ** 2).sum()
    w = {"w": torch.linalg.solve(X.T @ X / 20 + l2 * torch.eye(3, dtype=D), X.T @ y / 20)}
    hyper.implicit(inner, outer, w, {"l2": l2})
    before = _live_tensors()
    for _ in range(10):
        out = hyper.implicit(inner, outer, w, {"l2": l2}, method="fixed_point")
    del out
    assert _live_tensors() <= before


@pytest.mark.parametrize("engine", ["reverse", "forward"])
def test_hyperparameters_are_left_as_they_were(engine):
    setting = setting_named("softmax-sgd-momentum")
    h = setting.fresh_hyper()
    h["lr"].requires_grad_(True)  # an outer optimizer's leaf: stays requiring grad
    inner, outer, opt = setting.build(h)
    params0 = setting.params0()
    snapshot = {k: (v.clone(), v.requires_grad, v._version) for k, v in h.items()}
    p_snapshot = {k: v.clone() for k, v in params0.items()}
    run = hyper.reverse if engine == "reverse" else hyper.forward
    grads = run(inner, outer, params0, opt, steps=5, hyper={"lr": h["lr"], "w": h["w"]})
    for k, (value, flag, version) in snapshot.items():
        assert torch.equal(h[k], value) and h[k].requires_grad == flag and h[k]._version == version
        assert h[k].grad is None
    assert_close(params0, p_snapshot, rtol=0, atol=0)
    assert all(not g.requires_grad and g.grad_fn is None for g in grads.values())


@pytest.mark.parametrize("engine", [hyper.reverse, hyper.forward])
def test_a_non_leaf_hyperparameter_keeps_the_callers_graph_usable(engine):
    # per-example weights as sigmoid(raw): the hypergradient w.r.t. the weights chains to raw
    setting = setting_named("softmax-sgd-momentum")
    raw = torch.linspace(-1, 1, 12, dtype=D, requires_grad=True)
    w = torch.sigmoid(raw)
    h = {**setting.fresh_hyper(), "w": w}
    inner, outer, opt = setting.build(h)
    g = engine(inner, outer, setting.params0(), opt, steps=5, hyper={"w": w})["w"]
    (chained,) = torch.autograd.grad(w, raw, g)  # sigmoid saved w: still unmodified
    direct = hyper.reverse(inner, outer, setting.params0(), opt, steps=5, hyper={"w": w})["w"]
    assert_close(chained, direct * w * (1 - w))


def test_forward_returns_the_iterate_and_outer_loss_of_reverse():
    setting = setting_named("softmax-adam")
    h = setting.fresh_hyper()
    args = (*setting.build(h)[:2], setting.params0(), setting.build(h)[2])
    rev = hyper.reverse(*args, steps=6, hyper={"lr": h["lr"]}, full_output=True)
    fwd = hyper.forward(*args, steps=6, hyper={"lr": h["lr"]}, full_output=True)
    assert_close([fwd.outer_loss, fwd.params, fwd.grads], [rev.outer_loss, rev.params, rev.grads])
    assert isinstance(rev, hyper.HyperResult) and rev.residual is None


def test_float32_reverse_agrees_with_float64():
    setting = setting_named("softmax-sgd-momentum")
    h = setting.fresh_hyper()
    inner, outer, _ = setting.build(h)
    g64 = hyper.reverse(
        inner,
        outer,
        setting.params0(),
        optim.sgd(lr=h["lr"], momentum=0.9),
        steps=8,
        hyper={"lr": h["lr"]},
    )
    X = torch.randn(12, 4)
    h32 = {k: v.float() for k, v in h.items()}
    inner32 = lambda p, b: inner({k: v.double() for k, v in p.items()}, b).float()
    outer32 = lambda p: outer({k: v.double() for k, v in p.items()}).float()
    p32 = {k: v.float() for k, v in setting.params0().items()}
    g32 = hyper.reverse(
        inner32,
        outer32,
        p32,
        optim.sgd(lr=h32["lr"], momentum=0.9),
        steps=8,
        hyper={"lr": h32["lr"]},
    )
    assert g32["lr"].dtype == torch.float32 and X.dtype == torch.float32
    assert_close(g32["lr"].double(), g64["lr"], rtol=1e-5, atol=1e-6)

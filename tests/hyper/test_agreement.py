"""The engines against each other and against two oracles, in float64 on smooth models:
reverse == the full unrolled graph == forward == truncated(last=T) == checkpointed reverse,
and all == central finite differences, for learning rate, momentum, weight decay, Adam and
RMSprop constants, per-example weights, per-weight L2, a learning-rate schedule, minibatches."""

from __future__ import annotations

import pytest
import torch

from gradkit import hyper
from gradkit.testing import assert_close

from ._problems import SETTINGS, D, finite_difference, setting_named, unrolled

IDS = [s.id for s in SETTINGS]


def _args(setting, h):
    inner, outer, opt = setting.build(h)
    return inner, outer, setting.params0(), opt


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_reverse_forward_truncated_and_unrolled_agree(setting):
    h = setting.fresh_hyper()
    kw = {"steps": setting.steps, "hyper": h, "batches": setting.batches}
    rev = hyper.reverse(*_args(setting, h), memory_budget=None, **kw)
    assert_close(rev, unrolled(setting, h), name=f"{setting.id}: reverse vs unrolled graph")
    fwd = hyper.forward(*_args(setting, h), **kw)
    assert_close(fwd, rev, name=f"{setting.id}: forward vs reverse")
    trunc = hyper.truncated(*_args(setting, h), last=setting.steps, **kw)
    assert_close(trunc, rev, rtol=0, atol=0, name=f"{setting.id}: truncated(last=T) vs reverse")
    for name, g in rev.items():
        assert g.shape == h[name].shape and not g.requires_grad


CHECKPOINTED = ["softmax-sgd-momentum", "mlp-nesterov-dampened-wd", "mlp-sgd-schedule-minibatches"]


@pytest.mark.parametrize("setting", [setting_named(n) for n in CHECKPOINTED], ids=CHECKPOINTED)
@pytest.mark.parametrize("every", [1, 2, 5, "sqrt", 12, 40])
def test_checkpointed_reverse_is_the_stored_reverse(setting, every):
    h = setting.fresh_hyper()
    kw = {"steps": setting.steps, "hyper": h, "batches": setting.batches}
    plain = hyper.reverse(*_args(setting, h), memory_budget=None, **kw)
    ckpt = hyper.reverse(*_args(setting, h), checkpoint_every=every, **kw)
    assert_close(ckpt, plain, rtol=0, atol=0)  # the recomputed states are bitwise the stored ones


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_reverse_matches_central_finite_differences(setting):
    h = setting.fresh_hyper()
    rev = hyper.reverse(*_args(setting, h), steps=setting.steps, hyper=h, batches=setting.batches)
    gen = torch.Generator(torch.get_default_device()).manual_seed(3)
    problems = []
    for name, value in h.items():
        if value.numel() == 1:
            directions = [torch.ones_like(value)]
        else:  # three random unit directions for vector hyperparameters
            directions = [torch.randn(value.shape, generator=gen, dtype=D) for _ in range(3)]
            directions = [d / d.norm() for d in directions]
        for k, u in enumerate(directions):
            analytic = float((rev[name] * u).sum())
            fd = finite_difference(
                setting, h, name, u, eps=1e-5 * max(1.0, float(value.abs().max()))
            )
            if abs(fd - analytic) > 1e-6 * max(abs(analytic), 1e-3):
                problems.append(f"{name} direction {k}: analytic {analytic:.10g}, fd {fd:.10g}")
    assert not problems, f"{setting.id}:\n" + "\n".join(problems)


def test_initial_weights_and_a_direct_term_are_hyperparameters():
    setting = setting_named("softmax-sgd-momentum")
    h = setting.fresh_hyper()
    inner, outer, opt = setting.build(h)
    params0 = setting.params0()
    reg = torch.tensor(0.3, dtype=D)
    outer_reg = lambda p: outer(p) + reg * (p["W"] ** 2).sum()  # reg acts on E directly
    hyp = {"W0": params0["W"], "reg": reg, "lr": h["lr"]}
    rev = hyper.reverse(inner, outer_reg, params0, opt, steps=setting.steps, hyper=hyp)
    fwd = hyper.forward(inner, outer_reg, params0, opt, steps=setting.steps, hyper=hyp)
    assert_close(fwd, rev)
    res = hyper.reverse(
        inner, outer_reg, params0, opt, steps=setting.steps, hyper=hyp, full_output=True
    )
    assert_close(res.grads["reg"], (res.params["W"] ** 2).sum())  # dE/dreg = ||W_T||^2
    # truncated through no step keeps only the direct term
    trunc = hyper.truncated(inner, outer_reg, params0, opt, steps=setting.steps, last=0, hyper=hyp)
    assert_close(
        trunc,
        {
            "W0": torch.zeros_like(params0["W"]),
            "reg": res.grads["reg"],
            "lr": torch.zeros((), dtype=D),
        },
    )
    # FD along a random direction of the initial weights
    u = torch.randn_like(params0["W"])

    def value(sign):
        p = dict(params0, W=params0["W"] + sign * 1e-5 * u)
        return float(
            hyper.reverse(
                inner, outer_reg, p, opt, steps=setting.steps, hyper={"reg": reg}, full_output=True
            ).outer_loss
        )

    assert abs((value(1) - value(-1)) / 2e-5 - float((rev["W0"] * u).sum())) < 1e-7


def test_truncated_is_reverse_restarted_from_the_state_at_T_minus_K():
    setting = setting_named("softmax-sgd-momentum")
    h = setting.fresh_hyper()
    inner, outer, _ = setting.build(h)
    opt = __import__("gradkit").optim.sgd(
        lr=h["lr"], weight_decay=h["weight_decay"]
    )  # state = params
    T, K = 12, 5
    h = {k: h[k] for k in ("lr", "weight_decay", "w", "l2")}
    params0 = setting.params0()
    mid = hyper.reverse(inner, outer, params0, opt, steps=T - K, hyper=h, full_output=True).params
    restarted = hyper.reverse(inner, outer, mid, opt, steps=K, hyper=h)
    trunc = hyper.truncated(inner, outer, params0, opt, steps=T, last=K, hyper=h)
    assert_close(trunc, restarted)
    full = hyper.reverse(inner, outer, params0, opt, steps=T, hyper=h)
    assert not torch.allclose(trunc["lr"], full["lr"])


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_forward_in_chunks_is_forward_in_one_run(chunk_size):
    """Directions split over several runs of the dynamics give the same hypergradient (the
    runs share nothing but the problem); each hyperparameter's elements may straddle runs."""
    setting = setting_named("softmax-sgd-momentum")
    h = setting.fresh_hyper()
    kw = {"steps": setting.steps, "hyper": h, "batches": setting.batches}
    whole = hyper.forward(*_args(setting, h), **kw)
    parts = hyper.forward(*_args(setting, h), chunk_size=chunk_size, **kw)
    assert_close(parts, whole, rtol=1e-12, atol=0)
    assert {k: v.shape for k, v in parts.items()} == {k: v.shape for k, v in h.items()}

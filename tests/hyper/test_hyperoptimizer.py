"""HyperOptimizer: the outer loop lowers the validation loss with every method; the step it
takes is the engine's hypergradient handed to torch.optim, then projected; RTHO's first
hypergradient is forward mode's over the same window (and, with frozen hyperparameters, later
ones too); a run resumed from state_dict() follows the same trajectory bitwise."""

from __future__ import annotations

import functools
import io
import logging
import math

import pytest
import torch

from gradkit import hyper, optim

from ._problems import (
    N_TRAIN,
    D,
    cross_entropy,
    data,
    setting_named,
    softmax_logits,
    softmax_params,
)

SGD0 = functools.partial(torch.optim.SGD, lr=0.0)


def _problem(lr=0.5, momentum=0.5, l2=0.05, w=None):
    """Softmax regression with per-example weights and L2; tensors returned for tuning."""
    X, y, Xv, yv = data()
    h = {
        "lr": torch.tensor(lr, dtype=D),
        "momentum": torch.tensor(momentum, dtype=D),
        "l2": torch.tensor(l2, dtype=D),
        "w": torch.ones(N_TRAIN, dtype=D) if w is None else w,
    }

    def inner(p, batch):
        loss = (h["w"] * cross_entropy(softmax_logits(p, X), y)).mean()
        return loss + 0.5 * h["l2"] * (p["W"] ** 2).sum()

    def outer(p):
        return cross_entropy(softmax_logits(p, Xv), yv).mean()

    opt = optim.sgd(lr=h["lr"], momentum=h["momentum"])
    return inner, outer, opt, h


METHOD_OPTIONS = {
    "reverse": {},
    "reverse-checkpointed": {"method": "reverse", "checkpoint_every": 3},
    "reverse-budget": {"method": "reverse", "memory_budget": "2KB"},
    "truncated": {"last": 5},
    "forward": {},
    "rtho": {},
    "implicit": {"implicit_options": {"method": "cg", "damping": 1e-6}},
}


def _outer_run(kind, outer_lr=0.05):
    """Eight outer iterations of ``kind`` on the softmax problem; the history and the
    hyperparameters tuned."""
    inner, outer, opt, h = _problem()
    options = dict(METHOD_OPTIONS[kind])
    method = options.pop("method", kind)
    names = ["l2", "w"] if method in ("reverse", "truncated", "implicit") else ["l2", "lr"]
    steps = {"implicit": 200, "rtho": 4}.get(method, 12)
    hopt = hyper.HyperOptimizer(
        inner,
        outer,
        softmax_params(),
        opt,
        {k: h[k] for k in names},
        method=method,
        steps=steps,
        outer_opt=functools.partial(torch.optim.Adam, lr=outer_lr),
        projections={"l2": "nonnegative"},
        **options,
    )
    return hopt.run(8), h, names, method


@pytest.mark.parametrize("kind", METHOD_OPTIONS)
def test_the_outer_loop_lowers_the_validation_loss(kind):
    history, h, names, method = _outer_run(kind)
    losses = [r.outer_loss for r in history]
    assert len(history) == 8 and [r.iteration for r in history] == list(range(8))
    if method == "rtho":
        # RTHO trains on across its iterations (4 more inner steps each): the validation loss
        # may rise as the model overfits (it did for 3 of 8 data seeds); the tuned run must end
        # below the same run with the hyperparameters frozen
        frozen = [r.outer_loss for r in _outer_run(kind, outer_lr=0.0)[0]]
        assert losses[0] == frozen[0] and losses[-1] < frozen[-1], (losses, frozen)
    else:
        assert losses[-1] < losses[0], losses
    assert all(math.isfinite(v) for v in losses)
    assert float(h["l2"]) >= 0
    for name in names:
        assert h[name].grad is None and not h[name].requires_grad  # left as they were
    if method == "rtho":
        assert [r.inner_steps for r in history] == [4 * (i + 1) for i in range(8)]
    else:
        steps = {"implicit": 200}.get(method, 12)
        assert all(r.inner_steps == steps for r in history)


def test_one_step_is_the_engines_hypergradient_through_torch_optim_then_projected():
    inner, outer, opt, h = _problem()
    before = {k: h[k].clone() for k in ("l2", "w")}
    expected = hyper.reverse(
        inner, outer, softmax_params(), opt, steps=10, hyper={"l2": h["l2"], "w": h["w"]}
    )
    cap = hyper.projection("capped_simplex", radius=N_TRAIN - 2.0)
    hopt = hyper.HyperOptimizer(
        inner,
        outer,
        softmax_params(),
        opt,
        {"l2": h["l2"], "w": h["w"]},
        steps=10,
        outer_opt=functools.partial(torch.optim.SGD, lr=3.0),
        projections={"w": cap, "l2": None},
    )
    record = hopt.step()
    for k in ("l2", "w"):
        assert torch.equal(record.grads[k], expected[k])
        assert torch.equal(record.hyper[k], before[k])
    torch.testing.assert_close(h["l2"], before["l2"] - 3.0 * expected["l2"], rtol=1e-14, atol=0)
    torch.testing.assert_close(
        h["w"], cap(before["w"] - 3.0 * expected["w"]), rtol=1e-14, atol=1e-15
    )
    assert float(h["w"].sum()) <= N_TRAIN - 2.0 + 1e-12
    norm = math.sqrt(sum(float((g**2).sum()) for g in expected.values()))
    assert record.grad_norm == pytest.approx(norm, rel=1e-12)
    assert hopt.params is not None and set(hopt.params) == {"W", "b"}


def test_rtho_first_hypergradient_is_forward_mode_over_the_same_window():
    setting = setting_named("softmax-sgd-momentum")
    h = {k: setting.fresh_hyper()[k] for k in ("lr", "momentum", "weight_decay", "l2")}
    inner, outer, opt = setting.build(h)
    hopt = hyper.HyperOptimizer(
        inner, outer, setting.params0(), opt, h, method="rtho", steps=5, outer_opt=SGD0
    )
    first = hopt.step()
    fwd = hyper.forward(inner, outer, setting.params0(), opt, steps=5, hyper=h)
    for k in h:
        assert torch.equal(first.grads[k], fwd[k]), k
    # hyperparameters frozen (outer lr 0): the carried tangents are exact over 10 steps
    second = hopt.step()
    fwd10 = hyper.forward(inner, outer, setting.params0(), opt, steps=10, hyper=h)
    for k in h:
        torch.testing.assert_close(second.grads[k], fwd10[k], rtol=1e-12, atol=1e-14)
    assert second.outer_loss == pytest.approx(
        float(
            hyper.reverse(
                inner, outer, setting.params0(), opt, steps=10, hyper=h, full_output=True
            ).outer_loss
        ),
        rel=1e-12,
    )


def test_rtho_with_minibatches_counts_steps_from_the_start_of_the_run():
    setting = setting_named("mlp-sgd-schedule-minibatches")
    h = setting.fresh_hyper()
    inner, outer, opt = setting.build(h)
    hopt = hyper.HyperOptimizer(
        inner,
        outer,
        setting.params0(),
        opt,
        {"lr": h["lr"]},
        method="rtho",
        steps=3,
        batches=setting.batches,
        outer_opt=SGD0,
    )
    hopt.run(2)
    fwd = hyper.forward(
        inner,
        outer,
        setting.params0(),
        opt,
        steps=6,
        hyper={"lr": h["lr"]},
        batches=setting.batches,
    )
    torch.testing.assert_close(hopt.history[-1].grads["lr"], fwd["lr"], rtol=1e-12, atol=1e-14)
    assert hopt.history[-1].grads["lr"][6:].abs().max() == 0  # later entries not used yet


def _build(kind, h=None):
    inner, outer, opt, hh = _problem() if h is None else h
    method = {"warm-implicit": "implicit"}.get(kind, kind)
    names = ["lr", "momentum"] if method == "rtho" else ["l2", "w"]
    extra = {}
    if kind == "warm-implicit":
        # 20 warm-started steps per hyper-step do not reach the optimum: accept that here
        extra = {
            "warm_start": True,
            "implicit_options": {"method": "cg", "damping": 1e-6, "stationary_tol": math.inf},
        }
    return hyper.HyperOptimizer(
        inner,
        outer,
        softmax_params(),
        opt,
        {k: hh[k] for k in names},
        method=method,
        steps={"rtho": 3, "warm-implicit": 20}.get(kind, 6),
        outer_opt=functools.partial(torch.optim.Adam, lr=0.02),
        projections={"w": hyper.projection("capped_simplex", radius=N_TRAIN - 1.0)}
        if "w" in names
        else {"momentum": hyper.projection("box", low=0.0, high=0.9)},
        **extra,
    ), hh


@pytest.mark.parametrize("kind", ["reverse", "rtho", "warm-implicit"])
def test_resume_from_state_dict_follows_the_same_trajectory(kind):
    straight, _ = _build(kind)
    straight.run(5)

    first, _ = _build(kind)
    first.run(2)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    # a fresh problem whose tuned tensors start elsewhere: load_state_dict restores them
    resumed, h = _build(kind)
    with torch.no_grad():
        for t in resumed.hyper.values():
            t.fill_(0.3)
    resumed.load_state_dict(saved)
    assert resumed.iteration == 2
    resumed.run(3)
    assert len(resumed.history) == 5
    for a, b in zip(straight.history, resumed.history, strict=True):
        assert a.iteration == b.iteration and a.inner_steps == b.inner_steps
        assert a.outer_loss == b.outer_loss
        for k in a.grads:
            assert torch.equal(a.grads[k], b.grads[k]), (a.iteration, k)
            assert torch.equal(a.hyper[k], b.hyper[k]), (a.iteration, k)
    for k, t in straight.hyper.items():
        assert torch.equal(t, h[k])


def test_callback_stops_the_run_and_steps_are_logged(caplog):
    inner, outer, opt, h = _problem()
    seen = []

    def callback(record):
        seen.append(record.iteration)
        return record.iteration == 2

    hopt = hyper.HyperOptimizer(
        inner, outer, softmax_params(), opt, {"l2": h["l2"]}, steps=3, callback=callback
    )
    with caplog.at_level(logging.INFO, logger="gradkit.hyper._optimizer"):
        done = hopt.run(10)
    assert seen == [0, 1, 2] and len(done) == 3 and hopt.iteration == 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("outer loss" in m for m in messages) == 3
    assert any("callback stopped" in m for m in messages)


def test_record_false_keeps_numbers_only():
    inner, outer, opt, h = _problem()
    hopt = hyper.HyperOptimizer(
        inner, outer, softmax_params(), opt, {"w": h["w"]}, steps=3, record=False
    )
    r = hopt.step()
    assert r.hyper == {} and r.grads == {} and r.grad_norm > 0


def test_a_torch_optim_instance_and_a_factory_are_accepted():
    inner, outer, opt, h = _problem()
    adam = torch.optim.Adam(
        [{"params": [h["lr"]], "lr": 0.01}, {"params": [h["momentum"]], "lr": 0.1}]
    )
    hopt = hyper.HyperOptimizer(
        inner, outer, softmax_params(), opt, {"lr": h["lr"], "momentum": h["momentum"]},
        method="forward", steps=4, outer_opt=adam,
    )  # fmt: skip
    hopt.step()
    assert hopt.outer_opt is adam
    assert float(h["lr"]) != 0.5 and float(h["momentum"]) != 0.5


def test_non_finite_hypergradient_raises():
    inner, outer, opt, h = _problem()
    hopt = hyper.HyperOptimizer(inner, outer, softmax_params(), opt, {"l2": h["l2"]}, steps=20)
    h["l2"].fill_(math.nan)  # a tensor the losses hold went bad after construction
    with pytest.raises(FloatingPointError, match=r"HyperOptimizer.step: hypergradient: expected"):
        hopt.step()


def test_an_optimizer_tensor_gone_bad_is_named():
    # a tensor the optimizer holds, changed in place after construction: read again at each
    # call (a NaN learning rate gave a non-finite hypergradient; a negative one trained on)
    inner, outer, opt, h = _problem()
    hopt = hyper.HyperOptimizer(inner, outer, softmax_params(), opt, {"l2": h["l2"]}, steps=20)
    for bad, words in ((math.nan, "got nan"), (-0.5, "got -0.5")):
        h["lr"].fill_(bad)
        with pytest.raises(
            ValueError, match=rf"lr: expected a tensor of finite values >= 0, {words}"
        ):
            hopt.step()


def _kwargs(**over):
    inner, outer, opt, h = _problem()
    kw = {
        "inner_loss": inner,
        "outer_loss": outer,
        "params0": softmax_params(),
        "opt": opt,
        "hyper": {"l2": h["l2"]},
        "steps": 3,
    }
    kw.update(over)
    return kw, h


@pytest.mark.parametrize(
    ("over", "error", "pattern"),
    [
        ({"method": "online"}, ValueError, r"HyperOptimizer: method: expected one of 'reverse'"),
        ({"method": "truncated"}, ValueError, r"last: expected the number of steps"),
        (
            {"method": "truncated", "last": 9},
            ValueError,
            r"last: expected an int in \[0, steps=3\]",
        ),
        (
            {"method": "forward", "checkpoint_every": 2},
            ValueError,
            r"checkpoint_every: expected None",
        ),
        ({"last": 2}, ValueError, r"last: expected None for method='reverse'"),
        ({"implicit_options": {}}, ValueError, r"implicit_options: expected None"),
        (
            {"method": "implicit", "implicit_options": {"solver": "cg"}},
            TypeError,
            r"implicit_options: expected keyword arguments of implicit",
        ),
        ({"method": "rtho", "warm_start": True}, ValueError, r"warm_start: expected False"),
        ({"steps": -1}, ValueError, r"HyperOptimizer: steps: expected an int >= 1, got -1"),
        ({"steps": 0}, ValueError, r"HyperOptimizer: steps: expected an int >= 1, got 0"),
        ({"steps": 2.0}, TypeError, r"HyperOptimizer: steps: expected an int.*, got 2.0"),
        ({"steps": True}, TypeError, r"HyperOptimizer: steps: expected an int.*, got True"),
        (
            {"method": "truncated", "last": -1},
            ValueError,
            r"HyperOptimizer: last: expected an int >= 0, got -1",
        ),
        ({"method": "truncated", "last": 1.5}, TypeError, r"last: expected an int.*, got 1.5"),
        ({"checkpoint_every": True}, TypeError, r"checkpoint_every: expected None"),
        (
            {"method": "forward", "memory_budget": "1GB"},
            ValueError,
            r"HyperOptimizer: memory_budget: expected 'auto' \(the default\) unless "
            r"method='reverse' without checkpoint_every, got '1GB'",
        ),
        (
            {"checkpoint_every": 2, "memory_budget": None},
            ValueError,
            r"memory_budget: expected 'auto'.*; drop memory_budget",
        ),
        ({"memory_budget": "much"}, ValueError, r"HyperOptimizer: memory_budget: expected None"),
        (
            {"method": "implicit", "implicit_options": "cg"},
            TypeError,
            r"HyperOptimizer: implicit_options: expected None or a dict",
        ),
        ({"warm_start": "yes"}, TypeError, r"HyperOptimizer: warm_start: expected a bool"),
        ({"hyper": {}}, TypeError, r"hyper: expected a non-empty dict"),
        ({"projections": {"nope": "box"}}, ValueError, r"projections\['nope'\]: expected"),
        ({"projections": {"l2": 3}}, TypeError, r"projections\['l2'\]: expected a projection"),
        ({"projections": {"l2": "ball"}}, ValueError, r"projection\(name, \*\*options\): name"),
        ({"projections": ["box"]}, TypeError, r"projections: expected None or a dict"),
        ({"outer_opt": "adam"}, TypeError, r"outer_opt: expected None \(Adam, lr 1e-3\)"),
        ({"outer_opt": lambda ps: 3}, TypeError, r"outer_opt: expected a factory"),
        ({"callback": 3}, TypeError, r"callback: expected a callable \(a function"),
        ({"record": 1}, TypeError, r"record: expected a bool"),
    ],
)
def test_bad_arguments_raise_with_the_argument_named(over, error, pattern):
    kw, _ = _kwargs(**over)
    with pytest.raises(error, match=pattern):
        hyper.HyperOptimizer(**kw)


def test_outer_optimizer_over_other_tensors_and_non_leaf_hyperparameters_raise():
    kw, h = _kwargs(outer_opt=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(
        ValueError, match=r"outer_opt: expected a torch.optim optimizer over exactly"
    ):
        hyper.HyperOptimizer(**kw)
    base = torch.tensor(0.1, dtype=D, requires_grad=True)
    kw, _ = _kwargs(hyper={"l2": base * 1.0})
    with pytest.raises(ValueError, match=r"hyper: expected leaf tensors"):
        hyper.HyperOptimizer(**kw)


def test_warm_start_refuses_initial_weights_as_hyperparameters():
    inner, outer, opt, _ = _problem()
    params0 = softmax_params()
    with pytest.raises(ValueError, match=r"warm_start: expected False when a hyperparameter"):
        hyper.HyperOptimizer(
            inner, outer, params0, opt, {"W0": params0["W"]}, steps=2, warm_start=True
        )


def test_a_projection_returning_the_wrong_shape_raises_and_changes_nothing():
    """Before: the outer optimizer had already moved the hyperparameter (and its Adam state)
    when the projection failed."""
    kw, h = _kwargs(projections={"l2": lambda t: t.reshape(1)})
    hopt = hyper.HyperOptimizer(**kw)
    before = h["l2"].clone()
    with pytest.raises(ValueError, match=r"projections\['l2'\]: expected a function returning"):
        hopt.step()
    assert torch.equal(h["l2"], before)
    assert hopt.outer_opt.state_dict()["state"] == {} and hopt.history == []


def test_load_state_dict_of_another_method_or_shape_raises():
    source, _ = _build("reverse")
    source.step()
    state = source.state_dict()
    target, _ = _build("rtho")
    with pytest.raises(ValueError, match=r"load_state_dict: state_dict: expected method 'rtho'"):
        target.load_state_dict(state)
    with pytest.raises(ValueError, match=r"expected a state of format"):
        target.load_state_dict({"hyper": {}})
    other, _ = _build("reverse")
    state["hyper"]["w"] = torch.zeros(3, dtype=D)
    with pytest.raises(ValueError, match=r"state_dict\['hyper'\]\['w'\]: expected a tensor of"):
        other.load_state_dict(state)


def test_a_failed_load_state_dict_leaves_the_run_unchanged():
    source, _ = _build("reverse")
    source.run(2)
    good = source.state_dict()
    target, h = _build("reverse")
    target.step()
    before = {k: v.clone() for k, v in target.hyper.items()}
    opt_before = io.BytesIO()
    torch.save(target.outer_opt.state_dict(), opt_before)
    history = list(target.history)
    bad_cases = [
        ({"format": good["format"]}, r"state_dict: expected the entries state_dict\(\) writes"),
        (dict(good, history=[{"nope": 1}]), r"state_dict\['history'\]: expected HyperStep"),
        (dict(good, outer_opt={"state": {}, "param_groups": []}), r"state_dict\['outer_opt'\]"),
    ]
    for bad, pattern in bad_cases:
        with pytest.raises(ValueError, match=r"HyperOptimizer.load_state_dict: " + pattern):
            target.load_state_dict(bad)
        for k, v in target.hyper.items():
            assert torch.equal(v, before[k]), k
        assert target.history == history
        buffer = io.BytesIO()
        torch.save(target.outer_opt.state_dict(), buffer)
        assert buffer.getvalue() == opt_before.getvalue()
    target.load_state_dict(good)  # and a good one still loads
    assert target.iteration == 2


def test_a_torch_optimizer_as_the_inner_optimizer_is_explained():
    kw, h = _kwargs(opt=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(
        TypeError,
        match=r"HyperOptimizer: opt: expected a gradkit.optim optimizer, got a "
        r"torch.optim.sgd.SGD; build it with gradkit.optim.sgd",
    ):
        hyper.HyperOptimizer(**kw)

"""Differentiability with respect to hyperparameters (gradcheck, forward and reverse), the forms
a hyperparameter may take (tensor, schedule, per-parameter), the explicit delta, masks,
skipped parameters and the flat state layout."""

from __future__ import annotations

import pytest
import torch

from gradkit import optim
from gradkit.testing import assert_close

D = torch.float64


def _loss(params, X, y):
    h = torch.tanh(X @ params["w"] + params["b"])
    return ((h - y) ** 2).mean()


def _data():
    torch.manual_seed(0)
    X, y = torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D)
    params = {"w": 0.5 * torch.randn(3, 2, dtype=D), "b": torch.zeros(2, dtype=D)}
    return X, y, params


def _run(make, steps, *hypers):
    """Final parameters after ``steps`` steps, gradients through the parameters too."""
    X, y, params = _data()
    opt = make(*hypers)
    state = opt.init(params)
    for _ in range(steps):
        leaves = {
            k: v if v.requires_grad else v.detach().requires_grad_(True) for k, v in params.items()
        }
        g = torch.autograd.grad(_loss(leaves, X, y), list(leaves.values()), create_graph=True)
        params, state = opt.update(dict(zip(leaves, g, strict=True)), state, leaves)
    return torch.cat([p.reshape(-1) for p in params.values()])


GRADCHECK = [
    (
        "sgd lr, momentum, dampening",
        lambda a, b, c: optim.sgd(a, momentum=b, dampening=c),
        (0.3, 0.8, 0.2),
    ),
    (
        "sgd nesterov lr, momentum, wd",
        lambda a, b, c: optim.sgd(a, momentum=b, nesterov=True, weight_decay=c),
        (0.3, 0.8, 0.1),
    ),
    (
        "adam lr, beta1, eps",
        lambda a, b, c: optim.adam(a, betas=(b, 0.99), eps=c),
        (0.05, 0.9, 1e-2),
    ),
    (
        "adam amsgrad beta2, wd",
        lambda a, b, c: optim.adam(0.05, betas=(a, b), weight_decay=c, amsgrad=True),
        (0.8, 0.9, 0.1),
    ),
    ("adamw lr, wd, eps", lambda a, b, c: optim.adamw(a, weight_decay=b, eps=c), (0.05, 0.2, 1e-2)),
    ("rmsprop lr, alpha, eps", lambda a, b, c: optim.rmsprop(a, alpha=b, eps=c), (0.01, 0.9, 1e-2)),
    (
        "rmsprop centered momentum",
        lambda a, b, c: optim.rmsprop(a, momentum=b, alpha=c, centered=True),
        (0.01, 0.5, 0.9),
    ),
]


@pytest.mark.parametrize(("label", "make", "values"), GRADCHECK, ids=[c[0] for c in GRADCHECK])
def test_gradcheck_wrt_hyperparameters(label, make, values):
    hypers = tuple(torch.tensor(v, dtype=D, requires_grad=True) for v in values)
    f = lambda *h: _run(make, 4, *h)
    assert torch.autograd.gradcheck(f, hypers, eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradcheck(
        f,
        hypers,
        eps=1e-6,
        atol=1e-7,
        rtol=1e-5,
        check_forward_ad=True,
        check_backward_ad=False,
        check_undefined_grad=False,
        check_batched_grad=False,
    )


def test_tensor_hyperparameters_give_the_float_trajectory():
    as_float = _run(lambda: optim.adam(0.05, betas=(0.8, 0.99), eps=1e-3), 5)
    as_tensor = _run(
        lambda: optim.adam(
            torch.tensor(0.05, dtype=D),
            betas=(torch.tensor(0.8, dtype=D), 0.99),
            eps=torch.tensor(1e-3, dtype=D),
        ),
        5,
    )
    assert_close(as_tensor, as_float)


def test_schedule_equals_per_step_overrides():
    X, y, params = _data()
    schedule = torch.tensor([0.3, 0.2, 0.1], dtype=D)
    opt = optim.sgd(schedule, momentum=0.9)
    p1, s1 = params, opt.init(params)
    p2, s2 = params, optim.sgd(1.0, momentum=0.9).init(params)
    plain = optim.sgd(1.0, momentum=0.9)
    for t in range(3):
        g = torch.func.grad(_loss)(p1, X, y)
        p1, s1 = opt.update(g, s1, p1)
        p2, s2 = plain.update(g, s2, p2, lr=float(schedule[t]))
    assert_close(p1, p2)
    with pytest.raises(
        ValueError, match=r"sgd.update: lr: expected a schedule with an entry for step 3"
    ):
        opt.update(g, s1, p1)


def test_per_parameter_and_per_element_values():
    X, y, params = _data()
    g = torch.func.grad(_loss)(params, X, y)
    per_elem = torch.rand(3, 2, dtype=D)
    opt = optim.sgd(
        {"w": per_elem, "b": 0.0}, weight_decay={"w": 0.1, "b": torch.tensor(0.2, dtype=D)}
    )
    new, _ = opt.update(g, opt.init(params), params)
    assert_close(new["w"], params["w"] - per_elem * (g["w"] + 0.1 * params["w"]))
    assert_close(new["b"], params["b"])
    # tuple parameters take tuples of per-parameter values
    opt = optim.adam((0.1, 0.01))
    new_t, _ = opt.update(
        (g["w"], g["b"]), opt.init((params["w"], params["b"])), (params["w"], params["b"])
    )
    assert_close(new_t[0], params["w"] - 0.1 * torch.sign(g["w"]), rtol=1e-6)
    assert_close(new_t[1], params["b"] - 0.01 * torch.sign(g["b"]), rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda: optim.adam(0.1),
        lambda: optim.rmsprop(0.1, centered=True),
    ],
)
def test_delta_is_explicit(make):
    X, y, params = _data()
    opt = make()
    state = opt.init(params)
    for _ in range(3):
        g = torch.func.grad(_loss)(params, X, y)
        delta, s_delta = opt.delta(g, state, params)
        new, state, delta2 = opt.update(g, state, params, return_delta=True)
        assert_close([delta, delta2], [delta2, delta], rtol=0, atol=0)
        assert_close(new, optim.apply_updates(params, delta), rtol=0, atol=0)
        assert_close(list(s_delta), list(state), rtol=0, atol=0)
        params = new


def test_none_gradients_leave_the_parameter_and_its_state_alone():
    X, y, params = _data()
    opt = optim.adam(0.1)
    state = opt.init(params)
    g = torch.func.grad(_loss)(params, X, y)
    new, state2, delta = opt.update({"w": g["w"], "b": None}, state, params, return_delta=True)
    assert torch.equal(new["b"], params["b"]) and torch.equal(delta["b"], torch.zeros(2, dtype=D))
    assert state2.exp_avg["b"] is state.exp_avg["b"] and state2.step == 1


OPTIMIZERS = [
    lambda m: optim.sgd(0.1, momentum=0.9, weight_decay=0.1, mask=m),
    lambda m: optim.sgd(0.1, momentum=0.9, nesterov=True, mask=m),
    lambda m: optim.adam(0.1, weight_decay=0.1, amsgrad=True, mask=m),
    lambda m: optim.adamw(0.1, mask=m),
    lambda m: optim.rmsprop(0.01, momentum=0.5, centered=True, weight_decay=0.1, mask=m),
]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_masked_weights_stay_exactly_zero(make):
    X, y, params = _data()
    mask = {"w": torch.tensor([[True, False], [False, True], [True, True]]), "b": None}
    opt = make(mask)
    state = opt.init(params)  # masked weights start nonzero: the first step zeroes them
    for _ in range(20):
        g = torch.func.grad(_loss)(params, X, y)
        params, state = opt.update(g, state, params)
        assert torch.all(params["w"][~mask["w"]] == 0)
        assert torch.all(params["w"][mask["w"]] != 0)
        for slot in opt.slots:
            assert torch.all(getattr(state, slot)["w"][~mask["w"]] == 0)


def test_masked_adam_hypergradient_is_finite():
    # never-updated entries have v == 0: the square root's derivative there must not be inf
    mask = {"w": torch.tensor([[True, False], [False, True], [True, True]]), "b": None}
    lr = torch.tensor(0.05, dtype=D, requires_grad=True)
    out = _run(lambda a: optim.adam(a, mask=mask), 3, lr)
    (g,) = torch.autograd.grad(out.sum(), lr)
    assert torch.isfinite(g)


def test_state_layout_round_trip_and_views():
    X, y, params = _data()
    opt = optim.rmsprop(0.1, momentum=0.9, centered=True)
    state = opt.init(params)
    params, state = opt.update(torch.func.grad(_loss)(params, X, y), state, params)
    layout = optim.state_layout(params, state)
    assert layout.size == 4 * 8 and layout.num_params == 8
    assert layout.fields == ("square_avg", "momentum_buffer", "grad_avg")
    vec = layout.flatten(params, state)
    p2, s2 = layout.unflatten(vec, step=state.step)
    assert s2.counts is None  # None: every parameter counted `step` updates
    assert_close([p2, list(s2[:-1])], [params, list(state[:-1])], rtol=0, atol=0)
    _, s3 = layout.unflatten(vec, step=state.step, counts=state.counts)
    assert s3.counts == state.counts == {"w": 1, "b": 1}
    assert p2["w"].data_ptr() == vec.data_ptr()  # views, no copies
    out = torch.empty(layout.size, dtype=D)
    layout.flatten(params, state, out=out)
    assert torch.equal(out, vec)
    assert_close(layout.params_of(vec), params, rtol=0, atol=0)

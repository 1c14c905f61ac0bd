"""State per parameter, as ``torch.optim`` keeps it: trajectories against ``torch.optim`` step by
step (float64, 12 steps, rtol 1e-12) over every option of every optimizer, parameter groups
with different options, learning-rate schedules, and parameters without a gradient at some
steps: one used from the start, one unfrozen late, one used every other step, one never used.

``torch.optim`` skips a parameter whose ``.grad`` is None and creates its state at its first
gradient: SGD's momentum buffer starts undampened, Adam's bias corrections count that
parameter's own steps, and a group without momentum ignores its dampening.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gradkit import optim

D = torch.float64
STEPS = 12
NAMES = ("always", "late", "sometimes", "never")
RTOL, ATOL = 1e-12, 1e-14


def _used(name: str, t: int) -> bool:
    return {
        "always": True,
        "late": t >= 5,  # a layer unfrozen late
        "sometimes": t % 3 != 1,  # a branch not always taken
        "never": False,
    }[name]


def _initial() -> dict[str, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    return {n: torch.randn(3, 2, generator=gen, dtype=D) for n in NAMES}


def _inputs() -> torch.Tensor:
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(5, 3, dtype=D, generator=gen)


def _loss(params: dict[str, torch.Tensor], t: int) -> torch.Tensor:
    """A smooth loss of the parameters used at step ``t`` (the others get no gradient)."""
    x, total = _inputs(), torch.zeros((), dtype=D)
    for k, name in enumerate(NAMES):
        if _used(name, t):
            z = torch.tanh(x @ params[name] + 0.1 * (k + 1) * t)
            total = total + ((z - 0.3 * (k - 1)) ** 2).mean() + 0.05 * params[name].sum() ** 2
    return total


def _grads(params: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor | None]:
    leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    gs = torch.autograd.grad(_loss(leaves, t), list(leaves.values()), allow_unused=True)
    return dict(zip(leaves, gs, strict=True))


# groups: {"always", "sometimes"} and {"late", "never"}
GROUP = {"always": 0, "sometimes": 0, "late": 1, "never": 1}


def _per_param(values: tuple) -> dict[str, float]:
    return {n: values[GROUP[n]] for n in NAMES}


def _torch_groups(net: dict[str, torch.nn.Parameter], groups: list[dict]) -> list[dict]:
    members: list[list[torch.nn.Parameter]] = [[], []]
    for n in NAMES:
        members[GROUP[n]].append(net[n])
    return [{"params": members[k], **groups[k]} for k in range(2)]


def _run(
    name: str,
    torch_name: str,
    flags: dict,
    groups: list[dict],
    *,
    schedule: torch.Tensor | None = None,
    override_schedule: bool = False,
) -> None:
    """Run gradkit and torch.optim side by side and compare every step."""
    start = _initial()
    net = {n: torch.nn.Parameter(p.clone()) for n, p in start.items()}
    reference = getattr(torch.optim, torch_name)(
        _torch_groups(net, groups), foreach=False, **flags, **groups[0]
    )
    keys = groups[0].keys()
    hyper = {}
    for key in keys:
        values = (groups[0][key], groups[1][key])
        if key == "betas":
            hyper[key] = tuple(_per_param((values[0][j], values[1][j])) for j in range(2))
        else:
            hyper[key] = values[0] if values[0] == values[1] else _per_param(values)
    if schedule is not None and not override_schedule:
        hyper["lr"] = schedule
    opt = getattr(optim, name)(**hyper, **flags)
    params = {n: p.clone() for n, p in start.items()}
    state = opt.init(params)
    for t in range(STEPS):
        over = {}
        if schedule is not None:
            for g in reference.param_groups:
                g["lr"] = float(schedule[t])
            if override_schedule:
                over = {"lr": {n: float(schedule[t]) for n in NAMES}}
        reference.zero_grad(set_to_none=True)
        _loss(net, t).backward()
        reference.step()
        params, state = opt.update(_grads(params, t), state, params, **over)
        for n in NAMES:
            torch.testing.assert_close(
                params[n],
                net[n].detach(),
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, n=n, t=t: f"{n} step {t}: {m}",
            )
    assert state.step == STEPS
    for n in NAMES:
        torch_state = reference.state[net[n]]
        if name == "sgd":  # torch.optim.SGD keeps no step: the buffer exists once counted
            has_buffer = torch_state.get("momentum_buffer") is not None
            assert has_buffer == (bool(opt.slots) and state.counts[n] > 0), n
        else:
            assert state.counts[n] == int(torch_state.get("step", 0)), n
        for slot in opt.slots:
            if slot in torch_state and torch_state[slot] is not None:
                torch.testing.assert_close(
                    getattr(state, slot)[n], torch_state[slot], rtol=RTOL, atol=ATOL
                )
            else:  # never written: still the zeros of init
                assert torch.equal(getattr(state, slot)[n], torch.zeros_like(start[n]))
    # a parameter that never had a gradient is exactly where it started
    assert torch.equal(params["never"], start["never"])


SGD_FLAGS = [{"nesterov": n, "maximize": m} for n, m in itertools.product([False, True], repeat=2)]
SGD_GROUPS = [
    # (group 0, group 1): momentum next to none (dampening ignored there), dampening, decay
    ({"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.0}, None),
    ({"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01}, None),
    ({"lr": 0.05, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.1}, None),
]


def _sgd_cases():
    for flags in SGD_FLAGS:
        for g0, _ in SGD_GROUPS:
            if flags["nesterov"] and (g0["momentum"] == 0 or g0["dampening"] != 0):
                continue
            g1 = dict(g0, momentum=0.0, lr=0.2)  # momentum 0 next to momentum 0.9
            if g0["momentum"] == 0:
                g1 = dict(g0, momentum=0.5, lr=0.2)
            yield flags, [g0, g1]
            yield flags, [g0, dict(g0)]  # one group's options for every parameter


@pytest.mark.parametrize(
    ("flags", "groups"), list(_sgd_cases()), ids=lambda v: str(v).replace(" ", "")
)
def test_sgd_matches_torch_per_parameter(flags, groups):
    _run("sgd", "SGD", flags, groups)


ADAM_FLAGS = [{"amsgrad": a, "maximize": m} for a, m in itertools.product([False, True], repeat=2)]
ADAM_GROUPS = [
    [
        {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    ],
    [
        {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.1},
        {"lr": 0.005, "betas": (0.3, 0.9), "eps": 1e-6, "weight_decay": 0.0},
    ],
]


@pytest.mark.parametrize("groups", ADAM_GROUPS, ids=["one-group", "two-groups"])
@pytest.mark.parametrize("flags", ADAM_FLAGS, ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize(("name", "torch_name"), [("adam", "Adam"), ("adamw", "AdamW")])
def test_adam_and_adamw_match_torch_per_parameter(name, torch_name, flags, groups):
    _run(name, torch_name, flags, groups)


RMSPROP_FLAGS = [
    {"centered": c, "maximize": m} for c, m in itertools.product([False, True], repeat=2)
]
RMSPROP_GROUPS = [
    [
        {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0},
        {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0},
    ],
    [
        {"lr": 0.01, "alpha": 0.9, "eps": 1e-4, "weight_decay": 0.1, "momentum": 0.9},
        {"lr": 0.005, "alpha": 0.95, "eps": 1e-6, "weight_decay": 0.0, "momentum": 0.0},
    ],
]


@pytest.mark.parametrize("groups", RMSPROP_GROUPS, ids=["one-group", "momentum-next-to-none"])
@pytest.mark.parametrize("flags", RMSPROP_FLAGS, ids=lambda v: str(v).replace(" ", ""))
def test_rmsprop_matches_torch_per_parameter(flags, groups):
    _run("rmsprop", "RMSprop", flags, groups)


@pytest.mark.parametrize("override", [False, True], ids=["schedule-tensor", "per-step-override"])
@pytest.mark.parametrize(
    ("name", "torch_name", "groups"),
    [
        ("sgd", "SGD", [{"momentum": 0.9, "dampening": 0.5}, {"momentum": 0.0, "dampening": 0.5}]),
        ("adam", "Adam", [{"betas": (0.9, 0.99)}, {"betas": (0.5, 0.9)}]),
        ("adamw", "AdamW", [{"weight_decay": 0.1}, {"weight_decay": 0.3}]),
        ("rmsprop", "RMSprop", [{"momentum": 0.5}, {"momentum": 0.0}]),
    ],
)
def test_learning_rate_schedules_index_the_global_step(name, torch_name, groups, override):
    """A schedule follows ``optimizer.step()`` calls (as ``lr_scheduler``), the bias
    corrections and buffers the parameter's own count."""
    groups = [dict(g, lr=0.05) for g in groups]
    schedule = torch.linspace(0.05, 0.01, STEPS, dtype=D)
    _run(name, torch_name, {}, groups, schedule=schedule, override_schedule=override)


def test_a_late_parameter_gets_the_first_step_of_a_fresh_optimizer():
    """The first update of a parameter unfrozen at step k is the first update a fresh
    optimizer makes: Adam moves each weight by about lr (bias corrections of step 1), SGD's
    first momentum buffer is the undampened gradient."""
    g = {"a": torch.tensor([2.0, -0.5], dtype=D), "b": torch.tensor([1.0, 3.0], dtype=D)}
    for opt in (optim.adam(lr=0.1), optim.sgd(lr=0.1, momentum=0.9, dampening=0.5)):
        params = {"a": torch.ones(2, dtype=D), "b": torch.ones(2, dtype=D)}
        state = opt.init(params)
        for _ in range(4):  # "b" frozen: no gradient
            params, state = opt.update({"a": g["a"], "b": None}, state, params)
        assert state.counts == {"a": 4, "b": 0} and state.step == 4
        new, state = opt.update(g, state, params)
        fresh = opt.update({"b": g["b"]}, opt.init({"b": params["b"]}), {"b": params["b"]})[0]
        torch.testing.assert_close(new["b"], fresh["b"], rtol=0, atol=0)
        assert state.counts == {"a": 5, "b": 1}


def test_a_skipped_step_leaves_weights_slots_and_count_bitwise_unchanged():
    opt = optim.adam(lr=0.1, weight_decay=0.5, amsgrad=True)
    params = {"a": torch.randn(3, dtype=D), "b": torch.randn(3, dtype=D)}
    state = opt.init(params)
    params, state = opt.update({"a": torch.ones(3, dtype=D), "b": params["b"]}, state, params)
    new, after = opt.update({"a": torch.ones(3, dtype=D), "b": None}, state, params)
    assert torch.equal(new["b"], params["b"])  # no weight decay either (torch skips it)
    for slot in opt.slots:
        assert torch.equal(getattr(after, slot)["b"], getattr(state, slot)["b"])
    assert after.counts == {"a": 2, "b": 1}


def test_a_state_without_counts_counts_step_for_every_parameter():
    """States built before counts existed (``counts=None``) mean: every parameter had every
    step."""
    opt = optim.adam(lr=0.1)
    params = {"w": torch.tensor([1.0, -1.0], dtype=D)}
    g = {"w": torch.tensor([0.5, 2.0], dtype=D)}
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update(g, state, params)
    a, _ = opt.update(g, state, params)
    b, _ = opt.update(g, state._replace(counts=None), params)
    assert torch.equal(a["w"], b["w"])


@pytest.mark.parametrize(
    ("counts", "error", "pattern"),
    [
        ({"w": -1}, ValueError, r"adam.update: state.counts\['w'\]: expected an int in \[0, "),
        ({"w": 9}, ValueError, r"state.counts\['w'\]: expected an int in \[0, state.step=3\]"),
        ({"w": 1.0}, ValueError, r"state.counts\['w'\]: expected an int"),
        ({"v": 1}, ValueError, r"state.counts: expected a dict with the keys \['w'\]"),
    ],
)
def test_bad_counts_are_explained(counts, error, pattern):
    opt = optim.adam(lr=0.1)
    params = {"w": torch.ones(2, dtype=D)}
    state = opt.init(params)._replace(step=3, counts=counts)
    with pytest.raises(error, match=pattern):
        opt.update({"w": torch.ones(2, dtype=D)}, state, params)


def test_a_tensor_momentum_of_zero_keeps_torchs_step_without_dampening():
    """A tensor momentum always drives the buffer (its derivative at 0 is the one a search
    over the momentum needs); with dampening 0 every step equals torch.optim's, whose
    ``momentum == 0`` branch skips the buffer."""
    start = _initial()
    net = {n: torch.nn.Parameter(p.clone()) for n, p in start.items()}
    reference = torch.optim.SGD(list(net.values()), lr=0.1, momentum=0.0, foreach=False)
    opt = optim.sgd(lr=0.1, momentum=torch.tensor(0.0, dtype=D))
    params = dict(start)
    state = opt.init(params)
    for t in range(STEPS):
        reference.zero_grad(set_to_none=True)
        _loss(net, t).backward()
        reference.step()
        params, state = opt.update(_grads(params, t), state, params)
    for n in NAMES:
        torch.testing.assert_close(params[n], net[n].detach(), rtol=RTOL, atol=ATOL)


def test_bias_corrections_use_the_parameters_own_count_in_the_formula():
    """Adam's first update of a parameter first used at step 6 (0-based), written out: with the
    global step its size would be (1 - 0.9**7) / (1 - 0.9) ... times smaller."""
    opt = optim.adam(lr=0.1, betas=(0.9, 0.999), eps=1e-12)
    params = {"a": torch.zeros(1, dtype=D), "b": torch.zeros(1, dtype=D)}
    state = opt.init(params)
    for _ in range(6):
        params, state = opt.update({"a": torch.ones(1, dtype=D), "b": None}, state, params)
    new, _ = opt.update(
        {"a": torch.ones(1, dtype=D), "b": torch.full((1,), 3.0, dtype=D)}, state, params
    )
    # m = 0.1 * 3, v = 0.001 * 9, corrections 1 - 0.9, 1 - 0.999: the step is exactly lr
    assert math.isclose(float(new["b"]), -0.1, rel_tol=1e-9)

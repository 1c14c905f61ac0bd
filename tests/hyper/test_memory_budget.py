"""``reverse(..., memory_budget=...)``: the plan chosen for each budget (kept graphs, stored
states, checkpoints, below the minimum), the same hypergradient under every plan, and the
budget's parsing and errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import gradkit.hyper._reverse as reverse_module
from gradkit import hyper, optim
from gradkit.hyper import MemoryBudgetWarning
from gradkit.hyper._budget import AUTO_SHARE, Plan, budget_bytes, plan, saved_bytes
from gradkit.testing import assert_close

from ._problems import D, setting_named

CPU = torch.device("cpu")


# -- the plan, as a function of the budget ------------------------------------------------------


def test_everything_fits_keeps_every_graph():
    assert plan(10_000, span=10, state=100, graph=1000, call="c") == Plan(10, 1, 10_000)


@pytest.mark.parametrize("extra", [0, 899, 900, 2700, 8099])
def test_graphs_fill_what_the_stored_states_leave(extra):
    """Every state stored costs 10 x 100 bytes; each kept graph 900 bytes more."""
    chosen = plan(1000 + extra, span=10, state=100, graph=1000, call="c")
    assert chosen.stride == 1 and chosen.graphs == extra // 900
    assert chosen.bytes <= 1000 + extra
    assert chosen.bytes == chosen.graphs * 1000 + (10 - chosen.graphs) * 100


@pytest.mark.parametrize("budget", [999, 700, 500, 2000])
def test_below_the_states_the_smallest_fitting_stride(budget):
    span, state = 100, 10
    chosen = plan(budget, span=span, state=state, graph=1000, call="c")
    if budget >= span * state:
        assert chosen.graphs >= 1
        return
    need = lambda k: (math.ceil(span / k) + k - 1) * state
    assert chosen.graphs == 0 and need(chosen.stride) <= budget
    assert all(need(k) > budget for k in range(2, chosen.stride))
    assert chosen.bytes == need(chosen.stride)


def test_below_the_minimum_warns_and_checkpoints_at_the_square_root():
    with pytest.warns(MemoryBudgetWarning, match=r"c: memory_budget: expected at least 0.00019 MB"):
        chosen = plan(10, span=100, state=10, graph=1000, call="c")
    assert chosen == Plan(0, 10, 190)


# -- the same hypergradient under every plan ----------------------------------------------------


def _problem():
    setting = setting_named("mlp-nesterov-dampened-wd")
    h = setting.fresh_hyper()
    inner, outer, opt = setting.build(h)
    args = (inner, outer, setting.params0(), opt)
    return setting, h, args


@pytest.fixture
def plans(monkeypatch):
    """The plans ``reverse`` chose, with the sizes it measured."""
    seen: list[tuple[Plan, int, int, int]] = []

    def spy(budget, span, state, graph, call):
        chosen = plan(budget, span, state, graph, call)
        seen.append((chosen, span, state, graph))
        return chosen

    monkeypatch.setattr(reverse_module, "plan", spy)
    return seen


def test_every_plan_gives_the_stored_states_hypergradient(plans):
    setting, h, args = _problem()
    kw = {"steps": setting.steps, "hyper": h, "batches": setting.batches}
    stored = hyper.reverse(*args, memory_budget=None, **kw)
    assert not plans  # no budget: nothing measured
    hyper.reverse(*args, memory_budget=1e18, **kw)
    (everything, span, state, graph), *_ = plans
    assert everything.graphs == span == setting.steps and graph > state
    budgets = {
        "all graphs": span * graph,
        "3 graphs": span * state + 3 * (graph - state),
        "stored states": span * state,
        "checkpoints": 8 * state,
        "below the minimum": 1,
    }
    for label, budget in budgets.items():
        plans.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error" if label != "below the minimum" else "ignore")
            got = hyper.reverse(*args, memory_budget=budget, **kw)
        chosen = plans[0][0]
        expected = {
            "all graphs": (span, 1),
            "3 graphs": (3, 1),
            "stored states": (0, 1),
            "checkpoints": (0, chosen.stride),
            "below the minimum": (0, math.ceil(math.sqrt(span))),
        }[label]
        assert (chosen.graphs, chosen.stride) == expected, label
        if label == "checkpoints":
            assert chosen.stride > 1
        assert_close(got, stored, rtol=1e-12, atol=1e-15, name=label)


def test_the_measured_graph_is_what_autograd_saves_for_a_step(plans):
    """The plan's graph size is the distinct storages saved by one step's graph; a second step
    saves as much (the first one is representative)."""
    setting, h, args = _problem()
    hyper.reverse(*args, steps=setting.steps, hyper=h, memory_budget="1GB")
    _, _, state, graph = plans[0]
    assert state == sum(p.numel() for p in setting.params0().values()) * 2 * 8  # + momentum
    inner, _, opt = setting.build(h)
    params = {k: v.clone().requires_grad_(True) for k, v in setting.params0().items()}
    with saved_bytes() as found:
        grads = torch.autograd.grad(inner(params, None), list(params.values()), create_graph=True)
        new, st = opt.update(dict(zip(params, grads, strict=True)), opt.init(params), params)
    assert 0.5 * graph <= sum(found.values()) <= 2 * graph


def test_a_budget_with_graphs_still_catches_batches_that_change_on_replay():
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    X, Y = torch.randn(30, 3, generator=gen, dtype=D), torch.randn(30, generator=gen, dtype=D)
    lr = torch.tensor(0.1, dtype=D)
    inner = lambda p, b: ((X[b] @ p["w"] - Y[b]) ** 2).mean()
    outer = lambda p: ((X @ p["w"] - Y) ** 2).mean()
    calls = iter(range(10**6))
    fresh = lambda t: torch.arange(6) + (next(calls) * 7 + t) % 24
    params0 = {"w": torch.zeros(3, dtype=D)}
    state = 2 * 3 * 8
    with pytest.raises(ValueError, match=r"batches: expected the same batch whenever step t"):
        hyper.reverse(
            inner,
            outer,
            params0,
            optim.sgd(lr=lr, momentum=0.5),
            steps=8,
            hyper={"lr": lr},
            batches=fresh,
            memory_budget=8 * state + 1,
        )


def test_auto_is_a_share_of_the_available_memory(monkeypatch):
    monkeypatch.setattr("gradkit.hyper._budget.available_bytes", lambda device: 8_000_000)
    assert budget_bytes("auto", CPU, "c") == 8_000_000 // AUTO_SHARE
    monkeypatch.setattr("gradkit.hyper._budget.available_bytes", lambda device: None)
    assert budget_bytes("auto", CPU, "c") is None  # unknown: every state stored


def test_the_host_reports_some_available_memory():
    from gradkit.hyper._budget import available_bytes

    free = available_bytes(CPU)
    assert free is not None and free > 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (0, 0),
        (2e9, 2_000_000_000),
        ("2GB", 2_000_000_000),
        ("512MiB", 512 * 2**20),
        (" 1.5 kb ", 1500),
        ("100", 100),
        (float("inf"), 2**62),
    ],
)
def test_budget_sizes(value, expected):
    assert budget_bytes(value, CPU, "c") == expected


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (True, TypeError, r"c: memory_budget: expected None, 'auto', a number of bytes >= 0"),
        ([1], TypeError, r"c: memory_budget: expected None, 'auto'"),
        (-1, ValueError, r"c: memory_budget: expected .*, got -1; pass e.g. memory_budget='2GB'"),
        (float("nan"), ValueError, r"c: memory_budget: expected .*, got nan"),
        ("lots", ValueError, r"c: memory_budget: expected .*, got 'lots'"),
        ("2 parsecs", ValueError, r"got '2 parsecs'"),
    ],
)
def test_bad_budgets(value, error, pattern):
    with pytest.raises(error, match=pattern):
        budget_bytes(value, CPU, "c")


def test_a_budget_and_a_checkpoint_stride_are_one_choice():
    setting, h, args = _problem()
    with pytest.raises(
        ValueError,
        match=r"reverse\(.*\): checkpoint_every: expected None when memory_budget is given "
        r"\(the budget chooses the stride\), got 3; pass one of",
    ):
        hyper.reverse(*args, steps=4, hyper=h, checkpoint_every=3, memory_budget="1GB")

"""What HyperOptimizer and the engines refuse instead of a silent number (found by a probe):
a module whose trainable parameters changed since the optimizer was built, a loss that updates
the module's buffers, an outer loss that does not depend on the trained parameters, an
optimizer hyperparameter the outer step took out of range, and a schedule shorter than the
steps. Each refusal names the call and leaves the hyperparameters as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from gradkit import GradkitError, hyper, optim

D = torch.float64
STEPS = 3
METHODS = ["reverse", "forward", "truncated", "rtho"]


def _problem(model: nn.Module | None = None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    x, xv = torch.randn(16, 4, generator=gen, dtype=D), torch.randn(8, 4, generator=gen, dtype=D)
    y, yv = torch.randint(0, 3, (16,), generator=gen), torch.randint(0, 3, (8,), generator=gen)
    l2 = torch.tensor(0.01, dtype=D)

    def inner(p, _):
        penalty = sum((v**2).sum() for v in p.values())
        return F.cross_entropy(functional_call(model, p, (x,)), y) + l2 * penalty

    def outer(p):
        return F.cross_entropy(functional_call(model, p, (xv,)), yv)

    return model, inner, outer, l2


def _optimizer(method: str, **kw):
    model, inner, outer, l2 = _problem(kw.pop("model", None))
    lr = torch.tensor(0.2, dtype=D)
    if method == "truncated":
        kw["last"] = 2
    made = hyper.HyperOptimizer(
        inner, outer, model, optim.sgd(lr=lr), {"l2": l2}, method=method, steps=STEPS, **kw
    )
    return made, model, l2


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("change", ["frozen", "replaced", "unfrozen"])
def test_a_module_changed_since_construction_is_refused(method, change):
    # the hypergradients trained the parameter set of construction: a layer replaced since was
    # never used (104 % off), a frozen one still trained
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    if change == "unfrozen":
        model[0].bias.requires_grad_(False)
    hopt, model, l2 = _optimizer(method, model=model)
    before = l2.clone()
    if change == "frozen":
        model[2].weight.requires_grad_(False)
    elif change == "replaced":
        model[2] = nn.Linear(6, 3).double()
    else:
        model[0].bias.requires_grad_(True)
    with pytest.raises(GradkitError, match=r"HyperOptimizer.step\(\): params0: .* changed since"):
        hopt.step()
    assert torch.equal(l2, before) and not hopt.history


def test_in_place_changes_of_the_module_are_followed():
    hopt, model, _ = _optimizer("reverse")
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    hopt.step()  # the same tensors, new values: no refusal


@pytest.mark.parametrize("method", METHODS)
def test_a_loss_that_updates_the_modules_buffers_is_refused(method):
    # the engines refuse it for a module given to them; HyperOptimizer handed them a dict, and
    # BatchNorm's running statistics moved at every hyper-step, silently
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    hopt, model, _ = _optimizer(method, model=model)
    with pytest.raises(ValueError, match=r"HyperOptimizer: inner_loss: .* updated the buffer"):
        hopt.step()


@pytest.mark.parametrize("engine", ["reverse", "forward", "truncated", "implicit", "rtho"])
@pytest.mark.parametrize("outer", ["constant", "detached"])
def test_an_outer_loss_of_no_trained_parameter_is_refused_by_every_engine(engine, outer):
    # reverse and truncated gave 0, forward and RTHO blamed the hyperparameter
    model, inner, real_outer, l2 = _problem()
    if outer == "constant":

        def outer_loss(p):
            return torch.tensor(1.0, dtype=D)
    else:

        def outer_loss(p):
            return real_outer({k: v.detach() for k, v in p.items()})

    opt = optim.sgd(lr=torch.tensor(0.2, dtype=D))
    h = {"l2": l2}
    words = r"outer_loss: expected a loss computed from the parameters it is given"
    with pytest.raises(ValueError, match=words):
        if engine == "implicit":
            hyper.implicit(inner, outer_loss, dict(model.named_parameters()), h)
        elif engine == "rtho":
            hyper.HyperOptimizer(inner, outer_loss, model, opt, h, method="rtho", steps=2).step()
        elif engine == "truncated":
            hyper.truncated(inner, outer_loss, model, opt, steps=STEPS, last=2, hyper=h)
        else:
            getattr(hyper, engine)(inner, outer_loss, model, opt, steps=STEPS, hyper=h)


def test_an_outer_step_out_of_the_optimizers_range_is_refused_and_undone():
    # a learning rate the outer step made negative was trained on, silently (optim.sgd refuses
    # one at construction)
    model, inner, outer, _ = _problem()
    lr = torch.tensor(0.2, dtype=D)
    grad = hyper.reverse(inner, outer, model, optim.sgd(lr=lr), steps=STEPS, hyper={"lr": lr})

    def made(**kw):
        # a step far past 0, downhill or up as the hypergradient's sign needs
        outer_opt = torch.optim.SGD([lr], lr=1e4, maximize=float(grad["lr"]) < 0)
        return hyper.HyperOptimizer(
            inner, outer, model, optim.sgd(lr=lr), {"lr": lr}, steps=STEPS, outer_opt=outer_opt,
            **kw,
        )  # fmt: skip

    hopt = made()
    with pytest.raises(ValueError, match=r"HyperOptimizer.step\(\): lr: expected .* >= 0") as info:
        hopt.step()
    assert "projections" in "".join(getattr(info.value, "__notes__", ["projections"]))
    assert float(lr) == 0.2 and not hopt.history  # undone
    made(projections={"lr": lambda v: v.clamp_min(0)}).step()
    assert float(lr) == 0.0


@pytest.mark.parametrize("engine", ["reverse", "forward", "HyperOptimizer"])
def test_a_schedule_shorter_than_the_steps_is_refused_at_once(engine):
    model, inner, outer, l2 = _problem()
    opt = optim.sgd(lr=torch.full((STEPS - 1,), 0.2, dtype=D))
    words = rf"opt's lr: expected a schedule with a value for each of the {STEPS} steps"
    with pytest.raises(ValueError, match=words):
        if engine == "HyperOptimizer":
            hyper.HyperOptimizer(inner, outer, model, opt, {"l2": l2}, steps=STEPS)
        else:
            getattr(hyper, engine)(inner, outer, model, opt, steps=STEPS, hyper={"l2": l2})


def test_a_tied_tensor_given_under_two_names_is_refused():
    # named_parameters(remove_duplicate=False) lists it twice: torch's functional_call then
    # raised, advising tie_weights=False, which would untie the model
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model[2].weight = model[0].weight
    _, inner, outer, l2 = _problem(model)
    both = dict(model.named_parameters(remove_duplicate=False))
    opt = optim.sgd(lr=torch.tensor(0.2, dtype=D))
    with pytest.raises(ValueError, match=r"params0: expected each tensor once, got the same"):
        hyper.reverse(inner, outer, both, opt, steps=STEPS, hyper={"l2": l2})


@pytest.mark.parametrize("engine", ["reverse", "HyperOptimizer"])
def test_parameters_of_two_dtypes_are_named(engine):
    # the error named an internal call, state_layout(params, state), and no parameter
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model[2].float()
    _, inner, outer, l2 = _problem(model)
    opt = optim.sgd(lr=torch.tensor(0.2, dtype=D))
    words = r"params0: expected tensors of one dtype on one device .*params0\['2.weight'\] is"
    with pytest.raises(TypeError, match=words):
        if engine == "HyperOptimizer":
            hyper.HyperOptimizer(inner, outer, model, opt, {"l2": l2}, steps=STEPS)
        else:
            hyper.reverse(inner, outer, model, opt, steps=STEPS, hyper={"l2": l2})


def test_a_refused_rtho_step_keeps_no_inner_steps():
    """RTHO's inner run goes on from hyper-step to hyper-step: a refused outer step kept the
    inner steps it took (the next accepted step reported 10 of them and another gradient)."""
    model, inner, outer, _ = _problem()
    lr = torch.tensor(0.2, dtype=D)
    grad = hyper.reverse(inner, outer, model, optim.sgd(lr=lr), steps=STEPS, hyper={"lr": lr})

    def made(step: float):
        outer_opt = torch.optim.SGD([lr], lr=step, maximize=float(grad["lr"]) < 0)
        return hyper.HyperOptimizer(
            inner, outer, model, optim.sgd(lr=lr), {"lr": lr}, method="rtho", steps=STEPS,
            outer_opt=outer_opt,
        )  # fmt: skip

    hopt = made(1e4)
    before = hopt.state_dict()["online"]
    with pytest.raises(ValueError, match=r"HyperOptimizer.step\(\): lr: expected .* >= 0"):
        hopt.step()
    assert before is None and hopt.state_dict()["online"] is None  # no inner step kept
    hopt.outer_opt.param_groups[0]["lr"] = 0.0
    got = hopt.step()  # the first hyper-step over again
    want = made(0.0).step()
    assert got.inner_steps == want.inner_steps == STEPS
    assert float(got.grads["lr"]) == float(want.grads["lr"])
    kept = hopt.state_dict()["online"]
    hopt.outer_opt.param_groups[0]["lr"] = 1e4  # refused again, after an accepted step
    with pytest.raises(ValueError, match=r"lr: expected .* >= 0"):
        hopt.step()
    now = hopt.state_dict()["online"]
    assert now["t"] == kept["t"] == STEPS
    assert all(torch.equal(a, b) for a, b in zip(now["params"], kept["params"], strict=True))

"""``track()`` keeps, per model, which modules it tracks with which rule (see
``per_example._plan``). After any change of the model between two ``track()`` calls, the kept
decision must be exactly the one made afresh: each case changes the model one way and compares
the two, field by field, and the statistics against a one-example-at-a-time loop."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from gradkit import GradkitError
from gradkit.per_example import _plan, track
from gradkit.per_example._capture import tracked_modules
from gradkit.per_example._layout import inner_batch_dims, parse_batch_dim
from gradkit.per_example._registry import _RULES
from gradkit.per_example.rules import vmap_rule
from gradkit.testing import per_example_grads


class Doubler(nn.Module):
    """A module of its own class, with a parameter (the vmap fallback, unless a rule)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.scale * x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Doubler(6), nn.Linear(6, 3)).double()


def _fields(states):
    return [
        (
            st.name,
            st.module,
            st.rule,
            list(st.params),
            [id(p) for p in st.params.values()],
            st.pids,
            st.batch_dim,
            st.fusion,
            st.shared,
            st.checked,
            st.parametrized,
            st.label,
            st.builtin,
        )
        for st in states
    ]


def _fresh(model, batch_dim=0, fallback="vmap"):
    """The decision made without a plan (what track() decided before plans)."""
    modules = dict(model.named_modules())
    dim, given = parse_batch_dim(batch_dim, modules, "test")
    return tracked_modules(modules, inner_batch_dims(modules, dim, given), fallback, "test")


def _planned(model, batch_dim=0, fallback="vmap"):
    modules = dict(model.named_modules())
    dim, given = parse_batch_dim(batch_dim, modules, "test")
    return _plan.planned_modules(model, modules, dim, given, fallback, "test")


def _raises_alike(fn_a, fn_b):
    """Both raise the same error (a refusal), or neither: their results then."""
    try:
        a = fn_a()
    except GradkitError as err:
        with pytest.raises(GradkitError) as again:
            fn_b()
        assert str(again.value) == str(err)
        return None
    return a, fn_b()


def _replace_layer(m):
    m[3] = nn.Linear(6, 3).double()


def _replace_weight(m):
    m[0].weight = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))


def _drop_bias(m):
    m[3].bias = None


def _parametrize(m):
    class Scaled(nn.Module):
        def forward(self, w):
            return 3 * w

    parametrize.register_parametrization(m[0], "weight", Scaled())


def _weight_norm(m):
    torch.nn.utils.weight_norm(m[3])


def _spectral_norm(m):
    torch.nn.utils.spectral_norm(m[0])


class ScaledLinear(nn.Linear):
    """A subclass computing something else: no inherited rule (the fallback)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class WeightNorm:
    """A forward pre-hook of the class name the hook-based weight norm has."""

    def __call__(self, module, args):
        return None


def _lists(m):
    # two ParameterLists in the Doubler (the fallback's, with its subtree), one frozen; a Tanh
    # after it holds the frozen one too: without a trainable parameter, it is not tracked
    frozen = nn.ParameterList([nn.Parameter(torch.ones(3, dtype=torch.float64))])
    frozen.requires_grad_(False)
    m[2].frozen = frozen
    m[2].trainable = nn.ParameterList([nn.Parameter(torch.ones(3, dtype=torch.float64))])
    m.insert(3, nn.Tanh())
    m[3].reads = frozen


def _doubled(self, x):
    return 2 * F.linear(x, self.weight, self.bias)


def _own_class(m, k=3):
    # a class of its own that inherits Linear's forward (and so its rule)
    m[k].__class__ = type("Inherits", (nn.Linear,), {})


def _class_forward(m, k=3):
    type(m[k]).forward = _doubled  # the class computes something else now: no Linear rule


def _lookup(self, name):
    return nn.Module.__getattr__(self, name)


def _class_lookup(m, k=3):
    type(m[k]).__getattr__ = _lookup  # overridden: self.weight may be another tensor now


def _attribute(self, name):
    return object.__getattribute__(self, name)


def _class_attribute(m, k=3):
    type(m[k]).__getattribute__ = _attribute


def _relative_bias(m):
    m[1].relative_attention_bias = nn.Embedding(4, 2).double()
    m[1].has_relative_attention_bias = False


def _swap_list(m):
    # a module without parameters of its own that reads a ParameterList child is differentiated
    # by the fallback: the Tanh now holds the trainable list, which named_modules() gives under
    # its earlier name (unchanged: only the child's identity is)
    names = list(dict(m.named_modules()))
    m[3].reads = m[2].trainable
    assert list(dict(m.named_modules())) == names


CHANGES = {
    "nothing": lambda m: None,
    "a list read by a parent": (_lists, _swap_list),
    "train a spectral norm": (lambda m: (_spectral_norm(m), m.eval()), lambda m: m.train()),
    "a T5-style relative attention bias": (
        _relative_bias,
        lambda m: setattr(m[1], "has_relative_attention_bias", True),
    ),
    "a subclass": lambda m: setattr(m[3], "__class__", ScaledLinear),
    "a class's forward": (_own_class, _class_forward),
    "a class's __getattr__": (_own_class, _class_lookup),
    "a class's __getattribute__": (_own_class, _class_attribute),
    "an instance's forward": lambda m: setattr(m[0], "forward", types.MethodType(_doubled, m[0])),
    "a hook named WeightNorm": lambda m: m[0].register_forward_pre_hook(WeightNorm()),
    "freeze a weight": lambda m: m[0].weight.requires_grad_(False),
    "freeze a module": lambda m: m[2].requires_grad_(False),
    "replace a layer": _replace_layer,
    "replace a weight": _replace_weight,
    "drop a bias": _drop_bias,
    "parametrize a weight": _parametrize,
    "hook-based weight norm": _weight_norm,
    "hook-based spectral norm, training": _spectral_norm,
    "hook-based spectral norm, eval": lambda m: (_spectral_norm(m), m.eval()),
    "eval": lambda m: m.eval(),
    "tie two weights": lambda m: setattr(m[3], "weight", m[0].weight),
    "call a layer twice": lambda m: m.insert(4, m[0]),
    "add a child": lambda m: m.append(nn.Linear(3, 3).double()),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_kept_plan_is_the_decision_made_afresh(change):
    model = _model()
    both = CHANGES[change]
    before, after = both if isinstance(both, tuple) else (None, both)
    if before is not None:
        before(model)
    first = _planned(model)  # makes the plan
    assert _fields(first) == _fields(_fresh(model))
    after(model)
    got = _raises_alike(lambda: _fresh(model), lambda: _planned(model))
    if got is not None:
        fresh, planned = got
        assert _fields(planned) == _fields(fresh)
        # and kept for the next call, again the same
        assert _fields(_planned(model)) == _fields(fresh)


def test_an_unchanged_model_reuses_its_plan_with_fresh_states():
    model = _model()
    a = _planned(model)
    plan = _plan._PLANS[model]
    b = _planned(model)
    assert _plan._PLANS[model] is plan
    assert _fields(a) == _fields(b)
    for x, y in zip(a, b, strict=True):  # per-call state is never shared between blocks
        assert x is not y and x.pending is not y.pending and x.dtypes is not y.dtypes


def test_a_registered_rule_changes_the_plan(monkeypatch):
    model = _model()

    def rule_of_doubler():
        return {st.name: st.rule for st in _planned(model)}["2"]

    assert rule_of_doubler() is vmap_rule

    def doubler_rule(module, uses, ctx):  # pragma: no cover - only its identity is compared
        raise AssertionError

    monkeypatch.setitem(_RULES, Doubler, doubler_rule)
    assert rule_of_doubler() is doubler_rule
    monkeypatch.undo()
    assert rule_of_doubler() is vmap_rule


def test_a_replaced_functional_changes_the_plan(monkeypatch):
    model = _model()

    def rules():
        return [st.rule for st in _planned(model)]

    kept = rules()
    assert vmap_rule not in (kept[0], kept[-1])
    original = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: original(x, w, b))
    assert rules() == [st.rule for st in _fresh(model)]
    assert rules()[0] is vmap_rule
    monkeypatch.undo()
    assert rules() == kept


def test_arguments_are_part_of_the_plan():
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False).double()
    for batch_dim in (0, 1, {"": 1, "self_attn": 0}, 0):
        assert _fields(_planned(model, batch_dim)) == _fields(_fresh(model, batch_dim))
    model.self_attn.batch_first = True  # read by the layer's batch dimension
    assert _fields(_planned(model)) == _fields(_fresh(model))
    with pytest.raises(GradkitError, match="a rule for every tracked module"):
        _planned(_model(), fallback="error")


def test_warn_gives_its_warning_at_every_call():
    model = _model()
    for _ in range(2):
        warned = pytest.warns(UserWarning, match="no rule for 2")
        with warned, track(model, "variance", fallback="warn"):
            pass


def test_the_plan_keeps_no_model_alive():
    model = _model()
    layer = model[3]
    with track(model, "variance"):
        pass
    dead_layer = weakref.ref(layer)
    del layer
    _replace_layer(model)  # the old layer is no longer the model's
    gc.collect()
    assert dead_layer() is None
    dead = weakref.ref(model)
    del model
    gc.collect()
    assert dead() is None


def _stats_match_loop(model, seed):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (5,), generator=g)
    model.zero_grad(set_to_none=True)
    with track(model, "second_moment", "batch_l2") as stats:
        F.cross_entropy(model(x), y).backward()
    ref = per_example_grads(model, F.cross_entropy, x, y)
    tracked = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(stats) == sorted(tracked)
    for name in tracked:
        torch.testing.assert_close(
            stats[name].second_moment, ref[name].square().mean(0), rtol=1e-10, atol=1e-14
        )
    norms = sum(ref[n].flatten(1).square().sum(1) for n in tracked)
    torch.testing.assert_close(stats.batch_l2(), norms, rtol=1e-10, atol=1e-14)


def test_statistics_follow_the_model_across_steps():
    """A training loop that changes the model between tracked steps: every step's statistics
    are the loop's, for the parameters the model has then."""
    model = _model()
    steps = [
        lambda m: None,
        _replace_layer,
        lambda m: m[0].weight.requires_grad_(False),
        lambda m: None,
        lambda m: m[0].weight.requires_grad_(True),
        _replace_weight,
        lambda m: torch.nn.utils.parametrizations.weight_norm(m[3]),
        lambda m: None,
        lambda m: m[2].requires_grad_(False),
        lambda m: setattr(m[0], "forward", types.MethodType(_doubled, m[0])),
        lambda m: delattr(m[0], "forward"),
        lambda m: _own_class(m, 0),
        lambda m: _class_forward(m, 0),
        lambda m: None,
    ]
    for seed, change in enumerate(steps):
        change(model)
        _stats_match_loop(model, seed)

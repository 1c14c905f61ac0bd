"""A user's rule must sum over every use of its module: one that reads only ``uses[0]`` is
silently wrong on tied weights, so gradkit refuses it when the module ran more than once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradkit
from gradkit.per_example import Materialized, RuleContext, Use
from gradkit.per_example._grads import PerExampleGrad
from gradkit.per_example._registry import _RULES
from gradkit.testing import per_example_grads


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s * x


class Twice(nn.Module):
    """One Scale module called twice: its weight is tied across the two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(3, 3), Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(torch.tanh(self.scale(self.lin(x))))


def summing_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    per_example = sum((u.inputs[0] * u.grad_output).flatten(1).sum(1) for u in uses)
    return {"s": Materialized(per_example)}


def first_use_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    x, g = uses[0].inputs[0], uses[0].grad_output
    return {"s": Materialized((x * g).flatten(1).sum(1))}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 3).sum(1).mean()


@pytest.fixture
def rule_slot(monkeypatch: pytest.MonkeyPatch):
    def register(rule):
        monkeypatch.setitem(_RULES, Scale, rule)

    return register


def _run(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    with gradkit.per_example.track(model, "batch_grad") as stats:
        _loss(model(x), y).backward()
    return stats


def test_a_summing_rule_on_a_tied_module_equals_the_loop_oracle(rule_slot) -> None:
    rule_slot(summing_rule)
    model = Twice().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    want = per_example_grads(model, _loss, x, y)
    stats = _run(model, x, y)
    for name, g in want.items():
        torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


def test_a_rule_reading_only_the_first_use_is_refused_on_a_tied_module(rule_slot) -> None:
    rule_slot(first_use_rule)
    model = Twice().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(gradkit.GradkitError, match=r"first_use_rule.*uses \[1\] never read"):
        _run(model, x, y)


def test_a_rule_reading_only_the_first_use_is_fine_when_the_module_ran_once(rule_slot) -> None:
    rule_slot(first_use_rule)
    model = nn.Sequential(nn.Linear(3, 3), Scale()).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    want = per_example_grads(model, _loss, x, y)
    stats = _run(model, x, y)
    torch.testing.assert_close(stats["1.s"].batch_grad, want["1.s"], rtol=1e-10, atol=1e-12)


def _raw_tensor_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    return {"s": sum((u.inputs[0] * u.grad_output).flatten(1).sum(1) for u in uses)}


def _misspelled_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    return {**summing_rule(module, uses, ctx), "scale": summing_rule(module, uses, ctx)["s"]}


def _scalar_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    return {"s": Materialized(sum((u.inputs[0] * u.grad_output).sum() for u in uses))}


@pytest.mark.parametrize(
    ("rule", "error", "words"),
    [
        (_raw_tensor_rule, TypeError, ("its result for 's'", "PerExampleGrad", "Materialized")),
        (_misspelled_rule, ValueError, ("keys", "['scale']", "named_parameters")),
        (_scalar_rule, ValueError, ("Materialized(grads)", "[N, *param.shape]", "shape=()")),
    ],
)
def test_a_rules_malformed_result_is_refused_by_name(rule_slot, rule, error, words) -> None:
    """A raw tensor, a key that is not a parameter's name, a 0-dim Materialized: refused, naming
    the rule and what to return (they raised an AttributeError or an IndexError deep in the
    tracker, or the key was silently ignored)."""
    rule_slot(rule)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(error) as raised, gradkit.per_example.track(model, "variance"):
        model(torch.randn(5, 3)).pow(2).sum(1).mean().backward()
    assert all(w in str(raised.value) for w in words), str(raised.value)


def _doubled_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    per_example = sum((u.inputs[0] * u.grad_output).flatten(1).sum(1) for u in uses)
    return {"s": Materialized(2 * per_example)}


def _last_use_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    for u in uses:  # reads every use, keeps the last
        per_example = (u.inputs[0] * u.grad_output).flatten(1).sum(1)
    return {"s": Materialized(per_example)}


@pytest.mark.parametrize("rule", [_doubled_rule, _last_use_rule])
def test_a_rule_whose_sum_is_not_autograds_is_refused_when_read(rule_slot, rule) -> None:
    """A rule 2x off (its mean, read at the edges, stayed right while the second moment was 4x)
    or one that iterates over the uses but keeps the last: their per-example gradients do not
    sum to the gradient autograd sent the parameter. The statistics are refused when read,
    naming the parameter and the rule's module; p.grad is autograd's."""
    rule_slot(rule)
    torch.manual_seed(0)
    model = Twice().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with gradkit.per_example.track(model, "mean", "variance") as stats:
        _loss(model(x), y).backward()
    want = per_example_grads(model, _loss, x, y)
    torch.testing.assert_close(model.scale.s.grad, want["scale.s"].mean(0))
    with pytest.raises(gradkit.GradkitError, match=r"'scale.s' of scale \(Scale\).*sum to"):
        stats["lin.weight"].var()


def _float32_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    per_example = sum((u.inputs[0] * u.grad_output).flatten(1).sum(1) for u in uses)
    return {"s": Materialized(per_example.float())}


def test_a_rule_less_precise_than_a_float64_model_is_refused(rule_slot) -> None:
    """float32 per-example gradients of a float64 parameter made every statistic float32
    (1e-7 where the model's precision is 1e-16), silently: refused, naming the dtypes."""
    rule_slot(_float32_rule)
    model = nn.Sequential(nn.Linear(3, 3), Scale()).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(TypeError) as raised, gradkit.per_example.track(model, "variance"):
        model(x).pow(2).sum(1).mean().backward()
    words = ("_float32_rule", "'s'", "precision (torch.float64)", "torch.float32 tensors")
    assert all(w in str(raised.value) for w in words), str(raised.value)
    rule_slot(summing_rule)  # the same sums in float64: accepted
    with gradkit.per_example.track(model, "variance") as stats:
        model(x).pow(2).sum(1).mean().backward()
    assert stats["1.s"].variance.dtype == torch.float64


def test_a_rule_in_the_calls_own_low_precision_is_accepted(rule_slot, device) -> None:
    """Under bf16 autocast the call's output gradient is bf16: a rule computing in it is as
    precise as the layer's own backward (a float32 parameter)."""
    rule_slot(_bf16_rule)
    model = nn.Sequential(nn.Linear(3, 3), Scale())
    with gradkit.per_example.track(model, "variance") as stats:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(torch.randn(4, 3))
        out.float().pow(2).sum(1).mean().backward()
    assert stats["1.s"].variance.dtype == torch.float32


def _bf16_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, object]:
    assert uses[0].grad_output.dtype == torch.bfloat16  # the call ran in bf16
    per_example = sum((u.inputs[0] * u.grad_output).flatten(1).sum(1) for u in uses)
    return {"s": Materialized(per_example.to(torch.bfloat16))}

"""Both ways of materializing per-example convolution weight gradients (a grouped weight-gradient
convolution, a batched product over unfolded patches) against the one-example-at-a-time oracle,
on every convolution option; and the timed choice between them is kept per shape."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from gradkit.per_example import track
from gradkit.per_example.rules import _conv
from gradkit.testing import per_example_grads

CONVS = {
    "2d": (lambda: nn.Conv2d(4, 6, 3), (5, 4, 7, 7)),
    "2d_stride_pad": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1), (5, 4, 8, 8)),
    "2d_dilation_groups": (lambda: nn.Conv2d(4, 6, 3, dilation=2, groups=2), (5, 4, 9, 9)),
    "2d_reflect_same": (
        lambda: nn.Conv2d(3, 4, (3, 2), padding="same", padding_mode="reflect"),
        (5, 3, 6, 6),
    ),
    "1d_circular": (lambda: nn.Conv1d(3, 5, 3, padding=2, padding_mode="circular"), (5, 3, 9)),
    "3d_groups": (lambda: nn.Conv3d(4, 4, 2, groups=4, stride=(1, 2, 1)), (4, 4, 4, 5, 4)),
}


@pytest.mark.parametrize("method", _conv._METHODS)
@pytest.mark.parametrize("name", sorted(CONVS))
def test_each_method_matches_the_oracle(
    name: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_conv, "_FORCE", method)
    make, shape = CONVS[name]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Tanh(), nn.Flatten()).double()
    x = torch.randn(*shape, dtype=torch.float64)

    def loss(out: torch.Tensor, _: object) -> torch.Tensor:
        return out.pow(2).sum()

    with track(model, "batch_grad", "variance", loss_reduction="sum", chunk_size=3) as stats:
        loss(model(x), None).backward()
    ref = per_example_grads(model, loss, x, None)
    for pname, g in ref.items():
        torch.testing.assert_close(stats[pname].batch_grad, g, rtol=1e-10, atol=1e-12)
        var = g.var(0, unbiased=False)
        torch.testing.assert_close(stats[pname].variance, var, rtol=1e-9, atol=1e-12)


def test_the_choice_is_timed_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_conv, "_CHOICE", {})
    monkeypatch.setattr(_conv, "_TIMING", 0.0)  # two rounds exactly
    calls: list[str] = []
    for method in ("_grouped", "_unfolded"):
        original = getattr(_conv.ConvWeightGrad, method)

        def counted(self, start, stop, *scale, _original=original, _name=method):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _original(self, start, stop, *scale)

        monkeypatch.setattr(_conv.ConvWeightGrad, method, counted)
    model = nn.Conv2d(2, 3, 3)
    for _ in range(3):
        with track(model, "second_moment") as stats:
            model(torch.randn(4, 2, 5, 5)).pow(2).mean().backward()
        assert stats["weight"].num_examples == 4
    assert len(_conv._CHOICE) == 1
    chosen = next(iter(_conv._CHOICE.values()))
    timed = 2 * 2  # two runs of each method, once
    name = "_grouped" if chosen == "grouped" else "_unfolded"
    assert len(calls) == timed + 3 and calls[timed:] == [name] * 3


def test_small_blocks_are_timed_over_more_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The methods alternate in rounds and each keeps its best time; rounds go on while the
    timing stays within _TIMING. Two slow first rounds of the faster method (the machine busy)
    no longer decide, as they did with two runs of each (a fake clock: the method's run adds
    its duration)."""
    clock = [0.0]
    monkeypatch.setattr(_conv.time, "perf_counter", lambda: clock[0])
    runs: list[str] = []
    durations: dict[str, Any] = {}
    for method, name in (("_grouped", "grouped"), ("_unfolded", "unfold")):

        def fake(self, start, stop, *scale, _name=name):  # type: ignore[no-untyped-def]
            runs.append(_name)
            clock[0] += next(durations[_name])

        monkeypatch.setattr(_conv.ConvWeightGrad, method, fake)
    x, g = torch.randn(4, 2, 5, 5), torch.randn(4, 3, 3, 3)
    pe = _conv.ConvWeightGrad(nn.Conv2d(2, 3, 3), [(x, g)])

    def choose(budget: float) -> str:
        monkeypatch.setattr(_conv, "_CHOICE", {})
        monkeypatch.setattr(_conv, "_TIMING", budget)
        durations["grouped"] = itertools.chain([9.0, 3.0], itertools.repeat(1.0))
        durations["unfold"] = itertools.repeat(2.0)
        runs.clear()
        return _conv._choose(pe, 0, 4)

    assert choose(0.0) == "unfold" and runs == ["grouped", "unfold"] * 2  # two rounds only
    # rounds of 11, 5, then 3 each: the seventh reaches 30
    assert choose(30.0) == "grouped" and runs == ["grouped", "unfold"] * 7
    assert choose(1000.0) == "grouped" and len(runs) == 2 * _conv._MAX_ROUNDS

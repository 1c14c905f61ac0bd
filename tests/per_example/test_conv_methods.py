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


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "copied"])
@pytest.mark.parametrize("method", _conv._METHODS)
@pytest.mark.parametrize("name", sorted(CONVS))
def test_each_method_matches_the_oracle(
    name: str, method: str, gather: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_conv, "_FORCE", method)
    # the patches gathered by index (short rows) or copied from the strided view (long rows)
    monkeypatch.setattr(_conv, "_GATHER_BELOW", 10**9 if gather else 0)
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


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "copied"])
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.Conv2d(3, 4, 3), (6, 3, 6, 6)),
        (
            lambda: nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
            (2, 3, 7, 9),
        ),
        (lambda: nn.Conv2d(2, 4, 3, padding=1), (0, 2, 5, 5)),  # no example
    ],
)
def test_patches_are_f_unfolds_bit_for_bit(
    make: Any, shape: tuple[int, ...], gather: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both copies give ``F.unfold``'s patches exactly, also of a channels-last input (not
    gathered: its flat layout is another) and of a batch of no example."""
    monkeypatch.setattr(_conv, "_GATHER_BELOW", 10**9 if gather else 0)
    conv = make()
    for x in (torch.randn(shape), torch.randn(shape).to(memory_format=torch.channels_last)):
        expected = torch.nn.functional.unfold(
            x, conv.kernel_size, conv.dilation, conv.padding, conv.stride
        )
        assert torch.equal(_conv.unfold_patches(x, conv), expected)


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shape decided or being timed (the process's choices are global)."""
    monkeypatch.setattr(_conv, "_CHOICE", {})
    monkeypatch.setattr(_conv, "_TRIALS", {})


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """``(input channels, method)`` of every block computed from now on."""
    calls: list[tuple[int, str]] = []
    for method in ("_grouped", "_unfolded"):
        original = getattr(_conv.ConvWeightGrad, method)

        def counted(self, start, stop, *scale, _original=original, _name=method):  # type: ignore[no-untyped-def]
            calls.append((self.module.in_channels, _name))
            return _original(self, start, stop, *scale)

        monkeypatch.setattr(_conv.ConvWeightGrad, method, counted)
    return calls


@pytest.mark.cpu_only  # the choice is timed on the CPU (elsewhere F.unfold's patches)
@pytest.mark.usefixtures("fresh_choice")
def test_the_choice_is_made_on_the_first_steps_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape's first blocks are computed by a run of each method (each block once: nothing
    runs only to be timed); then the faster computes every later block, and the statistics
    are the oracle's throughout."""
    calls = _count_calls(monkeypatch)
    torch.manual_seed(0)
    model = nn.Conv2d(2, 3, 3).double()
    timed = _conv._RUNS * len(_conv._METHODS)
    for step in range(timed + 3):
        x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
        with track(model, "second_moment", loss_reduction="sum") as stats:
            model(x).pow(2).sum().backward()
        ref = per_example_grads(model, lambda out, _: out.pow(2).sum(), x, None)
        expected = ref["weight"].pow(2).mean(0)
        torch.testing.assert_close(stats["weight"].second_moment, expected, rtol=1e-10, atol=0)
        assert len(calls) == step + 1  # one block per step, computed once
    methods = [m for _, m in calls]
    assert methods[:timed] == ["_grouped"] * _conv._RUNS + ["_unfolded"] * _conv._RUNS
    (chosen,) = _conv._CHOICE.values()
    assert methods[timed:] == ["_grouped" if chosen == "grouped" else "_unfolded"] * 3
    assert not _conv._TRIALS


@pytest.mark.cpu_only
@pytest.mark.usefixtures("fresh_choice")
def test_the_faster_method_is_kept_and_first_runs_do_not_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each method keeps its best time but for its first block (set-up, the other method's
    buffers); a slow first block of the faster method does not decide (a fake clock: a
    method's run adds its duration)."""
    clock = [0.0]
    monkeypatch.setattr(_conv.time, "perf_counter", lambda: clock[0])
    durations: dict[str, Any] = {}
    for method, name in (("_grouped", "grouped"), ("_unfolded", "unfold")):

        def fake(self, start, stop, *scale, _name=name):  # type: ignore[no-untyped-def]
            clock[0] += next(durations[_name])
            return torch.zeros(stop - start, *self.shape)

        monkeypatch.setattr(_conv.ConvWeightGrad, method, fake)
    x, g = torch.randn(4, 2, 5, 5), torch.randn(4, 3, 3, 3)
    pe = _conv.ConvWeightGrad(nn.Conv2d(2, 3, 3), [(x, g)])

    def choose(grouped: list[float], unfold: list[float]) -> str:
        monkeypatch.setattr(_conv, "_CHOICE", {})
        durations["grouped"], durations["unfold"] = iter(grouped), iter(unfold)
        for _ in range(_conv._RUNS * len(_conv._METHODS)):
            pe._block(0, 4)
        (chosen,) = _conv._CHOICE.values()
        return chosen

    assert _conv._RUNS == 4
    assert choose([50.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]) == "grouped"
    assert choose([1.0, 3.0, 3.0, 3.0], [9.0, 2.0, 8.0, 8.0]) == "unfold"
    # a block short of both runs: no choice yet
    monkeypatch.setattr(_conv, "_CHOICE", {})
    durations["grouped"], durations["unfold"] = itertools.repeat(1.0), itertools.repeat(2.0)
    for _ in range(_conv._RUNS * len(_conv._METHODS) - 1):
        pe._block(0, 4)
    (trial,) = _conv._TRIALS.values()
    assert not _conv._CHOICE and trial.runs == 7


@pytest.mark.cpu_only
@pytest.mark.usefixtures("fresh_choice")
def test_one_shape_is_timed_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one layer's shape is timed, another's blocks are computed by _WAITING, untimed;
    its timing starts once the first is decided. A shape whose layer stops running gives its
    turn after _PATIENCE blocks of the others, and starts over behind them."""
    calls = _count_calls(monkeypatch)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Conv2d(3, 4, 3))
    first, second = model[1].in_channels, model[0].in_channels  # backward order
    waiting = "_unfolded" if _conv._WAITING == "unfold" else "_grouped"
    timed = _conv._RUNS * len(_conv._METHODS)

    def step(m: nn.Module) -> None:
        with track(m, "second_moment") as stats:
            m(torch.randn(4, 2, 7, 7)).pow(2).mean().backward()
        assert stats["0.weight"].num_examples == 4

    # model[1] runs first in the backward: its last timed block hands the turn to model[0]
    # within the same step
    for _ in range(2 * timed - 1):
        step(model)
    runs = ["_grouped"] * _conv._RUNS + ["_unfolded"] * _conv._RUNS
    assert [m for c, m in calls if c == first][:timed] == runs
    assert [m for c, m in calls if c == second] == [waiting] * (timed - 1) + runs
    assert len(_conv._CHOICE) == 2 and not _conv._TRIALS

    # a shape whose layer stops running: the other waits _PATIENCE blocks, then is timed
    monkeypatch.setattr(_conv, "_CHOICE", {})
    monkeypatch.setattr(_conv, "_TRIALS", {})
    monkeypatch.setattr(_conv, "_PATIENCE", 3)
    step(model)  # both shapes seen; the first (model[1]) is being timed
    calls.clear()
    alone = nn.Sequential(model[0])  # the same first layer, without model[1]
    with track(alone, "second_moment") as stats:
        for _ in range(5):
            alone(torch.randn(4, 2, 7, 7)).pow(2).mean().backward()
    assert stats["0.weight"].num_examples == 20
    # _PATIENCE blocks waited in all, one of them in the step both layers ran
    assert [m for _, m in calls] == [waiting] * 2 + ["_grouped"] * 3
    assert [key[1][0] for key in _conv._TRIALS] == [second, first]  # input channels

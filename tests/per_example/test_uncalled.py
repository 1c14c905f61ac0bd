"""Parameters used outside their module's calls. A ``ParameterList`` or ``ParameterDict`` read
by the module that holds it gets the loop oracle's statistics (the holder is differentiated by
the vmap fallback); any other module whose parameters are used while it is not called is
refused, since its statistics, made from its calls, would be 0 for every example; and so is a
parameter of a module the vmap fallback differentiates that is also read outside its calls
(that use would be left out). Weight decay added to the loss is not a use on the examples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64


class Holder(nn.Module):
    """A layer scale kept in a ParameterList, a shift in a ParameterDict, read by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gammas = nn.ParameterList([nn.Parameter(torch.randn(4))])
        self.extra = nn.ParameterDict({"shift": nn.Parameter(torch.randn(4))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gammas[0] * torch.tanh(self.fc(x)) + self.extra["shift"]


class Bypassed(nn.Module):
    """A PReLU run as ``act.forward(h)``, which skips its module hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.PReLU(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act.forward(self.fc(x))


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * x


class ReadsChild(nn.Module):
    """A custom module never called, whose parameter its parent reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.sub = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub.g * self.fc(x)


class Unused(nn.Module):
    """A custom module never called; its parameter appears in weight decay only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.sub = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 4, dtype=D), torch.randn(6, 4, dtype=D)


def test_parameter_holders_read_by_their_module_match_the_loop() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Holder(), nn.Linear(4, 4)).to(D)
    x, y = _data()
    ref = per_example_grads(model, lambda o, t: F.mse_loss(o, t, reduction="sum"), x, y)
    with track(model, "mean", "variance", "batch_l2", "batch_grad", loss_reduction="sum") as stats:
        F.mse_loss(model(x), y, reduction="sum").backward()
    for name in ("0.gammas.0", "0.extra.shift", "0.fc.weight", "1.weight"):
        g = ref[name]
        s = stats[name]
        assert_close(
            [s.mean, s.variance, s.batch_l2, s.batch_grad],
            [g.mean(0), g.var(0, unbiased=False), g.flatten(1).square().sum(1), g],
            rtol=1e-10,
            atol=1e-12,
        )


@pytest.mark.parametrize("cls", [Bypassed, ReadsChild], ids=["forward-bypassed", "uncalled"])
def test_parameters_of_an_uncalled_module_are_refused(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls().to(D)
    x, y = _data()
    with (
        pytest.raises(GradkitError, match="not called in this pass") as info,
        track(model, "variance"),
    ):
        F.mse_loss(model(x), y).backward()
    assert "call the module itself" in str(info.value)


def test_an_uncalled_module_in_weight_decay_only_is_not_a_use_on_the_examples() -> None:
    torch.manual_seed(0)
    model = Unused().to(D)
    x, y = _data()
    with track(model, "variance", "batch_l2") as stats:
        loss = F.mse_loss(model(x), y) + 0.1 * model.sub.g.square().sum()
        loss.backward()
    # the statistics are those of the per-example losses through the layers: 0 for it
    assert torch.equal(stats["sub.g"].variance, torch.zeros(4, dtype=D))
    assert torch.equal(stats["sub.g"].batch_l2, torch.zeros(6, dtype=D))
    ref = per_example_grads(model, F.mse_loss, x, y)
    assert_close(stats["fc.weight"].batch_l2, ref["fc.weight"].flatten(1).square().sum(1))


class ReadTwice(nn.Module):
    """A PReLU (differentiated by the vmap fallback) called, and its weight also read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.PReLU(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.act(h) + h * self.act.weight


class Decayed(nn.Module):
    """The same PReLU, its weight read outside its call only in weight decay."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.PReLU(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_a_fallback_parameter_also_read_outside_its_calls_is_refused() -> None:
    torch.manual_seed(0)
    model = ReadTwice().to(D)
    x, y = _data()
    with (
        pytest.raises(GradkitError, match=r"'act.weight' used on the examples outside"),
        track(model, "mean"),
    ):
        F.mse_loss(model(x), y).backward()


def test_a_fallback_parameter_in_weight_decay_is_exact() -> None:
    torch.manual_seed(0)
    model = Decayed().to(D)
    x, y = _data()
    with track(model, "variance", "batch_grad", loss_reduction="sum") as stats:
        loss = F.mse_loss(model(x), y, reduction="sum") + 0.1 * model.act.weight.square().sum()
        loss.backward()
    ref = per_example_grads(model, lambda o, t: F.mse_loss(o, t, reduction="sum"), x, y)
    assert_close(stats["act.weight"].batch_grad, ref["act.weight"], rtol=1e-10, atol=1e-12)

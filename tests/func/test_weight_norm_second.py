"""``weight_norm``'s second derivative: where this torch's fails ``gradgradcheck`` (2.13:
40 % off for a Linear in an MLP, in plain torch too), every Hessian product through it is
refused; where it passes, they are exact against the same norm written with torch operations.
A GGN only takes its derivative in the incoming gradient (``J v``), which is exact: it is
computed either way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from gradkit import GradkitError
from gradkit._autograd import _weight_norm_is_wrong
from gradkit.curvature import GGN, Hessian
from gradkit.func import module_hessian, module_hvp, module_hvp_operator

D = torch.float64


class _Norm(nn.Module):
    """``g * v / ||v||`` per output row, with torch operations (the oracle's form)."""

    def forward(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return g * v / v.norm(dim=1, keepdim=True)

    def right_inverse(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w.norm(dim=1, keepdim=True), w


def _models() -> tuple[nn.Module, nn.Module]:
    """The same MLP with torch's weight_norm and with the oracle's, same parameters."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ours = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ours.load_state_dict(base.state_dict())
    nn.utils.parametrizations.weight_norm(base[0])
    parametrize.register_parametrization(ours[0], "weight", _Norm(), unsafe=True)
    with torch.no_grad():
        wn = base[0].parametrizations.weight
        ours[0].parametrizations.weight.original0.copy_(wn.original0)
        ours[0].parametrizations.weight.original1.copy_(wn.original1)
    return base, ours


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(6, 3, dtype=D, generator=g), torch.randint(0, 2, (6,), generator=g)


def _ones(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.ones_like(p) for n, p in model.named_parameters()}


HESSIANS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "module_hvp": lambda m, b: module_hvp(m, F.cross_entropy, b, _ones(m)),
    "module_hvp_operator": lambda m, b: module_hvp_operator(m, F.cross_entropy, b).to_dense(),
    "module_hessian": lambda m, b: module_hessian(m, F.cross_entropy, b, flat=True),
    "Hessian": lambda m, b: Hessian(m, F.cross_entropy, b).dense(),
}


def _close(got: Any, want: Any) -> None:
    if isinstance(got, dict):
        for g, w in zip(got.values(), want.values(), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    else:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch.func's vmap of it
@pytest.mark.parametrize("name", sorted(HESSIANS))
def test_hessian_products_are_refused_or_exact(name: str) -> None:
    base, ours = _models()
    batch = _batch()
    if _weight_norm_is_wrong():
        with pytest.raises(GradkitError, match="second derivative of weight_norm is wrong"):
            HESSIANS[name](base, batch)
    else:
        _close(HESSIANS[name](base, batch), HESSIANS[name](ours, batch))


def test_the_ggn_is_exact_either_way() -> None:
    base, ours = _models()
    batch = _batch()
    torch.testing.assert_close(
        GGN(base, F.cross_entropy, batch).dense(), GGN(ours, F.cross_entropy, batch).dense()
    )

"""torch's fused attention kernels have no second derivative: Hessian, GGN and Fisher
products, and ``gradkit.func``'s second derivatives, of a model that runs
``scaled_dot_product_attention`` through one raised torch's bare "derivative for
aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented" at the first
product. They are refused naming the kernel and the remedy; under the math kernel they run,
exact against the dense Hessian."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradkit import GradkitError
from gradkit.curvature import GGN, Fisher, Hessian
from gradkit.func import hvp, module_hvp


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(x).mean(1))


def _problem() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    x = torch.randn(3, 4, 8, dtype=torch.float64, generator=g)
    return _Head().double(), (x, torch.randint(0, 3, (3,), generator=g))


OPERATORS = {
    "Hessian": lambda m, b: Hessian(m, F.cross_entropy, b),
    "GGN": lambda m, b: GGN(m, F.cross_entropy, b),
    "Fisher": lambda m, b: Fisher(m, F.cross_entropy, b, kind="empirical"),
    "module_hvp": lambda m, b: module_hvp(
        m, F.cross_entropy, b, {n: torch.ones_like(p) for n, p in m.named_parameters()}
    ),
}


@pytest.mark.cpu_only  # CUDA runs float64 attention by the math kernel
@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_a_fused_kernel_is_refused_with_the_remedy(name: str) -> None:
    model, batch = _problem()
    with pytest.raises(GradkitError, match=r"ScaledDotProduct\w*Backward0.*SDPBackend.MATH"):
        OPERATORS[name](model, batch)


@pytest.mark.cpu_only
def test_a_function_through_a_fused_kernel_is_refused() -> None:
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(GradkitError, match="fused attention"):
        hvp(lambda t: F.scaled_dot_product_attention(t, t, t).pow(2).sum(), q, torch.ones_like(q))


def test_the_math_kernel_is_exact() -> None:
    model, batch = _problem()
    params = dict(model.named_parameters())
    names = list(params)

    def loss_of(*flat: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, dict(zip(names, flat, strict=True)), (batch[0],))
        return F.cross_entropy(out, batch[1])

    with sdpa_kernel(SDPBackend.MATH):
        H = Hessian(model, F.cross_entropy, batch)
        v = torch.randn(H.shape[0], dtype=torch.float64)
        got = H @ v
        vs = H.unflatten(v)
        primals = tuple(p.detach() for p in params.values())
        want = torch.func.jvp(
            torch.func.grad(loss_of, argnums=tuple(range(len(names)))), primals, tuple(vs)
        )[1]
    torch.testing.assert_close(got, torch.cat([w.reshape(-1) for w in want]), rtol=1e-9, atol=1e-12)

"""CUDA as a user meets it: the model on the GPU, torch's default device left on the CPU.

Skipped without CUDA. Each case compares with a float64 computation on the CPU.

* TF32: cuDNN runs float32 convolutions in TF32 by default (and matmuls where
  ``torch.backends.cuda.matmul.allow_tf32``, as ``set_float32_matmul_precision("high")``
  sets): 1e-3 relative where float32 is 1e-7. gradkit's own products run in full float32, and a
  call whose layer ran in TF32 takes its mean from them (like a bf16 call), so the statistics
  have float32 accuracy whatever the user's TF32 setting; ``p.grad`` stays the user's own.
* The fallback on an RNN: cuDNN's RNN reads its weights' data pointers, which the functional
  re-run's tensors do not have.
* A 0-dim CPU hyperparameter beside CUDA parameters (the README's ``torch.tensor(0.9)``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.optim import adam, rmsprop
from gradkit.per_example import track
from gradkit.testing import per_example_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@contextlib.contextmanager
def _tf32(switch: str, on: bool) -> Iterator[None]:
    """TF32 on or off for cuDNN's convolutions (``"conv"``) or cuBLAS's matmuls (``"matmul"``),
    by torch's per-operator API where it has one (its legacy flags raise once it was used)."""
    if hasattr(torch.backends.cudnn, "conv"):
        obj = torch.backends.cudnn.conv if switch == "conv" else torch.backends.cuda.matmul
        saved, obj.fp32_precision = obj.fp32_precision, "tf32" if on else "ieee"
        try:
            yield
        finally:
            obj.fp32_precision = saved
        return
    legacy = torch.backends.cudnn if switch == "conv" else torch.backends.cuda.matmul
    saved, legacy.allow_tf32 = legacy.allow_tf32, on
    try:
        yield
    finally:
        legacy.allow_tf32 = saved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def _conv_case(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Conv2d(16, 32, 3)
    common = torch.randn(1, 16, 12, 12)
    x = common + 0.01 * torch.randn(64, 16, 12, 12)  # a high signal-to-noise ratio
    return model.to(device, dtype), x.to(device, dtype)


@pytest.mark.parametrize("tf32", [True, False])
def test_convolution_statistics_have_float32_accuracy_whatever_tf32(tf32: bool) -> None:
    ref_model, ref_x = _conv_case(CPU, torch.float64)
    with track(ref_model, "batch_grad", "variance") as ref:
        ref_model(ref_x).pow(2).sum().backward()
    model, x = _conv_case(CUDA, torch.float32)
    with _tf32("conv", tf32):
        plain = copy.deepcopy(model)
        plain(x).pow(2).sum().backward()
        with track(model, "batch_grad", "variance") as stats:
            model(x).pow(2).sum().backward()
    assert _rel(stats["weight"].batch_grad, ref["weight"].batch_grad) < 1e-5
    assert _rel(stats["weight"].variance, ref["weight"].variance) < 5e-3  # float32's rounding
    if tf32:  # the layer's own product (not summed from the blocks): the user's p.grad
        assert torch.equal(model.weight.grad, plain.weight.grad)
    else:  # fused: the sum of the per-example gradients, float32 rounding apart
        scale = float(plain.weight.grad.abs().max())
        torch.testing.assert_close(model.weight.grad, plain.weight.grad, rtol=0, atol=1e-6 * scale)


def test_linear_statistics_have_float32_accuracy_under_tf32_matmuls() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))
    x = torch.randn(1, 64) + 0.01 * torch.randn(256, 64)
    ref_model = copy.deepcopy(model).double()
    with track(ref_model, "batch_grad", "variance") as ref:
        ref_model(x.double()).pow(2).sum().backward()
    model, x = model.to(CUDA), x.to(CUDA)
    with _tf32("matmul", True), track(model, "mean", "batch_grad", "variance") as stats:
        model(x).pow(2).sum().backward()
    for name in ("0.weight", "2.weight"):
        g = stats[name].batch_grad.double()
        # the user's backward runs in TF32 (the gradients reaching each layer): 2^-10 per product
        assert _rel(g, ref[name].batch_grad) < 5e-3, name
        # gradkit's own products are float32, and its mean is theirs: E[g^2] - mean^2 subtracts
        # numbers of one precision (the mean read from autograd's TF32 sum would not)
        assert _rel(stats[name].mean, g.mean(0)) < 1e-6, name
        scale = float(g.square().mean(0).max())
        var = stats[name].variance.double().cpu()
        assert float((var - g.var(0, unbiased=False).cpu()).abs().max()) < 1e-5 * scale, name


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_the_fallback_on_a_cuda_rnn(kind: type[nn.RNNBase]) -> None:
    torch.manual_seed(0)
    model = kind(3, 4, num_layers=2, batch_first=True)
    x = torch.randn(5, 6, 3)
    want = per_example_grads(model.double(), lambda o, _: o[0].pow(2).sum(), x.double(), None)
    model = model.float().to(CUDA)
    with track(model, "batch_grad", "batch_l2") as stats:
        model(x.to(CUDA))[0].pow(2).sum(1).sum(1).mean().backward()
    assert stats.batch_l2().device.type == "cuda"
    for name, g in want.items():
        got = stats[name].batch_grad
        # cuDNN's RNN forward runs in TF32 by default: the output gradients carry 2^-10
        assert _rel(got, g) < 5e-3, name


def test_the_oracle_on_a_cuda_rnn_in_eval_mode() -> None:
    """cuDNN's RNN backward runs in training mode only."""
    torch.manual_seed(0)
    model = nn.GRU(3, 4, batch_first=True).to(CUDA).eval()
    x = torch.randn(4, 5, 3, device=CUDA)
    grads = per_example_grads(model, lambda o, _: o[0].pow(2).sum(), x, None)
    assert all(g.device.type == "cuda" and g.shape[0] == 4 for g in grads.values())


def test_cpu_scalar_hyperparameters_beside_cuda_parameters() -> None:
    params = {"w": torch.zeros(4, 3, device=CUDA)}
    grads = {"w": torch.ones(4, 3, device=CUDA)}
    for opt in (
        adam(betas=(torch.tensor(0.9), 0.999)),
        rmsprop(alpha=torch.tensor(0.99), centered=True),
    ):
        new, _ = opt.update(grads, opt.init(params), params)
        assert new["w"].device.type == "cuda"


def test_a_module_the_loss_does_not_reach_on_cuda() -> None:
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    model = Heads().to(CUDA)
    with track(model, "variance", "batch_l2") as stats:
        F.mse_loss(model(torch.randn(5, 4, device=CUDA)), torch.zeros(5, 2, device=CUDA)).backward()
    assert stats["b.weight"].variance.device.type == "cuda"
    assert stats.batch_l2().device.type == "cuda"

"""The per-step hot paths never wait for the device.

On a GPU, reading a value on the host (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``)
or an op whose output size depends on the data (``torch.unique``, ``nonzero``, a boolean-mask
index) blocks until every queued kernel has finished, so the next step cannot be enqueued
while the device works. These tests run each hot path (a tracked forward and backward, an
Accumulator micro-step, a curvature product, a ``gradients`` call) after one warm-up call:

* on every device, under :func:`forbid_host_sync`, which raises at the dispatcher on each op
  that would synchronize on CUDA (the CPU never synchronizes, so the op is caught by name);
* on CUDA also under ``torch.cuda.set_sync_debug_mode("error")``, torch's own check.

The synchronizations that remain, each once per optimizer step or once per object and outside
the per-micro-batch path, are listed in docs/per_example.md ("GPUs").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradkit import curvature, per_example
from gradkit.accumulate import Accumulator
from gradkit.func import gradients
from gradkit.per_example import _fused

aten = torch.ops.aten
# ops that read a device value on the host, or whose output size depends on the data
_SYNCING = {
    aten._local_scalar_dense,  # .item(), bool(t), float(t), int(t)
    aten.equal,  # torch.equal: a bool on the host
    aten.is_nonzero,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave,  # (without output_size)
}


class _RaiseOnSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.repeat_interleave and kwargs.get("output_size") is not None:
            return func(*args, **kwargs)
        if packet in _SYNCING:
            raise AssertionError(f"host synchronization: {func}")
        if packet in (aten.index, aten.index_put, aten.index_put_):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise AssertionError(f"host synchronization: boolean-mask {func}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise ``AssertionError`` on anything in the block that would wait for a CUDA device."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def refuse(name: str) -> Callable[..., Any]:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host synchronization: Tensor.{name}")

        return method

    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse(name))
        with _RaiseOnSync():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def cuda_sync_debug_error() -> Iterator[None]:
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # torch's note that the mode is a prototype
        warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- the hot paths: each builder returns the step to run (warm-up call, then the checked call) --


def _tracked(model: nn.Module, x: torch.Tensor, *quantities: str, micro: int = 2):
    y = torch.randint(0, 3, (x.shape[0],))

    def loss() -> torch.Tensor:
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        out = out.mean(1) if out.dim() == 3 else out
        return F.cross_entropy(out[:, :3], y)

    def step() -> None:
        with per_example.track(model, *quantities):
            for _ in range(micro):
                loss().backward()

    return step


class _Scale(nn.Module):  # no rule: the vmap fallback
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def track_mlp():
    return _tracked(_mlp(), torch.randn(6, 8), "variance", "second_moment", "batch_l2")


def track_mlp_batch_grad():
    return _tracked(_mlp(), torch.randn(6, 8), "batch_grad", "mean")


def track_conv():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)
    )
    return _tracked(model, torch.randn(6, 1, 8, 8), "variance", "batch_l2", "batch_grad")


def _fusing(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with every layer call that can be fused fused (its weight gradient summed from
    the statistics), whatever its size."""

    def run() -> None:
        saved, _fused.MIN_PRODUCT = _fused.MIN_PRODUCT, 0
        try:
            step()
        finally:
            _fused.MIN_PRODUCT = saved

    return run


def track_conv_fused():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(),
        nn.Linear(144, 3),
    )  # fmt: skip
    return _fusing(_tracked(model, torch.randn(6, 1, 8, 8), "variance", "batch_grad"))


def track_sequence_fused():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    return _fusing(_tracked(model, torch.randn(6, 5, 8), "variance", "batch_grad"))


def track_sequence_in_place():  # not fused: the output read at its view's base
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    return _tracked(model, torch.randn(6, 5, 8), "mean", "batch_l2")


def track_embedding():
    model = nn.Sequential(nn.Embedding(10, 8, padding_idx=0), nn.LayerNorm(8), nn.Linear(8, 3))
    x = torch.randint(0, 10, (6, 5))
    return _tracked(model, x, "variance", "batch_l2", "batch_grad")


def track_transformer_layer():
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return _tracked(model, torch.randn(6, 5, 8), "variance", "batch_l2")


def track_lstm():
    return _tracked(nn.LSTM(8, 8, batch_first=True), torch.randn(6, 5, 8), "variance", "batch_l2")


def track_fallback():
    model = nn.Sequential(nn.Linear(8, 8), _Scale(), nn.Linear(8, 3))
    return _tracked(model, torch.randn(6, 8), "variance", "batch_l2")


def track_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 40, (3, 6))

    def step() -> None:
        with per_example.track(model, "variance", "batch_l2"):
            model(ids, labels=ids).loss.backward()

    return step


def accumulator_micro_steps():
    model = nn.Sequential(nn.Embedding(11, 6), nn.Tanh(), nn.Linear(6, 11))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, normalize="tokens", max_grad_norm=1.0)
    tokens = torch.randint(0, 11, (6, 5))
    labels = torch.randint(0, 11, (6, 5)).masked_fill(tokens == 0, -100)

    def micro_steps() -> None:  # a whole window but its step()
        for lo in (0, 2, 4):
            lab = labels[lo : lo + 2]
            with acc.micro_step(count=(lab != -100).sum()):  # a tensor: read once, in step()
                logits = model(tokens[lo : lo + 2]).reshape(-1, 11)
                acc.backward(F.cross_entropy(logits, lab.reshape(-1), reduction="sum"))

    def step() -> None:
        micro_steps()
        acc.step()  # the window's one synchronization

    step()  # the first micro-step checks once that no gradient is left over
    return micro_steps


def _operator(kind: type) -> Callable[[], None]:
    """A product of a curvature operator, without its check for weights edited through
    ``.data`` (one host read per product: tested on its own below)."""
    model = _mlp()
    data = (torch.randn(6, 8), torch.randint(0, 3, (6,)))
    op = kind(model, F.cross_entropy, data)
    v = torch.randn(op.shape[0])

    def product() -> None:
        op @ v
        op._state._values = False  # recorded at the first product

    return product


def ggn_product():
    return _operator(curvature.GGN)


def hessian_product():
    return _operator(curvature.Hessian)


def gradients_call():
    model = _mlp()
    x = torch.randn(6, 8)
    params = list(model.parameters())
    return lambda: gradients(model(x).square().sum(), params)


HOT_PATHS = [
    track_mlp,
    track_mlp_batch_grad,
    track_conv,
    track_conv_fused,
    track_sequence_fused,
    track_sequence_in_place,
    track_embedding,
    track_transformer_layer,
    track_lstm,
    track_fallback,
    track_gpt2,
    accumulator_micro_steps,
    ggn_product,
    hessian_product,
    gradients_call,
]


@pytest.mark.parametrize("build", HOT_PATHS, ids=lambda f: f.__name__)
def test_hot_path_never_waits_for_the_device(build, device):
    step = build()
    step()  # warm-up: lazy set-up may synchronize once
    with forbid_host_sync():
        step()


@pytest.mark.cuda
@pytest.mark.parametrize("build", HOT_PATHS, ids=lambda f: f.__name__)
def test_hot_path_passes_cuda_sync_debug_mode(build):
    with torch.device("cuda"):
        step = build()
        step()
        with cuda_sync_debug_error():
            step()


class _CountSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _SYNCING:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_curvature_product_reads_one_flag_for_edited_weights(device):
    """The check that no weight was edited through ``.data`` since the operator was built
    compares bit patterns: one host read per product (per device), not one per tensor."""
    model = _mlp()
    data = (torch.randn(6, 8), torch.randint(0, 3, (6,)))
    op = curvature.Hessian(model, F.cross_entropy, data)
    v = torch.randn(op.shape[0])
    op @ v
    with _CountSyncs() as counted:
        op @ v
    assert counted.count == 1  # tests/curvature/test_stale.py: what the check catches


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t.sum().item(),
        lambda t: bool(t.sum()),
        lambda t: float(t[0]),
        lambda t: t.tolist(),
        lambda t: t[t > 0],
        lambda t: t.nonzero(),
        lambda t: torch.unique(t),
        lambda t: t.numpy(),
        lambda t: t.repeat_interleave(t.long()),
    ],
)
def test_the_guard_catches_each_kind_of_synchronization(sync):
    t = torch.ones(3)
    with pytest.raises(AssertionError, match="host synchronization"), forbid_host_sync():
        sync(t)


def test_the_guard_lets_device_work_pass():
    t = torch.randn(4, 3)
    with forbid_host_sync():
        out = torch.where(t > 0, t, 0).sum(0).repeat_interleave(2, output_size=6)
    assert out.shape == (6,)

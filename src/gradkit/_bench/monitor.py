"""The ``monitor`` suite: what :class:`gradkit.monitor.GradientMonitor` costs on the steps it
does not track (nothing is installed on them) and on the steps it tracks (``track`` with
``"variance"`` and ``"batch_l2"`` plus the summary), against a plain forward and backward.

Models: an MLP 784-512-256-10 (batch 128, the worst case for the summary: 0.5 M parameters
against a few milliseconds of compute) and a GPT-2 from a small config (4 layers, width 128,
16 sequences of 64 tokens; skipped without ``transformers``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._bench._case import Case, Method, Target
from gradkit.monitor import GradientMonitor

__all__ = ["build_cases"]


def _mlp() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], dict[str, Any]]:
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    setup = {"model": "MLP 784-512-256-10 (ReLU)", "batch": 128, "parameters": 535_818}
    return model, lambda m: F.cross_entropy(m(x), y), setup


def _gpt2() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], dict[str, Any]]:
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 1000, (16, 64))
    setup = {
        "model": "GPT-2 (4 layers, width 128, vocabulary 1000)",
        "batch": "16 sequences of 64 tokens",
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return model, lambda m: m(input_ids=ids, labels=ids).loss, setup


def _case(key: str, make: Callable[..., Any]) -> Case:
    model, loss_of, setup = make()
    monitor = GradientMonitor(model, every=2)

    def plain() -> None:
        loss_of(model).backward()
        model.zero_grad(set_to_none=True)

    def step(index: int) -> Callable[[], None]:
        def run() -> None:
            with monitor.step(index):
                loss_of(model).backward()
            model.zero_grad(set_to_none=True)

        return run

    return Case(
        key=key,
        title=f"GradientMonitor(every=2) on {setup['model']}: untracked and tracked steps",
        setup={**setup, "quantities": "variance, batch_l2", "dtype": "float32"},
        methods=[
            Method("plain", "plain forward + loss.backward()", plain, None),
            Method("untracked", "with monitor.step(): an untracked step", step(1), None),
            Method(
                "tracked", "with monitor.step(): a tracked step (and its record)", step(0), None
            ),
        ],
        baseline=("plain",),
        reference=None,
        dtype=torch.float32,
        targets=[
            Target("untracked step / plain step", "untracked", ("plain",), "<=", 1.03),
            Target("tracked step / plain step", "tracked", ("plain",)),
        ],
        notes=[
            "A tracked step runs per_example.track(model, 'variance', 'batch_l2') and summarizes "
            "the statistics (norm, variance, noise scale, median SNR, norm quantiles; whole model "
            "and per layer); an untracked step installs nothing."
        ],
    )


def build_cases() -> list[Case]:
    """The MLP case, and the GPT-2 case when ``transformers`` is installed."""
    cases = [_case("monitor_mlp", _mlp)]
    if importlib.util.find_spec("transformers") is not None:
        cases.append(_case("monitor_gpt2", _gpt2))
    return cases

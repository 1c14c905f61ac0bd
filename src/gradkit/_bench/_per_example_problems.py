"""The models and batches of the ``per_example`` suite (see :mod:`gradkit._bench.per_example`)
and the wording of its quantities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._bench._models import deepobs_3c3d, gpt2_lm, relu_mlp, seq_linear
from gradkit._digits import load_digits, make_model

__all__ = ["MODELS", "QUANTITIES", "SMOKE_BATCH", "WORDS", "Problem", "make_problem", "quantities"]

MODELS = ("mlp", "seq", "3c3d", "cnn", "gpt2", "compiled")
QUANTITIES = ("variance", "second_moment", "batch_l2", "batch_grad")
# models that run only some quantities ("compiled": the demo CNN under torch.compile, one case)
QUANTITIES_OF = {"gpt2": ("variance", "batch_l2"), "compiled": ("variance_batch_l2",)}
WORDS = {
    "variance": "variance",
    "second_moment": "second moment",
    "batch_l2": "per-example squared norms",
    "batch_grad": "per-example gradients",
}
SMOKE_BATCH = {"mlp": 8, "seq": 4, "3c3d": 4, "cnn": 4, "gpt2": 4, "compiled": 4}


def quantities(key: str) -> tuple[str, ...]:
    """The quantities the suite computes on model ``key``, in report order."""
    return QUANTITIES_OF.get(key, QUANTITIES)


def _positional(f: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = f(x)
    return out


def _logits(f: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM called as its users do: ``f(input_ids=x).logits``."""
    out: torch.Tensor = f(input_ids=x).logits
    return out


@dataclass
class Problem:
    """A model, a batch and its loss; ``reduction`` is how the loss combines the examples.

    ``call(f, x)`` is the output of the model (or of anything called like it, e.g. a wrapper or
    a ``functional_call``) on ``x``.
    """

    key: str
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    reduction: str
    loss_name: str
    call: Callable[[Callable[..., Any], torch.Tensor], torch.Tensor] = _positional
    notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.x.shape[0]

    def loss(self, module: nn.Module) -> torch.Tensor:
        return self.loss_fn(self.call(module, self.x), self.y)

    def setup(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "input": "x".join(str(s) for s in self.x.shape),
            "loss": self.loss_name,
            "dtype": "float32",
        }


def _mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y, reduction="sum")


def _token_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all ``N * T`` tokens of ``logits [N, T, V]`` and ``y [N, T]``:
    the mean over examples of each sequence's mean (every sequence has ``T`` tokens)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


_GPT2_NOTE = (
    "GPT-2 is called as `model(input_ids=x).logits`: the model builds its position ids as "
    "[1, T] and broadcasts them over the batch, so the position embedding is shared by all "
    "examples in one call. Loss: mean cross entropy of the next token over all N * T "
    "positions (tokens drawn uniformly), i.e. the mean over examples of each sequence's mean."
)


def make_problem(key: str, seed: int, batch: int | None = None) -> Problem:
    """The model and data of ``key``, drawn from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    if key == "mlp":
        n = batch or 128
        return Problem(
            key,
            "MLP 784-512-256-10 (ReLU)",
            relu_mlp((784, 512, 256, 10)),
            torch.randn(n, 784),
            torch.randint(0, 10, (n,)),
            F.cross_entropy,
            "mean",
            "cross entropy (mean)",
        )
    if key == "seq":
        n = batch or 32
        return Problem(
            key,
            "Linear 256->256 on sequences of 64, then Flatten",
            seq_linear(256),
            torch.randn(n, 64, 256),
            torch.randn(n, 64 * 256),
            _mse_sum,
            "sum",
            "MSE (sum)",
        )
    if key == "3c3d":
        n = batch or 64
        return Problem(
            key,
            "DeepOBS 3c3d CNN",
            deepobs_3c3d(),
            torch.randn(n, 3, 32, 32),
            torch.randint(0, 10, (n,)),
            F.cross_entropy,
            "mean",
            "cross entropy (mean)",
        )
    if key == "cnn":
        n = batch or 32
        data = load_digits(seed, max_train=n)
        return Problem(
            key,
            "demo CNN (gradkit demo: 2 convolutions, 2 linear layers, 18k parameters) on the "
            "bundled digits",
            make_model(),
            data.x_train,
            data.y_train,
            F.cross_entropy,
            "mean",
            "cross entropy (mean)",
        )
    if key == "gpt2":
        n, length, vocab = batch or 16, 64, 1536
        model = gpt2_lm(vocab_size=vocab, n_positions=length)
        tokens = torch.randint(0, vocab, (n, length + 1))
        return Problem(
            key,
            "GPT-2 (Hugging Face GPT2LMHeadModel, 4 layers, width 128, 4 heads, vocabulary "
            f"{vocab}, tied head) on token ids of length {length}",
            model,
            tokens[:, :-1],
            tokens[:, 1:],
            _token_cross_entropy,
            "mean",
            "next-token cross entropy (mean over tokens)",
            call=_logits,
            notes=[_GPT2_NOTE],
        )
    raise ValueError(f"per_example suite: key: expected one of {MODELS}, got {key!r}")

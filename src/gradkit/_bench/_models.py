"""Models shared by the benchmark suites, and the process warm-up that runs before them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jacfwd, jacrev, vmap

import gradkit.func as gf

__all__ = [
    "apply_mlp",
    "deepobs_3c3d",
    "gpt2_lm",
    "mlp",
    "mlp_name",
    "relu_mlp",
    "seq_linear",
    "warm_up",
]


def mlp(sizes: Sequence[int], dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear`` layers of the given widths with ``tanh`` between them (none at the end)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers).to(dtype)


def relu_mlp(sizes: Sequence[int]) -> nn.Sequential:
    """``Linear`` layers of the given widths with ``ReLU`` between them (none at the end)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def seq_linear(features: int) -> nn.Sequential:
    """``Linear(features, features)`` applied position-wise to ``[N, T, features]``, then
    ``Flatten``: ``[N, T * features]``."""
    return nn.Sequential(nn.Linear(features, features), nn.Flatten())


def deepobs_3c3d(num_classes: int = 10) -> nn.Sequential:
    """The DeepOBS 3c3d CNN for ``[N, 3, 32, 32]`` inputs: conv 5x5 (64) -> conv 3x3 (96) ->
    conv 3x3 (128, padding 1), each followed by ReLU and max-pooling 3/2 (padding 1), then
    dense 1152-512-256-``num_classes`` with ReLUs."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(64, 96, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(),
        nn.Linear(1152, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def gpt2_lm(
    vocab_size: int = 1536,
    n_positions: int = 64,
    n_embd: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
) -> nn.Module:
    """A Hugging Face ``GPT2LMHeadModel`` built from a small ``GPT2Config`` (no download), with
    every dropout off; with the defaults about 1.0M parameters.

    It maps token ids ``[N, T]`` (``T <= n_positions``) to ``.logits`` ``[N, T, vocab_size]``.
    The head's weight is the token embedding's (tied), and the model builds the position ids
    itself as ``[1, T]``, broadcast over the batch. ``transformers`` is imported here, so that
    it is needed only by whoever builds this model: ImportError when it is not installed.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
    )
    model: nn.Module = GPT2LMHeadModel(config)
    return model


def mlp_name(sizes: Sequence[int]) -> str:
    return "MLP " + "-".join(str(s) for s in sizes) + " (tanh)"


def apply_mlp(params: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The ``mlp`` forward pass as a pure function of its ``(weight, bias, ...)`` tuple."""
    h = x
    for i in range(0, len(params), 2):
        if i:
            h = torch.tanh(h)
        h = F.linear(h, params[i], params[i + 1])
    return h


def warm_up() -> None:
    """First use of torch.func, forward AD and double backward in this process (lazy imports
    and initialization), so that no case pays for it in its first call."""
    x = torch.randn(3, 2)

    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t @ x.T)

    def s(t: torch.Tensor) -> torch.Tensor:
        return f(t).pow(2).sum()

    t = torch.randn(2)
    gf.jacobian(f, t, mode="forward")
    gf.jacobian(f, t, mode="reverse")
    gf.batch_jacobian(f, x, mode="forward")
    gf.batch_jacobian(f, x, mode="reverse")
    jacrev(f)(t)
    jacfwd(f)(t)
    vmap(jacrev(f))(x)
    vmap(jacfwd(f))(x)
    gf.hessian(s, t)
    torch.func.hessian(s)(t)
    gf.hvp(s, t, t)
    gf.hvp_operator(s, t) @ torch.eye(2)
    torch.func.jvp(torch.func.grad(s), (t,), (t,))
    torch.autograd.functional.hvp(s, t, t)

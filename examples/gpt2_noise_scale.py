"""Gradient noise scale of a GPT-2 while it trains, from per-example statistics.

A small Hugging Face GPT-2 (built from a config: no download) learns a toy language of noisy
counting sequences. Every ``--every`` steps, ``gradkit.per_example.track`` reads the variance and
per-example norms of every parameter inside the ordinary backward passes of the step's
micro-batches (merged exactly), and the step prints the simple noise scale
``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018): the batch size beyond which larger
batches stop paying off. The learned position embedding, which the model broadcasts over the
batch (``position_ids`` of shape ``[1, T]``), gets its per-example gradients like every other
parameter.

Run: ``python examples/gpt2_noise_scale.py --steps 40`` (needs ``pip install "gradkit[hf]"``).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import gradkit


def toy_batch(n: int, length: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Sequences ``start, start + step, ...`` modulo ``vocab``, one token in ten replaced."""
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(length)) % vocab
    noise = torch.rand(n, length, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (n, length), generator=g), ids)


def next_token_losses(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """``[N]``: each sequence's mean next-token cross entropy."""
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="track one step in this many")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import transformers

    torch.manual_seed(args.seed)
    vocab, length = 24, 16
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=length, vocab_size=vocab,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    acc = gradkit.accumulate.Accumulator(model, optimizer)  # mean over the window's examples
    g = torch.Generator().manual_seed(args.seed)
    history: list[dict[str, float]] = []
    losses: list[float] = []
    for step in range(args.steps):
        ids = toy_batch(args.batch, length, vocab, g)
        tracked = step % args.every == 0
        # micro-steps backpropagate SUMS of per-example losses: the tracker is told so, and
        # the accumulator divides once by the window's count
        watch = gradkit.per_example.track(model, "variance", "batch_l2", loss_reduction="sum")
        with watch if tracked else contextlib.nullcontext() as stats:
            for part in acc.split(ids, num_micro_batches=args.micro_batches):
                with acc.micro_step(count=len(part)):
                    acc.backward(next_token_losses(model, part).sum())
        acc.step()
        if stats is not None:
            norms = stats.batch_l2().sqrt()
            row = {
                "step": float(step),
                "noise_scale": float(gradkit.per_example.noise_scale(stats)),
                "median_norm": float(norms.median()),
                "max_norm": float(norms.max()),
                "positions_examples": float(stats["transformer.wpe.weight"].num_examples),
            }
            history.append(row)
            print(
                f"step {step:3d}  noise scale {row['noise_scale']:8.1f}  per-example grad norm "
                f"median {row['median_norm']:.3f} max {row['max_norm']:.3f}"
            )
        with torch.no_grad():
            losses.append(float(next_token_losses(model, ids).mean()))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"history": history, "first_loss": losses[0], "last_loss": losses[-1]}


if __name__ == "__main__":
    main()

"""Exact gradient accumulation and per-example statistics on a model sharded with FSDP2.

Run on two CPU processes (gloo), or on GPUs with ``--backend nccl``::

    torchrun --nproc_per_node=2 examples/fsdp_accumulate.py
    torchrun --nproc_per_node=8 examples/fsdp_accumulate.py --backend nccl

Each rank holds its own micro-batches of token sequences with padding (labels -100). The
accumulator divides by the window's valid tokens over all ranks, FSDP reduce-scatters the
gradient shards once per window (in the last micro-step's backward), and the clipped step is
the one a single process would take on the whole window. Every few windows, the per-example
gradient statistics of a window (noise scale, SNR) are taken across the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradkit import per_example
from gradkit.accumulate import Accumulator

VOCAB, WIDTH, LENGTH = 50, 32, 12


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, VOCAB)
    )


def batch(rank: int, window: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of ``size`` examples of this rank and window, padded after a random length."""
    g = torch.Generator().manual_seed(1000 * window + rank)
    tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=g)
    labels = tokens.roll(-1, dims=1)
    lengths = torch.randint(2, LENGTH + 1, (size,), generator=g)
    labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
    return tokens, labels


def token_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The SUM of the valid tokens' losses (the accumulator divides once, by their count)."""
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for each rank's rank<r>.json")
    args = parser.parse_args(argv)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    model = make_model().to(device)
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, opt, normalize="tokens", max_grad_norm=1.0)
    history = []
    for window in range(args.windows):
        tokens, labels = (t.to(device) for t in batch(rank, window, 4 * args.micro_batches))
        tracked = window % 2 == 1  # the statistics of every other window
        with contextlib.ExitStack() as scope:
            stats = (
                scope.enter_context(per_example.track(model, "variance", loss_reduction="sum"))
                if tracked
                else None
            )
            for t, lab in acc.split((tokens, labels), num_micro_batches=args.micro_batches):
                with acc.micro_step(count=(lab != -100).sum()):
                    acc.backward(token_loss(model, t, lab))
        result = acc.step()
        row: dict[str, Any] = {"window": window, "tokens": result.count, "norm": result.grad_norm}
        if stats is not None:
            stats.all_reduce()  # every rank's examples: the statistics of the global batch
            row["noise_scale"] = per_example.noise_scale(stats)
        history.append(row)
        if rank == 0:
            print(row, flush=True)
    if args.out is not None:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(history, f)
    dist.barrier()
    dist.destroy_process_group()
    return {"history": history}


if __name__ == "__main__":
    main()

"""Worker for test_distributed.py, started as a separate process per rank (like torchrun)."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track


def data():
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    return x, torch.randn(7, 2, generator=g, dtype=torch.float64)


def model():
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def raises(f) -> str:
    """The message of the GradkitError ``f()`` raises ("" if none)."""
    try:
        f()
    except GradkitError as err:
        return str(err)
    return ""


def misuse(out_dir: str) -> None:
    """Rank 1 sees no example; a second all_reduce; ranks tracking different quantities."""
    rank = dist.get_rank()
    x, y = data()
    lo, hi = (0, 3) if rank == 0 else (3, 3)
    net = model()
    with track(net, "variance", "batch_l2", loss_reduction="sum") as stats:
        ((net(x[lo:hi]) - y[lo:hi]) ** 2).sum(1).sum().backward()
    stats.all_reduce()
    again = raises(stats.all_reduce)
    quantities = ("variance",) if rank == 0 else ("variance", "batch_l2")
    with track(net, *quantities) as other:
        ((net(x) - y) ** 2).sum(1).mean().backward()
    differ = raises(other.all_reduce)
    s = stats["weight"]
    result = {"n": stats.num_examples, "var": s.variance, "l2": s.batch_l2}
    torch.save({**result, "again": again, "differ": differ}, f"{out_dir}/misuse{rank}.pt")


def main(out_dir: str, mode: str = "exact") -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from env
    if mode == "misuse":
        try:
            misuse(out_dir)
        finally:
            dist.destroy_process_group()
        return
    try:
        rank = dist.get_rank()
        x, y = data()
        lo, hi = (0, 3) if rank == 0 else (3, 7)  # unequal shards
        net = model()
        with track(net, "variance", "batch_l2", "batch_grad", moments=(3,)) as stats:
            ((net(x[lo:hi]) - y[lo:hi]) ** 2).sum(1).mean().backward()
        stats.all_reduce()
        s = stats["weight"]
        torch.save(
            {
                "n": stats.num_examples,
                "var": s.variance,
                "m3": s.moment(3),
                "l2": s.batch_l2,
                "grads": s.batch_grad,
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # results are saved; skip the interpreter's teardown, where gloo's threads sometimes abort
    # the process ("terminate called without an active exception") after all work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

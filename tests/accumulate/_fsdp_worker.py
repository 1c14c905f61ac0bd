"""Worker for test_fsdp.py: one process per rank (RANK, WORLD_SIZE, MASTER_* from the env).

``python _fsdp_worker.py OUT_DIR MODE NORMALIZE CLIP``:

* MODE ``split`` / ``marked`` / ``unmarked``: an FSDP2 model (``fully_shard`` on the embedding,
  the linear layer and the root; the linear layer's 7 rows shard unevenly, 4 and 3) trained
  by an ``Accumulator`` over two windows of micro-batches of unequal sizes per rank:
  micro-batches from ``acc.split`` (the last one known), given with ``micro_step(count,
  last=...)``, or given without ``last`` (FSDP then reduce-scatters in every micro-step).
  NORMALIZE ``examples`` or ``tokens``; CLIP a max gradient norm or ``none``.
* MODE ``track``: the same FSDP2 model under ``per_example.track(model, "variance",
  "batch_l2")`` over three micro-batches, then ``stats.all_reduce()``.
* MODE ``fsdp1``: the model wrapped in FSDP1 (``FullyShardedDataParallel``,
  ``use_orig_params=True``): ``Accumulator(...)`` and ``track(...)`` must refuse; and an FSDP2
  model with a ``GradScaler``.

Results are written with ``torch.save`` before the process ends, and the process ends with
``os._exit(0)``: FSDP2 on gloo sometimes aborts at interpreter exit after all work is done.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError, per_example
from gradkit.accumulate import Accumulator

LR, MOMENTUM, CLASSES = 0.1, 0.9, 7

# rows of the data set per window, per rank, per micro-batch: (start, stop); FSDP runs every
# forward and backward on all ranks together, so each rank runs as many micro-steps
WINDOWS = [
    {0: [(0, 2), (2, 3), (3, 5)], 1: [(5, 8), (8, 9), (9, 10)]},
    {0: [(10, 12), (12, 14)], 1: [(14, 15), (15, 18)]},
]
TRACKED = {0: [(0, 1), (1, 4), (4, 6)], 1: [(6, 9), (9, 10), (10, 12)]}


def data():
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    tokens = torch.randint(1, 10, (18, 6), generator=g)
    labels = torch.randint(0, CLASSES, (18, 6), generator=g)
    lengths = torch.tensor([1, 6, 2, 5, 3, 6, 6, 4, 1, 2, 3, 5, 1, 6, 2, 4, 6, 1])
    labels[torch.arange(6)[None, :] >= lengths[:, None]] = -100
    return tokens, labels


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 5), nn.Tanh(), nn.Linear(5, CLASSES)).double()


def token_sum(m, t, lab):
    return F.cross_entropy(
        m(t).reshape(-1, CLASSES), lab.reshape(-1), ignore_index=-100, reduction="sum"
    )


def count_of(normalize, lab):
    return lab.shape[0] if normalize == "examples" else int((lab != -100).sum())


def sharded(net):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def full(t):
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def accumulate(mode, normalize, clip):
    rank = dist.get_rank()
    tokens, labels = data()
    net = sharded(model())
    seen = []
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    opt.register_step_pre_hook(lambda *_: seen.append([full(p.grad) for p in net.parameters()]))
    acc = Accumulator(
        net, opt, normalize=normalize, max_grad_norm=None if clip == "none" else float(clip)
    )
    reduces = []
    plain_all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        reduces.append(tensor.numel())
        return plain_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    windows = []
    for window in WINDOWS:
        reduces.clear()
        mine = window[rank]
        if mode == "split" and normalize == "examples":
            lo, hi = mine[0][0], mine[-1][1]
            parts = acc.split((tokens[lo:hi], labels[lo:hi]), num_micro_batches=len(mine))
            for t, lab in parts:
                with acc.micro_step():
                    acc.backward(token_sum(net, t, lab))
        else:
            for i, (lo, hi) in enumerate(mine):
                t, lab = tokens[lo:hi], labels[lo:hi]
                last = (i == len(mine) - 1) if mode in ("marked", "split") else None
                with acc.micro_step(count=count_of(normalize, lab), last=last):
                    acc.backward(token_sum(net, t, lab))
        result = acc.step()
        windows.append(
            {
                "grads": seen[-1],
                "params": [full(p) for p in net.parameters()],
                "count": result.count,
                "micro_steps": result.micro_steps,
                "stepped": result.stepped,
                "grad_norm": result.grad_norm,
                "reduces": list(reduces),
            }
        )
    dist.all_reduce = plain_all_reduce
    return {"windows": windows}


def tracked():
    rank = dist.get_rank()
    tokens, labels = data()
    net = sharded(model())
    with per_example.track(net, "variance", "batch_l2", loss_reduction="sum") as stats:
        for lo, hi in TRACKED[rank]:
            token_sum(net, tokens[lo:hi], labels[lo:hi]).backward()
    stats.all_reduce()
    return {
        "variance": {name: full(s.variance) for name, s in stats.items()},
        "mean": {name: full(s.mean) for name, s in stats.items()},
        "n": stats.num_examples,
    }


def refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    net = FullyShardedDataParallel(model(), use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    out = {}
    for key, make in (
        ("accumulator", lambda: Accumulator(net, opt)),
        ("track", lambda: per_example.track(net, "variance").__enter__()),
    ):
        try:
            make()
            out[key] = ""
        except GradkitError as err:
            out[key] = str(err)
    sharded_net = sharded(model())
    scaler = torch.amp.GradScaler("cpu")
    try:
        Accumulator(sharded_net, torch.optim.SGD(sharded_net.parameters(), lr=LR), scaler=scaler)
        out["scaler"] = ""
    except GradkitError as err:
        out["scaler"] = str(err)
    return out


def main(out_dir: str, mode: str, normalize: str, clip: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    if mode == "track":
        result = tracked()
    elif mode == "fsdp1":
        result = refused()
    else:
        result = accumulate(mode, normalize, clip)
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:5])

"""Worker for test_ddp.py: one process per rank (RANK, WORLD_SIZE, MASTER_* from the env).

``python _ddp_worker.py OUT_DIR MODE NORMALIZE`` with MODE ``ddp`` (a DistributedDataParallel
model), ``compiled`` (``torch.compile`` of it) or ``plain`` (the bare model over the process
group) and NORMALIZE ``examples`` or
``tokens``. Three windows, float64, with unequal numbers of micro-steps per rank (3 and 2; an
empty micro-batch; none at all on rank 1), then a forward outside the micro-step block.
Every ``torch.distributed.all_reduce`` call and every DDP bucket reduction is counted.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.accumulate import Accumulator

LR, MOMENTUM = 0.1, 0.9

# rows of the data set per window, per rank, per micro-batch: (start, stop)
WINDOWS = [
    {0: [(0, 2), (2, 3), (3, 5)], 1: [(5, 8), (8, 10)]},  # 3 and 2 micro-steps
    {0: [(10, 12), (12, 12), (12, 14)], 1: [(14, 15)]},  # an empty micro-batch
    {0: [(15, 18)], 1: []},  # rank 1 has nothing in this window
]


def data():
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    tokens = torch.randint(1, 10, (18, 6), generator=g)
    labels = torch.randint(0, 10, (18, 6), generator=g)
    lengths = torch.tensor([1, 6, 2, 5, 3, 6, 6, 4, 1, 2, 3, 5, 1, 6, 2, 4, 6, 1])
    labels[torch.arange(6)[None, :] >= lengths[:, None]] = -100
    return tokens, labels


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 5), nn.Tanh(), nn.Linear(5, 10)).double()


def token_sum(m, t, lab):
    return F.cross_entropy(
        m(t).reshape(-1, 10), lab.reshape(-1), ignore_index=-100, reduction="sum"
    )


def count_of(normalize, lab):
    return lab.shape[0] if normalize == "examples" else int((lab != -100).sum())


def main(out_dir: str, mode: str, normalize: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        rank = dist.get_rank()
        tokens, labels = data()
        net = model()
        hook_calls = []
        if mode in ("ddp", "compiled"):
            net = nn.parallel.DistributedDataParallel(net)

            def hook(state, bucket):
                hook_calls.append(1)
                fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0] / dist.get_world_size())

            net.register_comm_hook(None, hook)
            if mode == "compiled":
                net = torch.compile(net, backend="eager")
        seen = []
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        opt.register_step_pre_hook(
            lambda *_: seen.append([p.grad.clone() for p in net.parameters()])
        )
        acc = Accumulator(net, opt, normalize=normalize)
        reduces = []
        plain_all_reduce = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            reduces.append(tensor.numel())
            return plain_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counted
        windows = []
        for w, window in enumerate(WINDOWS):
            reduces.clear()
            mine = window[rank]
            if w == 0 and normalize == "examples":  # split() counts the examples
                lo, hi = mine[0][0], mine[-1][1]
                size = 2 if rank == 0 else 3
                for t, lab in acc.split((tokens[lo:hi], labels[lo:hi]), micro_batch_size=size):
                    with acc.micro_step():
                        acc.backward(token_sum(net, t, lab))
            else:
                for lo, hi in mine:
                    t, lab = tokens[lo:hi], labels[lo:hi]
                    with acc.micro_step(count=count_of(normalize, lab)):
                        acc.backward(token_sum(net, t, lab))
            result = acc.step()
            windows.append(
                {
                    "grads": seen[-1],
                    "params": [p.detach().clone() for p in net.parameters()],
                    "count": result.count,
                    "micro_steps": result.micro_steps,
                    "stepped": result.stepped,
                    "reduces": list(reduces),
                }
            )
        outside = ""
        if mode in ("ddp", "compiled"):
            out = token_sum(net, tokens[:2], labels[:2])  # forward outside the block
            try:
                with acc.micro_step(count=count_of(normalize, labels[:2])):
                    acc.backward(out)
            except GradkitError as err:
                outside = str(err)
        torch.save(
            {
                "windows": windows,
                "hook_calls": len(hook_calls),
                "outside": outside,
                "param_numel": sum(p.numel() for p in net.parameters()),
                "num_params": len(list(net.parameters())),
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # results are saved; skip the interpreter's teardown, where gloo's threads sometimes abort
    # the process ("terminate called without an active exception") after all work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Worker for test_ddp.py: one process per rank (RANK, WORLD_SIZE, MASTER_* from the env)."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradkit.accumulate import Accumulator


def data():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 10, (10, 6), generator=g)
    labels = torch.randint(0, 10, (10, 6), generator=g)
    lengths = torch.tensor([1, 6, 2, 5, 3, 6, 6, 4, 1, 2])
    labels[torch.arange(6)[None, :] >= lengths[:, None]] = -100
    return tokens, labels


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 5), nn.Tanh(), nn.Linear(5, 10))


def token_sum(m, t, lab):
    return F.cross_entropy(
        m(t).reshape(-1, 10), lab.reshape(-1), ignore_index=-100, reduction="sum"
    )


class Capture(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def main(out_dir: str, mode: str) -> None:
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        tokens, labels = data()
        mine = slice(0, 3) if rank == 0 else slice(3, 10)  # unequal shards and token counts
        net = model()
        calls = []
        if mode == "ddp":
            net = nn.parallel.DistributedDataParallel(net)

            def hook(state, bucket):
                calls.append(1)
                fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0] / dist.get_world_size())

            net.register_comm_hook(None, hook)
        opt = Capture(net.parameters())
        acc = Accumulator(net, opt, normalize="tokens")
        for t, lab in acc.split((tokens[mine], labels[mine]), micro_batch_size=2):
            with acc.micro_step(count=int((lab != -100).sum())):
                acc.backward(token_sum(net, t, lab))
        result = acc.step()
        torch.save(
            {
                "grads": opt.seen[0],
                "count": result.count,
                "comm_calls": len(calls),
                "micro_steps": result.micro_steps,
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

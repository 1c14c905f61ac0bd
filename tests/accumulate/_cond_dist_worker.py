"""Worker for test_conditional_dist.py: one process per gloo rank (started like torchrun).

Runs the scenarios in order on one process group and writes what each rank saw to
``<out_dir>/rank<r>.json``. The last scenario (a rank that never calls take_grad) leaves the
group unusable, so the process exits right after it.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from gradkit.accumulate import DistributedConditionalAccumulator


def attempt(fn: Any) -> dict[str, Any]:
    """Run ``fn``; return its value or the error's type and message."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err), "s": time.monotonic() - start}
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return {"value": value, "s": time.monotonic() - start}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    done = pathlib.Path(out_dir) / f"rank{rank}.json"
    acc = DistributedConditionalAccumulator((2,), torch.float64, timeout=20.0)

    # case 29: one gradient per rank; take_grad(world_size) returns the all-reduce mean
    local = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)
    acc.apply_grad(local, local_step=0)
    reference = local.clone()
    dist.all_reduce(reference)
    out["case29"] = attempt(lambda: acc.take_grad(2))
    out["case29_reference"] = (reference / 2).tolist()
    out["case29_step"] = acc.global_step

    # case 30: a stale gradient on rank 1 is dropped there; nobody counts it
    if rank == 1:
        out["case30_stale_accepted"] = acc.apply_grad(torch.full((2,), 1000.0), local_step=0)
    acc.apply_grad(torch.full((2,), 2.0 + rank, dtype=torch.float64), local_step=1)
    out["case30"] = attempt(lambda: acc.take_grad(2))
    out["case30_dropped"] = acc.num_dropped
    out["case30_step"] = acc.global_step

    # uneven: rank 0 applies two gradients, rank 1 one; the mean is over all three
    for v in [1.0, 2.0] if rank == 0 else [6.0]:
        acc.apply_grad(torch.full((2,), v, dtype=torch.float64), local_step=2)
    out["uneven"] = attempt(lambda: acc.take_grad(2))

    # case 31: rank 1 never applies -> both ranks time out, nothing consumed, group usable
    if rank == 0:
        acc.apply_grad(torch.full((2,), 4.0, dtype=torch.float64), local_step=3)
    out["case31"] = attempt(lambda: acc.take_grad(2, timeout=1.0))
    out["case31_after"] = [acc.num_accumulated, acc.global_step]
    if rank == 1:
        acc.apply_grad(torch.full((2,), 8.0, dtype=torch.float64), local_step=3)
    out["case31_recovered"] = attempt(lambda: acc.take_grad(2))

    # a take that waits while rank 1's gradient arrives from another thread
    acc.apply_grad(torch.full((2,), 1.0, dtype=torch.float64), local_step=4)
    if rank == 1:
        late = torch.full((2,), 3.0, dtype=torch.float64)
        threading.Timer(0.3, lambda: acc.apply_grad(late, local_step=4)).start()
    out["blocking"] = attempt(lambda: acc.take_grad(3, timeout=10.0))

    # mismatched num_required and global steps raise on every rank alike
    out["mismatch_required"] = attempt(lambda: acc.take_grad(1 + rank, timeout=5.0))
    other = DistributedConditionalAccumulator((2,), torch.float64, timeout=5.0)
    if rank == 1:
        other.set_global_step(5)
    out["mismatch_step"] = attempt(lambda: other.take_grad(1))

    # close on one rank: every rank's take raises AccumulatorClosed, nobody hangs
    closing = DistributedConditionalAccumulator((2,), torch.float64, timeout=5.0)
    closing.apply_grad(torch.ones(2, dtype=torch.float64), local_step=0)
    if rank == 1:
        closing.close()
    out["closed"] = attempt(lambda: closing.take_grad(1))
    out["closed_after"] = closing.num_accumulated

    # case 31, absent rank: rank 1 never calls take_grad; rank 0 fails after its timeout
    absent = DistributedConditionalAccumulator((2,), torch.float64, timeout=1.0)
    if rank == 0:
        absent.apply_grad(torch.ones(2, dtype=torch.float64), local_step=0)
        out["absent"] = attempt(lambda: absent.take_grad(2))
        done.write_text(json.dumps(out))
    else:
        done.write_text(json.dumps(out))
        peer = pathlib.Path(out_dir) / "rank0.json"
        deadline = time.monotonic() + 60
        while not peer.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # the group is broken by the absent-rank scenario: do not tear it down


if __name__ == "__main__":
    main(sys.argv[1])

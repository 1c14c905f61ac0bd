"""Tracker.all_reduce over torch.distributed (gloo, 2 ranks on CPU, one process each): merging
ranks equals one pass over all their examples."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradkit.testing import per_example_grads

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
WORKER = pathlib.Path(__file__).with_name("_dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_all_reduce_equals_one_pass_over_all_ranks(tmp_path):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = torch.randn(7, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)["weight"]
    for r in results:
        assert r["n"] == 7
        torch.testing.assert_close(r["var"], ref.var(0, unbiased=False), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["m3"], (ref**3).mean(0), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["l2"], ref.flatten(1).square().sum(1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["grads"], ref, rtol=1e-10, atol=1e-12)

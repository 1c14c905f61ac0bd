"""Tracker.all_reduce over torch.distributed (gloo, 2 ranks on CPU, one process each): merging
ranks equals one pass over all their examples."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradkit.testing import per_example_grads, run_ranks

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.cpu_only,  # gloo worker processes
]
WORKER = pathlib.Path(__file__).with_name("_dist_worker.py")


def test_all_reduce_equals_one_pass_over_all_ranks(tmp_path):
    run_ranks(WORKER, [str(tmp_path)])
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
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


def test_all_reduce_misuses(tmp_path):
    """A rank without examples adds nothing; a second all_reduce and ranks that track
    different quantities raise a GradkitError on every rank instead of double counting or
    hanging."""
    run_ranks(WORKER, [str(tmp_path), "misuse"])
    results = [torch.load(tmp_path / f"misuse{r}.pt", weights_only=True) for r in range(2)]
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = torch.randn(7, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x[:3], y[:3])["weight"]
    for r in results:
        assert r["n"] == 3
        torch.testing.assert_close(r["var"], ref.var(0, unbiased=False), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["l2"], ref.flatten(1).square().sum(1), rtol=1e-10, atol=0.0)
        assert "once per track block" in r["again"], r["again"]
        assert "same tracked parameters" in r["differ"], r["differ"]

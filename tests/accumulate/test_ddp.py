"""Accumulation on 2 gloo ranks (one process each) with different token counts equals the
single-process full-batch gradient; DDP all-reduces once per window."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist

from gradkit.testing import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
WORKER = pathlib.Path(__file__).with_name("_ddp_worker.py")


def launch(tmp_path, mode: str) -> list[dict]:
    run_ranks(WORKER, [str(tmp_path), mode])
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def reference():
    spec = importlib.util.spec_from_file_location("_ddp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    tokens, labels = w.data()
    net = w.model()
    loss = w.token_sum(net, tokens, labels) / (labels != -100).sum()
    return [g.detach() for g in torch.autograd.grad(loss, list(net.parameters()))], int(
        (labels != -100).sum()
    )


@pytest.mark.parametrize("mode", ["ddp", "plain"])
def test_two_ranks_equal_full_batch(tmp_path, mode):
    results = launch(tmp_path, mode)
    want, total = reference()
    for r in results:
        assert r["count"] == total
        for got, ref in zip(r["grads"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    if mode == "ddp":
        # rank 0 has 2 micro-steps, rank 1 has 4: DDP all-reduced only in the last one
        assert [r["micro_steps"] for r in results] == [2, 4]
        assert results[0]["comm_calls"] == results[1]["comm_calls"] == 1

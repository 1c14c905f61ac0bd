"""Accumulation on 2 gloo ranks (one process each) with unequal numbers of micro-steps per
rank equals the single-process full-batch step, with exactly one all-reduce of the gradients
per step (and one of the count), and never hangs (short timeouts)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist

from gradkit.testing import run_ranks

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.cpu_only,  # gloo worker processes
]
WORKER = pathlib.Path(__file__).with_name("_ddp_worker.py")


def worker_module():
    spec = importlib.util.spec_from_file_location("_ddp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    return w


def launch(tmp_path, mode: str, normalize: str) -> list[dict]:
    run_ranks(WORKER, [str(tmp_path), mode, normalize], timeout=90.0)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def reference(normalize: str) -> list[dict]:
    """One process, the whole window's batch at once: loss = (sum of the window's losses) / N."""
    w = worker_module()
    tokens, labels = w.data()
    net = w.model()
    opt = torch.optim.SGD(net.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    out = []
    for window in w.WINDOWS:
        rows = [r for pieces in window.values() for lo, hi in pieces for r in range(lo, hi)]
        t, lab = tokens[rows], labels[rows]
        n = w.count_of(normalize, lab)
        opt.zero_grad()
        (w.token_sum(net, t, lab) / n).backward()
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        out.append({"grads": grads, "params": [p.detach().clone() for p in net.parameters()]})
        out[-1]["count"] = float(n)
    return out


@pytest.mark.parametrize(
    ("mode", "normalize"),
    [
        ("ddp", "examples"),
        ("ddp", "tokens"),
        ("plain", "examples"),
        ("plain", "tokens"),
        ("compiled", "tokens"),  # torch.compile(DDP(model)): its DDP is found and not synced
    ],
)
def test_unequal_micro_steps_per_rank_give_the_full_batch_step(tmp_path, mode, normalize):
    ranks = launch(tmp_path, mode, normalize)
    want = reference(normalize)
    for r in ranks:
        assert len(r["windows"]) == len(want)
        for got, ref in zip(r["windows"], want, strict=True):
            assert got["stepped"] and got["count"] == ref["count"]
            for key in ("grads", "params"):
                for a, b in zip(got[key], ref[key], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # every rank took the same step, bit for bit
    for a, b in zip(ranks[0]["windows"], ranks[1]["windows"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert [r["windows"][0]["micro_steps"] for r in ranks] == [3, 2]
    assert [r["windows"][2]["micro_steps"] for r in ranks] == [1, 0]
    # per step: one all-reduce of the count (and flags), one of all the gradients; no other
    numel, nparams = ranks[0]["param_numel"], ranks[0]["num_params"]
    for r in ranks:
        for window in r["windows"]:
            assert window["reduces"] == [4 + nparams, numel]
        assert r["hook_calls"] == 0  # DDP itself never reduced
    if mode != "plain":
        assert all("ran outside `with acc.micro_step" in r["outside"] for r in ranks)

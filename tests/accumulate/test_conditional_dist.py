"""DistributedConditionalAccumulator: reference cases 29-31 on 2 gloo ranks (one process each,
run once per module), plus in-process checks on a one-rank group."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest
import torch
import torch.distributed as dist

from gradkit.accumulate import (
    DistributedConditionalAccumulator,
    TakeTimeout,
)
from gradkit.testing import run_ranks

from ._cond_helpers import Background

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.cpu_only,  # gloo worker processes
]
WORKER = pathlib.Path(__file__).with_name("_cond_dist_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cond_dist")
    run_ranks(WORKER, [str(out)], timeout=120.0)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_case29_same_mean_on_every_rank(ranks):
    for r in ranks:
        assert r["case29"]["value"] == r["case29_reference"] == [1.5, 15.0]
        assert r["case29_step"] == 1


def test_case30_stale_gradient_dropped_everywhere(ranks):
    assert ranks[1]["case30_stale_accepted"] is False
    for r in ranks:
        assert r["case30"]["value"] == [2.5, 2.5]  # (2 + 3) / 2: the 1000s never counted
        assert r["case30_step"] == 2
    assert [r["case30_dropped"] for r in ranks] == [0, 1]


def test_mean_over_all_gradients_of_all_ranks(ranks):
    for r in ranks:
        assert r["uneven"]["value"] == [3.0, 3.0]  # (1 + 2 + 6) / 3


def test_case31_rank_without_gradient_times_out_everywhere(ranks):
    for r in ranks:
        res = r["case31"]
        assert res["error"] == "TakeTimeout"
        assert (
            "waiting for 2 gradient(s) over 2 ranks; 1 arrived (rank 0: 1, rank 1: 0)"
            in (res["message"])
        )
        assert 0.9 < res["s"] < 5.0
    assert [r["case31_after"] for r in ranks] == [[1, 3], [0, 3]]  # nothing consumed
    for r in ranks:
        assert r["case31_recovered"]["value"] == [6.0, 6.0]  # the group is still usable


def test_case31_rank_that_never_calls_take_fails_the_take(ranks):
    res = ranks[0]["absent"]
    assert res["error"] == "TakeTimeout"
    assert "not every rank reached take_grad within 1 s" in res["message"]
    assert "Ranks 1 failed to pass monitoredBarrier" in res["message"]
    assert res["s"] < 5.0


def test_take_waits_for_a_late_gradient(ranks):
    for r in ranks:
        assert r["blocking"]["value"] == [5.0 / 3, 5.0 / 3]
    assert ranks[1]["blocking"]["s"] >= 0.25


def test_inconsistent_calls_raise_on_every_rank(ranks):
    for r in ranks:
        assert r["mismatch_required"]["error"] == "ValueError"
        assert (
            "num_required: expected the same value on every rank, got [1, 2]"
            in (r["mismatch_required"]["message"])
        )
        assert r["mismatch_step"]["error"] == "RuntimeError"
        assert "the global steps differ across ranks ([0, 5]" in r["mismatch_step"]["message"]
        assert r["closed"]["error"] == "AccumulatorClosed"
        assert "closed on rank(s) [1]; nothing was consumed" in r["closed"]["message"]
        assert r["closed_after"] == 1


# ------------------------------------------------------------------ one rank, in process
@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_take_and_timeout(one_rank):
    acc = DistributedConditionalAccumulator((2,), reduction="sum", timeout=5.0)
    assert acc.world_size == 1
    acc.apply_grad(torch.ones(2), 0)
    acc.apply_grad(torch.ones(2), 0)
    assert acc.take_grad(1).tolist() == [2.0, 2.0]
    with pytest.raises(TakeTimeout, match=r"take_grad\(num_required=1\): timed out after 0.05 s"):
        acc.take_grad(1, timeout=0.05)
    assert acc.num_accumulated == 0 and acc.global_step == 1


def test_one_rank_take_waits_for_another_thread(one_rank):
    acc = DistributedConditionalAccumulator((1,), timeout=5.0)
    taker = Background(acc.take_grad, 2)
    timer = threading.Timer(0.05, lambda: [acc.apply_grad(torch.ones(1) * v, 0) for v in (1, 3)])
    timer.start()
    assert taker.result().tolist() == [2.0]
    timer.join(5)


def test_shape_must_be_known():
    with pytest.raises(ValueError, match=r"shape: expected a fully known shape .*got \(\?, 2\)"):
        DistributedConditionalAccumulator((None, 2))


def test_requires_initialized_group():
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    with pytest.raises(
        RuntimeError,
        match=r"torch.distributed is not initialized; call "
        r"torch.distributed.init_process_group first",
    ):
        DistributedConditionalAccumulator((2,))


def test_an_nccl_group_needs_a_cuda_device(monkeypatch):
    """The default device="cpu" cannot work under NCCL (its collectives take CUDA tensors): the
    first take failed inside NCCL, after the ranks had waited. Refused at construction; the
    group is simulated (no GPU here)."""
    from gradkit.accumulate import _conditional_dist as module

    fake = {"is_available": True, "is_initialized": True, "get_rank": 0, "get_world_size": 2}
    for name, value in fake.items():
        monkeypatch.setattr(module.dist, name, lambda *a, value=value, **k: value)
    monkeypatch.setattr(module.dist, "get_backend", lambda *a, **k: "nccl")
    with pytest.raises(ValueError) as raised:
        DistributedConditionalAccumulator((3,), torch.float32)
    text = str(raised.value)
    assert "device" in text and "NCCL" in text and "'cpu'" in text and "cuda" in text, text

"""Stress (not timed): 8 producer threads x 10,000 applies against 4 consumer threads taking
windows of different sizes. No gradient is lost or counted twice, every thread finishes.

``GRADKIT_STRESS_APPLIES`` sets the applies per producer (default 10,000)."""

from __future__ import annotations

import os
import threading

import torch

from gradkit.accumulate import (
    AccumulatorClosed,
    ConditionalAccumulator,
    SparseConditionalAccumulator,
    TakeTimeout,
)

from ._cond_helpers import Background

APPLIES = int(os.environ.get("GRADKIT_STRESS_APPLIES", "10000"))
PRODUCERS, CONSUMERS = 8, 4


def run(acc, apply_one, count_of, applies: int) -> tuple[int, int, int]:
    """Producers apply ``applies`` gradients each (every 10th one stale on purpose); consumers
    take until closed. Returns (accepted by apply, taken, takes served)."""
    stop = threading.Event()
    start = threading.Barrier(PRODUCERS + CONSUMERS)

    def produce(seed: int) -> int:
        start.wait(10)
        accepted = 0
        for i in range(applies):
            step = acc.global_step
            if (i + seed) % 10 == 0:
                step -= 1  # stale (dropped and counted) once a take has happened
            accepted += apply_one(step)
        return accepted

    def consume(k: int) -> tuple[int, int]:
        start.wait(10)
        taken = takes = 0
        while True:
            try:
                taken += count_of(acc, k)
                takes += 1
            except TakeTimeout:
                if stop.is_set():
                    return taken, takes
            except AccumulatorClosed:
                return taken, takes

    producers = [Background(produce, s) for s in range(PRODUCERS)]
    consumers = [Background(consume, k) for k in (1, 3, 7, 16)]
    accepted = sum(p.result(timeout=120) for p in producers)
    stop.set()
    acc.close()
    results = [c.result(timeout=10) for c in consumers]
    return accepted, sum(t for t, _ in results), sum(n for _, n in results)


def dense_count(acc, k):
    out = acc.take_grad(k, timeout=0.05)
    assert out[0] == out[1]
    return int(out[0].item())


def test_dense_no_gradient_lost_or_counted_twice():
    acc = ConditionalAccumulator(shape=(2,), reduction="sum")
    ones = torch.ones(2)
    accepted, taken, takes = run(acc, lambda s: acc.apply_grad(ones, s), dense_count, APPLIES)
    applied = PRODUCERS * APPLIES
    assert accepted == applied - acc.num_dropped
    assert taken + acc.num_accumulated == accepted
    assert takes == acc.global_step
    assert acc.num_dropped > 0 and takes > 0


def sparse_count(acc, k):
    out = acc.take_grad(k, timeout=0.05)
    assert out.indices.tolist() == [1, 4]
    return int(out.values[0, 0].item())


def test_sparse_no_gradient_lost_or_counted_twice():
    acc = SparseConditionalAccumulator(shape=(5, 2), reduction="sum")
    idx, vals = torch.tensor([4, 1, 4]), torch.tensor([[0.5, 0.5], [1.0, 1.0], [0.5, 0.5]])
    applies = max(APPLIES // 5, 1)
    accepted, taken, takes = run(
        acc, lambda s: acc.apply_indexed_slices_grad(idx, vals, s), sparse_count, applies
    )
    assert accepted == PRODUCERS * applies - acc.num_dropped
    assert taken + acc.num_accumulated == accepted
    assert takes == acc.global_step

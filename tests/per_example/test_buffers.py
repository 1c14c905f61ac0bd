"""``batch_grad`` storage is reused from one ``track()`` block to the next on the CPU (no page
faults of a fresh ``N x params`` tensor per step), and never while anything of the user's
still refers to it."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.per_example import _buffers, release_buffers, track
from gradkit.testing import per_example_grads

# the pool is the CPU's (the CUDA caching allocator already reuses device memory)
pytestmark = pytest.mark.cpu_only


@pytest.fixture(autouse=True)
def _pool_every_size(monkeypatch):
    """These models are small: pool their results too (real ones pool from 128 KiB)."""
    monkeypatch.setattr(_buffers, "_MIN_BYTES", 0)


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    return model


def _step(model, seed):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    model.zero_grad(set_to_none=True)
    with track(model, "batch_grad") as stats:
        F.cross_entropy(model(x), y).backward()
    return stats, per_example_grads(model, F.cross_entropy, x, y)


def test_storage_is_reused_once_the_user_dropped_it():
    model = _setup()
    stats, _ = _step(model, 0)
    first = stats["0.weight"].batch_grad.data_ptr()
    del stats
    stats, ref = _step(model, 1)
    assert stats["0.weight"].batch_grad.data_ptr() == first  # the same storage, refilled
    torch.testing.assert_close(stats["0.weight"].batch_grad, ref["0.weight"], rtol=1e-12, atol=0)


def test_results_the_user_holds_are_never_overwritten():
    model = _setup()
    held = []
    for seed in range(5):  # the loop pattern: last step's stats still bound, plus what we keep
        stats, ref = _step(model, seed)
        grads = stats["0.weight"].batch_grad
        torch.testing.assert_close(grads, ref["0.weight"], rtol=1e-12, atol=0)
        kind = seed % 3
        if kind == 0:
            held.append((grads, ref["0.weight"]))  # the tensor itself
        elif kind == 1:
            held.append((grads[2:], ref["0.weight"][2:]))  # a view only
        else:
            held.append((torch.from_numpy(grads.numpy()), ref["0.weight"]))  # a NumPy array's
        del grads
    for got, want in held:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert isinstance(np.asarray(held[2][0]), np.ndarray)


def test_micro_batches_and_changing_batch_sizes_stay_exact():
    model = _setup()
    for sizes in ([6], [4, 2], [3], [6]):
        x = torch.randn(sum(sizes), 5, dtype=torch.float64)
        y = torch.randint(0, 3, (sum(sizes),))
        with track(model, "batch_grad", "variance", loss_reduction="sum") as stats:
            for part_x, part_y in zip(x.split(sizes), y.split(sizes), strict=True):
                F.cross_entropy(model(part_x), part_y, reduction="sum").backward()
        ref = per_example_grads(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)
        for name, g in ref.items():
            torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-12, atol=1e-14)
        model.zero_grad(set_to_none=True)


def test_release_buffers_frees_the_pool_and_keeps_results():
    model = _setup()
    stats, ref = _step(model, 0)
    kept = stats["0.weight"].batch_grad
    first = kept.data_ptr()
    release_buffers()
    del stats
    stats, _ = _step(model, 1)
    assert stats["0.weight"].batch_grad.data_ptr() != first  # held by `kept`, not reused
    torch.testing.assert_close(kept, ref["0.weight"], rtol=1e-12, atol=0)


def test_sequence_layers_whose_backward_sums_the_blocks_reuse_storage_exactly():
    """A Linear on sequences takes its weight gradient from the per-example blocks (summed in
    its backward) before they are scaled in place in the reused storage."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()

    def loss_fn(out, y):
        return F.mse_loss(out, y, reduction="sum")

    held, ptrs = [], []
    for seed in range(3):
        g = torch.Generator(torch.get_default_device()).manual_seed(seed)
        x = torch.randn(6, 7, 4, dtype=torch.float64, generator=g)
        y = torch.randn(6, 7, 2, dtype=torch.float64, generator=g)
        model.zero_grad(set_to_none=True)
        with track(model, "batch_grad", loss_reduction="sum") as stats:
            loss_fn(model(x), y).backward()
        ref = per_example_grads(model, loss_fn, x, y)
        for name, want in ref.items():
            torch.testing.assert_close(stats[name].batch_grad, want, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(model.get_parameter(name).grad, want.sum(0))
        ptrs.append(stats["0.weight"].batch_grad.data_ptr())
        if seed == 0:
            held.append((stats["0.weight"].batch_grad, ref["0.weight"]))
        del stats
    assert ptrs[2] == ptrs[1] != ptrs[0]  # step 0's result is held: step 1 took new storage
    torch.testing.assert_close(held[0][0], held[0][1], rtol=1e-12, atol=1e-13)


def test_results_under_the_size_floor_are_not_pooled(monkeypatch):
    monkeypatch.setattr(_buffers, "_MIN_BYTES", 32 * 2**20)
    model = _setup()
    _step(model, 0)
    assert model[0].weight not in _buffers._POOL
    big = torch.nn.Parameter(torch.zeros(1024, 1024))
    buf = _buffers.batch_grad_buffer(big, (8, 1024, 1024), torch.float32)  # 32 MiB
    assert buf is not None and big in _buffers._POOL


def _stats_step(model, seed):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    model.zero_grad(set_to_none=True)
    with track(model, "variance", "second_moment", moments=(3,), unbiased=True) as stats:
        F.cross_entropy(model(x), y).backward()
    grads = per_example_grads(model, F.cross_entropy, x, y)["0.weight"]
    want = {
        "mean": grads.mean(0),
        "second_moment": grads.square().mean(0),
        "variance": grads.var(0),  # unbiased, as asked
        "moment3": grads.pow(3).mean(0),
    }
    return stats["0.weight"], want


def _read(stat):
    return {
        "mean": stat.mean,
        "second_moment": stat.second_moment,
        "variance": stat.variance,
        "moment3": stat.moment(3),
    }


def test_statistics_read_reuse_storage_once_dropped_and_never_while_held():
    model = _setup()
    stat, want = _stats_step(model, 0)
    got = _read(stat)
    ptrs = {k: v.data_ptr() for k, v in got.items()}
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-14)
    held = got["variance"][1:]  # a view keeps its storage from the pool
    held_want = want["variance"][1:]
    del got, stat, v
    stat, want = _stats_step(model, 1)
    got = _read(stat)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-14)
        assert (v.data_ptr() == ptrs[k]) == (k != "variance"), k  # dropped ones are refilled
    torch.testing.assert_close(held, held_want, rtol=1e-10, atol=1e-14)
    again = stat.second_moment  # the first read is still bound: another buffer
    assert again.data_ptr() != got["second_moment"].data_ptr()
    torch.testing.assert_close(again, want["second_moment"], rtol=1e-10, atol=1e-14)


def test_statistics_under_the_result_floor_are_fresh(monkeypatch):
    monkeypatch.setattr(_buffers, "_MIN_BYTES", 10**9)
    model = _setup()
    stat, _ = _stats_step(model, 0)
    _ = stat.mean
    assert model[0].weight not in _buffers._POOL


def _sums_step(model, seed, positions):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(6, *positions, 5, dtype=torch.float64, generator=g)
    y = torch.randn(6, *positions, 3, dtype=torch.float64, generator=g)

    def loss_fn(out, t):
        return F.mse_loss(out, t, reduction="sum")

    model.zero_grad(set_to_none=True)
    with track(model, "variance", moments=(3,), loss_reduction="sum", unbiased=True) as stats:
        loss_fn(model(x), y).backward()
    grads = per_example_grads(model, loss_fn, x, y)["0.weight"]
    want = {"mean": grads.mean(0), "variance": grads.var(0), "moment3": grads.pow(3).mean(0)}
    return stats["0.weight"], want


def _check(stat, want):
    got = {"mean": stat.mean, "variance": stat.variance, "moment3": stat.moment(3)}
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-13, msg=k)


@pytest.mark.parametrize("positions", [(), (4,)], ids=["closed_forms", "materialized"])
def test_running_sums_reuse_storage_and_never_that_of_a_live_block(positions):
    """The sums a block accumulates (the mean read at the edges, the moments by closed forms or
    from materialized blocks) are written into storage kept from an earlier block once nothing
    holds it; a block whose statistics are still alive keeps its own."""
    model = _setup()
    first, want_first = _sums_step(model, 0, positions)
    sums = first._acc.sums
    ptrs = {p: sums[p].data_ptr() for p in (1, 2, 3)}
    assert all(sums[p].untyped_storage().data_ptr() in _pool_ptrs(model) for p in ptrs)
    second, want_second = _sums_step(model, 1, positions)
    assert all(second._acc.sums[p].data_ptr() != ptrs[p] for p in ptrs)  # first is alive
    _check(second, want_second)
    _check(first, want_first)  # not overwritten by the second block
    del first, sums
    third, want_third = _sums_step(model, 2, positions)
    assert {p: third._acc.sums[p].data_ptr() for p in ptrs} == ptrs  # dropped: refilled
    _check(third, want_third)
    _check(second, want_second)


def _pool_ptrs(model):
    kinds = _buffers._POOL[model[0].weight]
    return {b.untyped_storage().data_ptr() for k, bufs in kinds.items() for b in bufs}


def test_a_rule_whose_power_sum_takes_no_storage_keeps_fresh_sums():
    """A subclass that overrides ``power_sum`` without ``out`` is never handed storage."""
    from gradkit.per_example import Materialized

    class Plain(Materialized):
        def power_sum(self, p, scale=1.0):
            return super().power_sum(p, scale)

    class Into(Materialized):
        sums_into = True

        def power_sum(self, p, scale=1.0, out=None):
            return super().power_sum(p, scale, out)

    assert not Plain(torch.zeros(2, 3)).sums_into
    assert Into(torch.zeros(2, 3)).sums_into and Materialized(torch.zeros(2, 3)).sums_into


def test_an_embedding_table_s_sums_reuse_storage_exactly():
    """An embedding's closed forms add its rows into the table-shaped sum in place: reused
    storage is zeroed first, and a live block's is never taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 2)).double()

    def loss_fn(out, t):
        return F.mse_loss(out, t, reduction="sum")

    def step(seed):
        g = torch.Generator(torch.get_default_device()).manual_seed(seed)
        x = torch.randint(0, 11, (6, 3), generator=g)
        y = torch.randn(6, 2, dtype=torch.float64, generator=g)
        with track(model, "second_moment", loss_reduction="sum") as stats:
            loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        want = per_example_grads(model, loss_fn, x, y)["0.weight"].square().mean(0)
        return stats["0.weight"], want

    first, want_first = step(0)
    ptr = first._acc.sums[2].data_ptr()
    second, want_second = step(1)
    assert second._acc.sums[2].data_ptr() != ptr
    del first
    third, want_third = step(2)
    assert third._acc.sums[2].data_ptr() == ptr
    for stat, want in ((second, want_second), (third, want_third)):
        torch.testing.assert_close(stat.second_moment, want, rtol=1e-10, atol=1e-13)


def _mean_step(model, seed):
    stat, want = _stats_step(model, seed)
    return stat, want["mean"]


def _next_mean_elsewhere(model, ptr):
    """The next block's mean: right, and not in the storage at ``ptr``."""
    stat, want = _mean_step(model, 1)
    got = stat.mean
    assert got.data_ptr() != ptr
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_a_result_held_by_its_storage_object_alone_is_never_overwritten():
    """torch keeps one Python object per storage: holding it adds references, not a use."""
    model = _setup()
    stat, want = _mean_step(model, 0)
    mean = stat.mean
    held = mean.untyped_storage()
    ptr = mean.data_ptr()
    del mean, stat
    _next_mean_elsewhere(model, ptr)
    kept = torch.empty(0, dtype=torch.float64).set_(held, 0, want.shape)
    torch.testing.assert_close(kept, want, rtol=1e-10, atol=1e-14)


def test_a_result_moved_to_shared_memory_is_never_reused():
    """A tensor sent to another process (a logging worker) lives on there in shared memory."""
    model = _setup()
    stat, _ = _mean_step(model, 0)
    mean = stat.mean.share_memory_()  # what torch.multiprocessing does to a tensor it sends
    ptr = mean.data_ptr()
    del mean, stat
    _next_mean_elsewhere(model, ptr)


def test_a_result_whose_storage_was_resized_is_never_reused():
    """Written into after ``resize_(0)``, the storage would be overrun."""
    model = _setup()
    for size in (0, 16):
        stat, _ = _mean_step(model, 0)
        stat.mean.untyped_storage().resize_(size)
        del stat
        stat, want = _mean_step(model, 1)
        torch.testing.assert_close(stat.mean, want, rtol=1e-10, atol=1e-14)


def test_reads_in_inference_mode_leave_later_results_ordinary_tensors():
    model = _setup()
    stat, _ = _mean_step(model, 0)
    with torch.inference_mode():
        inside = stat.mean
    assert inside.is_inference()
    del inside, stat
    stat, want = _mean_step(model, 1)
    got = stat.mean
    assert not got.is_inference()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_two_threads_never_take_the_same_storage(monkeypatch):
    """Free, then taken, under one lock: two threads reading statistics at once (a logging
    thread and the training loop) each get storage of their own."""
    model = _setup()
    first, _ = _mean_step(model, 0)
    second, _ = _mean_step(model, 1)
    first.mean.numel()  # a buffer exists, free again once dropped
    barrier = threading.Barrier(2)
    free = _buffers._free

    def slow_free(t):  # both threads find the same buffer free before either takes it
        result = free(t)
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=0.5)
        return result

    monkeypatch.setattr(_buffers, "_free", slow_free)
    got = {}
    threads = [
        threading.Thread(target=lambda k=k, s=s: got.__setitem__(k, s.mean))
        for k, s in (("first", first), ("second", second))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["first"].data_ptr() != got["second"].data_ptr()


def test_an_old_block_read_after_its_parameter_was_reshaped_is_fresh():
    model = _setup()
    stat, want = _mean_step(model, 0)
    model[0].weight.data = torch.zeros(9, 5, dtype=torch.float64)  # another shape
    torch.testing.assert_close(stat.mean, want, rtol=1e-10, atol=1e-14)

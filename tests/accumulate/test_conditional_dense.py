"""ConditionalAccumulator: TensorFlow's contract (reference cases 1-20, named ``test_caseN_...``)
and the traps fixed (required local_step, counted drops, copies, timeouts, close)."""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch

from gradkit.accumulate import (
    AccumulatorClosed,
    ConditionalAccumulator,
    TakeCancelled,
    TakeTimeout,
)
from gradkit.testing import assert_close

from ._cond_helpers import Background, wait_until

T = torch.tensor


def scalar(v: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([v], dtype=dtype)


# ------------------------------------------------------------------ reference cases 1-20
def test_case1_num_accumulated_starts_at_zero():
    acc = ConditionalAccumulator(shape=[1], dtype=torch.float32)
    assert acc.num_accumulated == 0
    assert acc.global_step == 0
    assert acc.num_dropped == 0


def test_case2_mean_of_10_and_20():
    acc = ConditionalAccumulator(shape=[1])
    assert acc.apply_grad(scalar(10.0), local_step=0)
    assert acc.apply_grad(scalar(20.0), local_step=0)
    assert acc.num_accumulated == 2
    out = acc.take_grad(1)
    assert out.tolist() == [15.0]
    assert acc.num_accumulated == 0
    assert acc.global_step == 1


def test_case3_sum_of_10_and_20():
    acc = ConditionalAccumulator(shape=[1], reduction="sum")
    acc.apply_grad(scalar(10.0), 0)
    acc.apply_grad(scalar(20.0), 0)
    assert acc.take_grad(1).tolist() == [30.0]


@pytest.mark.parametrize("bad", ["Invalid", "MEAN", None, 1])
def test_case4_invalid_reduction_at_construction(bad):
    with pytest.raises(ValueError, match=r"ConditionalAccumulator\(.*\): reduction: expected one"):
        ConditionalAccumulator(shape=[1], reduction=bad)


@pytest.mark.parametrize("n", [0, -1])
def test_case5_take_grad_non_positive_num_required(n):
    acc = ConditionalAccumulator(shape=[1])
    acc.apply_grad(scalar(1.0), 0)
    with pytest.raises(ValueError, match=rf"take_grad\(num_required={n}\): num_required: expected"):
        acc.take_grad(n)
    assert acc.num_accumulated == 1 and acc.global_step == 0


def test_case6_step_zero_after_first_take_is_dropped_and_counted():
    acc = ConditionalAccumulator(shape=[1])
    acc.apply_grad(scalar(1.0), 0)
    acc.take_grad(1)
    assert acc.global_step == 1
    assert acc.apply_grad(scalar(5.0), local_step=0) is False  # no exception
    assert acc.num_accumulated == 0 and acc.num_dropped == 1
    assert acc.apply_grad(scalar(5.0), local_step=1) is True
    assert acc.num_accumulated == 1


def test_case6_local_step_has_no_default():
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(
        TypeError,
        match=r"apply_grad\(grad, local_step\): local_step: .*no value.*"
        r"TensorFlow's default local_step=0",
    ):
        acc.apply_grad(scalar(1.0))
    assert acc.num_accumulated == 0


def test_case7_stale_gradient_with_wrong_shape_is_dropped_silently():
    acc = ConditionalAccumulator(shape=[3, 2])
    acc.set_global_step(5)
    assert acc.apply_grad(torch.ones(7, 7), local_step=4) is False
    assert acc.apply_grad(torch.ones(3, 2, dtype=torch.int64), local_step=4) is False
    assert acc.num_dropped == 2 and acc.num_accumulated == 0


@pytest.mark.parametrize("shape", [(2, 2), (3, 1), (3,), (3, 2, 1)])
def test_case8_static_shape_mismatch(shape):
    acc = ConditionalAccumulator(shape=(3, 2))
    with pytest.raises(
        ValueError,
        match=r"grad: expected shape \(3, 2\) \(the accumulator's "
        rf"shape\), got shape \({shape[0]},.*shape mismatch",
    ):
        acc.apply_grad(torch.ones(shape), 0)
    assert acc.num_accumulated == 0
    assert acc.apply_grad(torch.ones(3, 2), 0)


def test_case9_unknown_shape_fixed_by_first_gradient_until_take():
    acc = ConditionalAccumulator(shape=None)
    acc.apply_grad(torch.ones(3, 2), 0)
    for bad in [(2, 2), (3, 1)]:
        with pytest.raises(
            ValueError,
            match=r"expected shape \(3, 2\) \(the shape of the 1 "
            r"gradient\(s\) accumulated since the last take\)",
        ):
            acc.apply_grad(torch.ones(bad), 0)
    assert acc.num_accumulated == 1
    assert acc.take_grad(1).shape == (3, 2)
    assert acc.apply_grad(torch.ones(2, 2), 1)
    assert acc.take_grad(1).shape == (2, 2)


def test_case10_mean_divides_by_all_accumulated():
    acc = ConditionalAccumulator(shape=[1])
    for v in [1.0, 2.0, 3.0, 4.0, 10.0]:
        acc.apply_grad(scalar(v), 0)
    assert acc.take_grad(3).tolist() == [4.0]  # 20 / 5, not / 3
    assert acc.global_step == 1


def test_case11_blocking_take_returns_mean_of_three():
    acc = ConditionalAccumulator(shape=[1])
    taker = Background(acc.take_grad, 3, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 1, what="take queued")
    producer = Background(lambda: [acc.apply_grad(scalar(v), 0) for v in (10.0, 20.0, 30.0)])
    assert producer.result() == [True, True, True]
    assert taker.result().tolist() == [20.0]


def test_case11_two_applies_leave_take_blocked():
    acc = ConditionalAccumulator(shape=[1])
    taker = Background(acc.take_grad, 3, timeout=0.5)
    wait_until(lambda: acc.num_waiting == 1)
    acc.apply_grad(scalar(10.0), 0)
    acc.apply_grad(scalar(20.0), 0)
    err = taker.exception()
    assert isinstance(err, TakeTimeout) and isinstance(err, TimeoutError)
    assert err.num_required == 3 and err.num_accumulated == 2
    assert "waiting for 3 gradient(s); 2 accumulated" in str(err)
    assert acc.num_accumulated == 2 and acc.global_step == 0  # nothing consumed


def test_case12_fifo_smaller_take_waits_behind_head():
    acc = ConditionalAccumulator(shape=[1])
    t1 = Background(acc.take_grad, 3, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 1)
    t2 = Background(acc.take_grad, 1, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 2)
    acc.apply_grad(scalar(1.0), 0)
    assert t1.running and t2.running and acc.num_waiting == 2  # T2 behind T1
    acc.apply_grad(scalar(2.0), 0)
    acc.apply_grad(scalar(6.0), 0)
    assert t1.result().tolist() == [3.0]
    assert t2.running and acc.global_step == 1
    acc.apply_grad(scalar(7.0), 1)
    assert t2.result().tolist() == [7.0]


def test_case12_timed_out_head_lets_the_next_take_through():
    acc = ConditionalAccumulator(shape=[1])
    acc.apply_grad(scalar(4.0), 0)
    t1 = Background(acc.take_grad, 3, timeout=0.1)
    wait_until(lambda: acc.num_waiting == 1)
    t2 = Background(acc.take_grad, 1, timeout=5.0)
    assert isinstance(t1.exception(), TakeTimeout)
    assert t2.result().tolist() == [4.0]


@pytest.mark.parametrize(("reduction", "want"), [("mean", 55.0), ("sum", 550.0)])
def test_case13_parallel_applies(reduction, want):
    acc = ConditionalAccumulator(shape=[1], reduction=reduction)
    start = threading.Barrier(10)

    def apply(v):
        start.wait(5)
        return acc.apply_grad(scalar(v), 0)

    workers = [Background(apply, float(v)) for v in range(10, 101, 10)]
    assert all(w.result() for w in workers)
    assert acc.take_grad(1).tolist() == [want]


def test_case14_parallel_takes_each_get_one_value():
    acc = ConditionalAccumulator(shape=[1])
    takers = [Background(acc.take_grad, 1, timeout=5.0) for _ in range(10)]
    wait_until(lambda: acc.num_waiting == 10)
    for e in range(10):
        wait_until(lambda e=e: acc.global_step == e, what=f"take {e} served")
        assert acc.apply_grad(scalar(float(e)), local_step=e)
    got = sorted(t.result().item() for t in takers)
    assert got == [float(e) for e in range(10)]
    assert acc.global_step == 10


@pytest.mark.parametrize("ls", range(1000, 1005))
def test_case15_set_global_step_prevents_accumulation(ls):
    acc = ConditionalAccumulator(shape=[1])
    acc.set_global_step(ls)
    accepted = [acc.apply_grad(scalar(float(s)), local_step=s) for s in range(1000, 1005)]
    assert accepted == [s >= ls for s in range(1000, 1005)]
    kept = [s for s in range(1000, 1005) if s >= ls]
    assert acc.take_grad(1).item() == sum(kept) / len(kept)
    assert acc.num_dropped == ls - 1000 and acc.global_step == ls + 1


def test_case16_lowering_global_step_warns_and_sets():
    acc = ConditionalAccumulator(shape=[1])
    acc.set_global_step(5)
    acc.apply_grad(scalar(3.0), 5)
    with pytest.warns(
        UserWarning,
        match=r"set_global_step\(step\): lowering the global step "
        r"from 5 to 2",
    ):
        acc.set_global_step(2)
    assert acc.global_step == 2 and acc.num_accumulated == 1  # aggregate kept
    assert acc.apply_grad(scalar(5.0), local_step=2)
    assert acc.take_grad(2).item() == 4.0


def test_case17_cancel_pending_keeps_gradients_and_accumulator():
    acc = ConditionalAccumulator(shape=[1])
    acc.apply_grad(scalar(8.0), 0)
    taker = Background(acc.take_grad, 2, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 1)
    assert acc.cancel_pending() == 1
    err = taker.exception()
    assert type(err) is TakeCancelled
    assert "cancelled by cancel_pending() while waiting (1 gradients accumulated)" in str(err)
    assert acc.num_accumulated == 1 and acc.global_step == 0
    acc.apply_grad(scalar(2.0), 0)
    assert acc.take_grad(2).item() == 5.0  # still usable; nothing was consumed


def test_case17_close_cancels_waiting_and_later_calls():
    acc = ConditionalAccumulator(shape=[1])
    acc.apply_grad(scalar(8.0), 0)
    taker = Background(acc.take_grad, 2)
    wait_until(lambda: acc.num_waiting == 1)
    acc.close()
    err = taker.exception()
    assert isinstance(err, AccumulatorClosed) and isinstance(err, TakeCancelled)
    assert "the accumulator was closed while waiting" in str(err)
    with pytest.raises(
        AccumulatorClosed,
        match=r"take_grad\(num_required=1\): the accumulator "
        r"was closed",
    ):
        acc.take_grad(1)
    with pytest.raises(AccumulatorClosed, match=r"apply_grad\(grad, local_step=0\)"):
        acc.apply_grad(scalar(1.0), 0)
    assert acc.closed and acc.num_accumulated == 1  # nothing consumed
    assert acc.state_dict()["aggregate"].tolist() == [8.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_case18_dtypes(dtype):
    acc = ConditionalAccumulator(shape=[1], dtype=dtype)
    for v in range(10):
        acc.apply_grad(scalar(float(v), dtype), 0)
    out = acc.take_grad(1)
    assert out.dtype == dtype and out.item() == 4.5


@pytest.mark.parametrize(
    ("acc_dtype", "grad_dtype"),
    [
        (torch.float32, torch.float64),
        (torch.float32, torch.int64),
        (torch.float64, torch.int32),
        (torch.float32, torch.bool),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.complex64),
    ],
)
def test_case19_wrong_dtype_rejected(acc_dtype, grad_dtype):
    acc = ConditionalAccumulator(shape=[2], dtype=acc_dtype)
    with pytest.raises(
        TypeError,
        match=rf"grad.dtype: expected {acc_dtype} or a floating dtype "
        rf"that converts to it without loss, got {grad_dtype}; cast",
    ):
        acc.apply_grad(torch.ones(2, dtype=grad_dtype), 0)
    assert acc.num_accumulated == 0


@pytest.mark.parametrize(
    ("acc_dtype", "grad_dtype"),
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float64, torch.float32),
        (torch.complex64, torch.float32),
    ],
)
def test_case19_lossless_widening_accepted(acc_dtype, grad_dtype):
    acc = ConditionalAccumulator(shape=[1], dtype=acc_dtype)
    acc.apply_grad(torch.tensor([0.1], dtype=grad_dtype), 0)
    out = acc.take_grad(1)
    assert out.dtype == acc_dtype
    want = torch.tensor([0.1], dtype=grad_dtype, device="cpu").to(acc_dtype)  # its device
    assert out == want  # bit-exact conversion


def test_case20_apply_copies_and_take_returns_fresh_tensor():
    acc = ConditionalAccumulator(shape=[2])
    g = T([1.0, 2.0])
    acc.apply_grad(g, 0)
    g.mul_(100)  # the caller reuses its buffer
    acc.apply_grad(g, 0)
    out = acc.take_grad(1)
    assert out.tolist() == [50.5, 101.0]
    out.fill_(-1)  # mutate the result
    acc.apply_grad(T([3.0, 3.0]), 1)
    assert acc.take_grad(1).tolist() == [3.0, 3.0]


# ------------------------------------------------------------------ beyond the reference
def test_mean_matches_float64_oracle():
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    grads = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(7)]
    acc = ConditionalAccumulator(shape=(4, 3), dtype=torch.float64)
    for x in grads:
        acc.apply_grad(x, 0)
    assert_close(acc.take_grad(7), torch.stack(grads).mean(0).cpu())  # on its default device


def test_fp16_sums_in_float32():
    acc = ConditionalAccumulator(shape=[1], dtype=torch.float16, reduction="sum")
    for _ in range(3000):  # 2048 + 1 is not representable in fp16; the fp32 sum is exact
        acc.apply_grad(scalar(1.0, torch.float16), 0)
    assert acc.take_grad(1).item() == 3000.0


def test_partial_shape_with_unknown_dims():
    acc = ConditionalAccumulator(shape=(None, 2))
    acc.apply_grad(torch.ones(3, 2), 0)
    with pytest.raises(
        ValueError,
        match=r"expected shape \(\?, 2\) \(the accumulator's shape\), "
        r"got shape \(3, 3\)",
    ):
        acc.apply_grad(torch.ones(3, 3), 0)
    acc.take_grad(1)
    acc.apply_grad(torch.ones(5, 2), 1)
    assert acc.take_grad(1).shape == (5, 2)


def test_scalar_shape():
    acc = ConditionalAccumulator(shape=())
    acc.apply_grad(torch.tensor(2.0), 0)
    acc.apply_grad(torch.tensor(4.0), 0)
    assert acc.take_grad(2).item() == 3.0
    with pytest.raises(ValueError, match=r"expected shape \(\) \(the accumulator's shape\)"):
        acc.apply_grad(torch.ones(1), 1)


@pytest.mark.parametrize(
    ("step", "err", "match"),
    [
        (lambda: 1.0, TypeError, r"local_step: expected an int .*got 1.0; pass an int"),
        (lambda: True, TypeError, r"local_step: expected an int"),
        (lambda: "3", TypeError, r"local_step: expected an int"),
        (lambda: torch.tensor([1, 2]), ValueError, r"local_step: expected a scalar"),
        (lambda: torch.tensor(0.0), TypeError, r"local_step: expected an int"),
    ],
)
def test_local_step_must_be_an_int(step, err, match):
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(err, match=match):
        acc.apply_grad(scalar(1.0), step())


def test_local_step_as_int_tensor():
    acc = ConditionalAccumulator(shape=[1])
    assert acc.apply_grad(scalar(1.0), torch.tensor(0))


@pytest.mark.parametrize(
    "bad",
    [lambda: 1.5, lambda: "2", lambda: None, lambda: torch.tensor([1, 2])],
    ids=["float", "str", "none", "vector"],
)
def test_num_required_must_be_an_int(bad):
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises((TypeError, ValueError), match=r"take_grad\(.*\): num_required: expected"):
        acc.take_grad(bad())


@pytest.mark.parametrize("bad", [-1.0, "1", float("nan"), True])
def test_timeout_must_be_seconds(bad):
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(ValueError, match=r"timeout: expected None \(wait forever\) or a number"):
        acc.take_grad(1, timeout=bad)


def test_zero_timeout_is_a_try():
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(
        TakeTimeout,
        match=r"timed out after 0 s waiting for 1 gradient\(s\); 0 "
        r"accumulated; nothing was consumed",
    ):
        acc.take_grad(1, timeout=0)
    acc.apply_grad(scalar(1.0), 0)
    assert acc.take_grad(1, timeout=0).item() == 1.0
    assert acc.num_waiting == 0


def test_timeout_message_counts_takes_ahead():
    acc = ConditionalAccumulator(shape=[1])
    head = Background(acc.take_grad, 5, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 1)
    with pytest.raises(TakeTimeout, match=r"1 earlier take\(s\) still waiting ahead \(FIFO\)"):
        acc.take_grad(1, timeout=0.05)
    acc.cancel_pending()
    assert isinstance(head.exception(), TakeCancelled)


@pytest.mark.parametrize(
    ("grad", "match"),
    [
        (
            lambda: [1.0],
            r"grad: expected a torch.Tensor, got list\[1.0\] \(length 1\); pass a tensor",
        ),
        (
            lambda: torch.ones(1).to_sparse(),
            r"grad: expected a dense \(strided\) tensor, got a tensor "
            r"with layout torch.sparse_coo; use SparseConditionalAccumulator",
        ),
    ],
)
def test_grad_must_be_a_dense_tensor(grad, match):
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(TypeError, match=match):
        acc.apply_grad(grad(), 0)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"dtype": torch.int64}, TypeError, r"dtype: expected a floating or complex torch.dtype"),
        ({"dtype": "float32"}, TypeError, r"dtype: expected a floating or complex"),
        ({"shape": (-1, 2)}, ValueError, r"shape: expected dims that are ints >= 0 or None"),
        ({"shape": "ab"}, TypeError, r"shape: expected None or a sequence of ints"),
    ],
)
def test_constructor_checks(kwargs, err, match):
    with pytest.raises(err, match=match):
        ConditionalAccumulator(**kwargs)


def test_requires_grad_input_is_detached():
    acc = ConditionalAccumulator(shape=[2])
    w = torch.ones(2, requires_grad=True)
    acc.apply_grad(w * 2, 0)
    out = acc.take_grad(1)
    assert not out.requires_grad and out.tolist() == [2.0, 2.0]


def test_state_dict_round_trip_through_torch_save():
    acc = ConditionalAccumulator(shape=(None, 2), reduction="sum")
    acc.set_global_step(3)
    acc.apply_grad(torch.ones(1, 2), 2)  # dropped
    acc.apply_grad(T([[1.0, 2.0]]), 3)
    acc.apply_grad(T([[3.0, 4.0]]), 3)
    buf = io.BytesIO()
    torch.save(acc.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["shape"] == [None, 2] and state["dtype"] == "float32"
    other = ConditionalAccumulator(shape=(None, 2), reduction="sum")
    other.load_state_dict(state)
    assert (other.num_accumulated, other.global_step, other.num_dropped) == (2, 3, 1)
    state["aggregate"].fill_(0)  # the loaded accumulator owns a copy
    assert other.take_grad(2).tolist() == [[4.0, 6.0]]
    assert acc.take_grad(2).tolist() == [[4.0, 6.0]]  # the original is untouched


def test_load_state_dict_serves_waiting_take():
    src = ConditionalAccumulator(shape=[1])
    src.apply_grad(scalar(2.0), 0)
    src.apply_grad(scalar(4.0), 0)
    acc = ConditionalAccumulator(shape=[1])
    taker = Background(acc.take_grad, 2, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 1)
    acc.load_state_dict(src.state_dict())
    assert taker.result().item() == 3.0


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (
            lambda: ConditionalAccumulator(shape=[1], reduction="sum"),
            r"state\['reduction'\]: expected "
            r"'mean', got 'sum'",
        ),
        (
            lambda: ConditionalAccumulator(shape=[1], dtype=torch.float64),
            r"state\['dtype'\]: expected "
            r"'float32', got 'float64'",
        ),
        (
            lambda: ConditionalAccumulator(shape=[2]),
            r"state\['shape'\]: expected \[1\], got \[2\]",
        ),
    ],
)
def test_load_state_dict_rejects_other_configuration(other, match):
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(ValueError, match=r"load_state_dict\(state\): " + match):
        acc.load_state_dict(other().state_dict())


def test_repr():
    acc = ConditionalAccumulator(shape=(None, 3))
    acc.apply_grad(torch.ones(2, 3), 0)
    assert repr(acc) == (
        "ConditionalAccumulator(shape=(?, 3), dtype=torch.float32, reduction='mean', "
        "num_accumulated=1, global_step=0, num_dropped=0)"
    )
    assert type(acc).__module__ == "gradkit.accumulate"


def test_take_timeout_pickles_with_its_attributes():
    acc = ConditionalAccumulator(shape=[1])
    with pytest.raises(TakeTimeout) as info:
        acc.take_grad(2, timeout=0)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is TakeTimeout and str(again) == str(info.value)
    assert (again.num_required, again.num_accumulated, again.timeout) == (2, 0, 0.0)

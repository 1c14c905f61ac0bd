"""SparseConditionalAccumulator: TensorFlow's contract (reference cases 21-28, named
``test_caseN_...``), the dense-mean default, coalescing, and sparse COO input/output."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from torch import nn

from gradkit.accumulate import (
    AccumulatorClosed,
    ConditionalAccumulator,
    IndexedSlices,
    SparseConditionalAccumulator,
    TakeTimeout,
)
from gradkit.testing import assert_close

from ._cond_helpers import Background, wait_until

T = torch.tensor


def slices_a():
    return T([0, 1]), T([[1.0, 0.0], [0.0, 2.0]])


def slices_b():
    return T([0, 2]), T([[0.0, 1.0], [3.0, 0.0]])


def apply_ab(acc, step=0, scale=1.0):
    for idx, vals in (slices_a(), slices_b()):
        assert acc.apply_indexed_slices_grad(idx, vals * scale, step, dense_shape=[3, 2])


# ------------------------------------------------------------------ reference cases 21-28
@pytest.mark.parametrize(
    ("reduction", "values"),
    [
        ("row_mean", [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]]),  # TensorFlow's MEAN
        ("sum", [[1.0, 1.0], [0.0, 2.0], [3.0, 0.0]]),
        ("mean", [[0.5, 0.5], [0.0, 1.0], [1.5, 0.0]]),  # the dense mean
    ],
)
def test_case21_two_gradients(reduction, values):
    acc = SparseConditionalAccumulator(shape=(), reduction=reduction)
    apply_ab(acc)
    out = acc.take_grad(1)
    assert isinstance(out, IndexedSlices)
    assert out.indices.tolist() == [0, 1, 2]
    assert out.values.tolist() == values
    assert out.dense_shape == (-1, 2)
    assert acc.global_step == 1 and acc.num_accumulated == 0


def test_case21_mean_equals_dense_accumulator_on_densified_gradients():
    sparse = SparseConditionalAccumulator(shape=(3, 2))
    dense = ConditionalAccumulator(shape=(3, 2))
    apply_ab(sparse)
    for idx, vals in (slices_a(), slices_b()):
        dense.apply_grad(IndexedSlices(idx, vals, (3, 2)).to_dense(), 0)
    assert_close(sparse.take_grad(2).to_dense(), dense.take_grad(2))


def test_case22_second_window():
    acc = SparseConditionalAccumulator(shape=(), reduction="row_mean")
    apply_ab(acc)
    acc.take_grad(1)
    assert not acc.apply_indexed_slices_grad(*slices_a(), local_step=0)  # stale after the take
    apply_ab(acc, step=1, scale=10.0)
    out = acc.take_indexed_slices_grad(1)
    assert out.values.tolist() == [[5.0, 5.0], [0.0, 20.0], [30.0, 0.0]]
    assert acc.num_dropped == 1 and acc.global_step == 2


@pytest.mark.parametrize(
    ("slices", "err", "match"),
    [
        (
            lambda: (T(0), T([1.0])),
            ValueError,
            r"indices: expected a vector \(1-D\) of row indices, got "
            r"shape \(\); indices should be vector; wrap a single index as torch.tensor\(\[i\]\)",
        ),
        (
            lambda: (T([[0, 1]]), T([[1.0], [2.0]])),
            ValueError,
            r"indices: .*indices should be vector",
        ),
        (
            lambda: (T([0]), T(1.0)),
            ValueError,
            r"values: expected rank >= 1: \[len\(indices\), "
            r"\*row_shape\], got a 0-dimensional tensor; values cannot be 0-dimensional",
        ),
        (
            lambda: (T([0, 1]), T([[1.0]])),
            ValueError,
            r"values: expected 2 rows \(one per index\), got 1 "
            r"rows",
        ),
        (lambda: (T([0.0]), T([1.0])), TypeError, r"indices: expected an int32 or int64 tensor"),
        (
            lambda: (T([-1]), T([1.0])),
            ValueError,
            r"indices: expected row indices >= 0, got index -1",
        ),
        (
            lambda: (T([0]), T([1], dtype=torch.int64)),
            TypeError,
            r"values.dtype: expected torch.float32",
        ),
    ],
)
def test_case23_malformed_gradients(slices, err, match):
    indices, values = slices()
    acc = SparseConditionalAccumulator()
    with pytest.raises(
        err, match=r"apply_indexed_slices_grad\(indices, values, local_step=0\): " + match
    ):
        acc.apply_indexed_slices_grad(indices, values, 0)
    assert acc.num_accumulated == 0


def test_case23_empty_shape_scalar_apply():
    acc = SparseConditionalAccumulator(shape=())
    acc.apply_indexed_slices_grad(T([0]), T([1.0]), 0)
    out = acc.take_grad(1)
    assert out.indices.tolist() == [0] and out.values.tolist() == [1.0]
    assert out.dense_shape == (-1,)


def test_case23_stale_malformed_gradient_is_dropped_silently():
    acc = SparseConditionalAccumulator(shape=(2, 2))
    acc.set_global_step(1)
    assert not acc.apply_indexed_slices_grad(T([[9]]), T(1.0), local_step=0)
    assert acc.num_dropped == 1


def test_case24_validate_shape():
    acc = SparseConditionalAccumulator(shape=(2, 2, None))
    ok = T([[[1.0, 1.0], [1.0, 1.0]]])  # [1, 2, 2]
    with pytest.raises(
        ValueError,
        match=r"dense_shape: expected rank at least 3 \(the "
        r"accumulator's shape is \(2, 2, \?\)\), got rank 2: \(2, 2\)",
    ):
        acc.apply_indexed_slices_grad(T([0]), ok, 0, dense_shape=[2, 2])
    with pytest.raises(
        ValueError,
        match=r"dense_shape: expected dim 1 to be 2 .*got 3 in "
        r"\(2, 3, 2\)",
    ):
        acc.apply_indexed_slices_grad(T([0]), ok, 0, dense_shape=[2, 3, 2])
    with pytest.raises(
        ValueError,
        match=r"indices: expected row indices < 2 \(the accumulator's "
        r"shape\[0\]\), got index 3; the index exceeds the limit of dim 0",
    ):
        acc.apply_indexed_slices_grad(T([3]), ok, 0)
    with pytest.raises(ValueError, match=r"values: expected rank at least 3 .*got rank 2"):
        acc.apply_indexed_slices_grad(T([0]), T([[1.0, 1.0]]), 0)
    with pytest.raises(ValueError, match=r"values: expected dim 1 to be 2 .*got 3 in shape"):
        acc.apply_indexed_slices_grad(T([0]), torch.ones(1, 3, 2), 0)
    assert acc.num_accumulated == 0
    assert acc.apply_indexed_slices_grad(T([0]), torch.ones(1, 2, 2, 2), 0)  # rank 4 >= 3
    with pytest.raises(
        ValueError,
        match=r"values: expected rows of shape \(2, 2, 2\) \(those "
        r"accumulated since the last take\), got rows of shape \(2, 2, 3\)",
    ):
        acc.apply_indexed_slices_grad(T([1]), torch.ones(1, 2, 2, 3), 0)
    acc.take_grad(1)
    assert acc.apply_indexed_slices_grad(T([1]), torch.ones(1, 2, 2, 3), 1)  # lifted by the take


@pytest.mark.parametrize(
    ("shape", "values_shape", "want"),
    [
        ((2, None), (1, 2, 2, 2), (2, 2, 2, 2)),
        ((None, 2), (1, 2, 2, 3), (-1, 2, 2, 3)),
        ((), (1, 2), (-1, 2)),
        (None, (1, 5), (-1, 5)),
    ],
)
def test_case25_returned_dense_shape(shape, values_shape, want):
    acc = SparseConditionalAccumulator(shape=shape)
    acc.apply_indexed_slices_grad(T([0]), torch.ones(values_shape), 0)
    assert acc.take_grad(1).dense_shape == want


def test_case26_int32_indices_and_shape():
    acc = SparseConditionalAccumulator(shape=(3, 2), reduction="sum")
    idx, vals = slices_a()
    acc.apply_indexed_slices_grad(
        idx.int(), vals, 0, dense_shape=torch.tensor([3, 2], dtype=torch.int32)
    )
    out = acc.take_grad(1)
    assert out.indices.dtype == torch.int64 and out.indices.tolist() == [0, 1]


def test_case27_duplicate_unsorted_indices_are_coalesced():
    g1 = (T([2, 0, 2]), T([[1.0, 1.0], [5.0, 0.0], [2.0, 3.0]]))
    g2 = (T([2]), T([[10.0, 10.0]]))
    sums = {}
    for reduction in ("sum", "row_mean", "mean"):
        acc = SparseConditionalAccumulator(shape=(3, 2), reduction=reduction)
        for idx, vals in (g1, g2):
            acc.apply_indexed_slices_grad(idx, vals, 0)
        sums[reduction] = acc.take_grad(2)
    dense = ConditionalAccumulator(shape=(3, 2), reduction="sum")
    for idx, vals in (g1, g2):
        dense.apply_grad(torch.zeros(3, 2).index_add_(0, idx, vals), 0)
    assert_close(sums["sum"].to_dense(), dense.take_grad(2))
    assert sums["sum"].indices.tolist() == [0, 2]  # sorted, unique
    assert sums["sum"].values.tolist() == [[5.0, 0.0], [13.0, 14.0]]
    # row 2 appears in both gradients (three times in all): counted once per gradient
    assert sums["row_mean"].values.tolist() == [[5.0, 0.0], [6.5, 7.0]]
    assert sums["mean"].values.tolist() == [[2.5, 0.0], [6.5, 7.0]]


@pytest.mark.parametrize(("reduction", "want"), [("mean", 55.0), ("sum", 550.0)])
def test_case28_parallel_sparse_applies(reduction, want):
    acc = SparseConditionalAccumulator(shape=(2, 2), reduction=reduction)
    start = threading.Barrier(10)

    def apply(x):
        start.wait(5)
        return acc.apply_indexed_slices_grad(T([0, 1]), x * torch.eye(2), 0)

    workers = [Background(apply, float(x)) for x in range(10, 101, 10)]
    assert all(w.result() for w in workers)
    out = acc.take_grad(10)
    assert out.to_dense().tolist() == (want * torch.eye(2)).tolist()


# ------------------------------------------------------------------ beyond the reference
def test_embedding_sparse_gradient_through_apply_grad():
    emb = nn.Embedding(5, 2, sparse=True)
    emb(T([1, 1, 3])).sum().backward()
    g = emb.weight.grad
    assert not g.is_coalesced()
    acc = SparseConditionalAccumulator(shape=(5, 2), reduction="sum")
    acc.apply_grad(g, local_step=0)
    out = acc.take_sparse_coo(1)
    assert out.is_coalesced() and out.shape == (5, 2)
    assert_close(out.to_dense(), g.to_dense())


def test_sparse_coo_with_two_sparse_dims():
    g = torch.sparse_coo_tensor(
        T([[2, 0, 2], [1, 0, 1]]), T([1.0, 4.0, 2.0]), (3, 2), check_invariants=True
    )
    acc = SparseConditionalAccumulator(reduction="sum")
    acc.apply_grad(g, 0)
    out = acc.take_grad(1)
    assert out.indices.tolist() == [0, 2]
    assert out.values.tolist() == [[4.0, 0.0], [0.0, 3.0]]


def test_take_sparse_coo_rows_from_applied_dense_shape():
    acc = SparseConditionalAccumulator()
    acc.apply_grad(
        torch.sparse_coo_tensor(T([[1]]), T([[1.0, 2.0]]), (6, 2), check_invariants=True), 0
    )
    assert acc.take_sparse_coo(1).shape == (6, 2)
    acc.apply_indexed_slices_grad(T([1]), T([[1.0, 2.0]]), 1)
    assert acc.take_sparse_coo(1).shape == (2, 2)  # largest index + 1
    acc.apply_indexed_slices_grad(T([1]), T([[1.0, 2.0]]), 2)
    assert acc.take_sparse_coo(1, num_rows=4).shape == (4, 2)


def test_indexed_slices_round_trip():
    acc = SparseConditionalAccumulator(shape=(None, 2), reduction="sum")
    apply_ab(acc)
    out = acc.take_grad(2)
    again = SparseConditionalAccumulator(shape=(None, 2), reduction="sum")
    again.apply_grad(out, 0)
    assert_close(again.take_grad(1).values, out.values)


@pytest.mark.parametrize(
    ("grad", "match"),
    [
        (
            lambda: torch.ones(2, 2),
            r"grad: expected a sparse COO tensor or an IndexedSlices, got a tensor "
            r"with layout torch.strided",
        ),
        (lambda: "x", r"grad: expected a torch.Tensor"),
    ],
)
def test_apply_grad_requires_sparse(grad, match):
    acc = SparseConditionalAccumulator()
    with pytest.raises(TypeError, match=r"apply_grad\(grad, local_step=0\): " + match):
        acc.apply_grad(grad(), 0)


def test_apply_requires_local_step():
    acc = SparseConditionalAccumulator()
    with pytest.raises(TypeError, match=r"local_step: expected the number of takes"):
        acc.apply_indexed_slices_grad(*slices_a())
    with pytest.raises(TypeError, match=r"TensorFlow's default local_step=0"):
        acc.apply_grad(torch.ones(2, 2).to_sparse(1))


def test_dense_shape_must_match_values():
    acc = SparseConditionalAccumulator()
    with pytest.raises(
        ValueError,
        match=r"dense_shape: expected rank 2 with dims 1.. equal to "
        r"values.shape\[1:\] = \(2,\), got \(3, 3\)",
    ):
        acc.apply_indexed_slices_grad(*slices_a(), 0, dense_shape=(3, 3))
    with pytest.raises(ValueError, match=r"expected row indices < 1 \(dense_shape\[0\]\)"):
        acc.apply_indexed_slices_grad(*slices_a(), 0, dense_shape=(1, 2))
    with pytest.raises(TypeError, match=r"dense_shape: expected a sequence of ints >= 0"):
        acc.apply_indexed_slices_grad(*slices_a(), 0, dense_shape=(-1, 2))


def test_invalid_reduction():
    with pytest.raises(ValueError, match=r"reduction: expected one of 'mean', 'row_mean', 'sum'"):
        SparseConditionalAccumulator(reduction="MEAN")


def test_copy_on_apply_and_fresh_results():
    acc = SparseConditionalAccumulator(reduction="sum")
    idx, vals = T([0]), T([[1.0, 2.0]])
    acc.apply_indexed_slices_grad(idx, vals, 0)
    vals.fill_(100.0)
    out = acc.take_grad(1)
    assert out.values.tolist() == [[1.0, 2.0]]
    out.values.fill_(-1.0)
    acc.apply_indexed_slices_grad(T([0]), T([[3.0, 3.0]]), 1)
    assert acc.take_grad(1).values.tolist() == [[3.0, 3.0]]


def test_blocking_take_timeout_and_close():
    acc = SparseConditionalAccumulator()
    taker = Background(acc.take_grad, 2, timeout=5.0)
    wait_until(lambda: acc.num_waiting == 1)
    apply_ab(acc)
    assert taker.result().indices.tolist() == [0, 1, 2]
    with pytest.raises(TakeTimeout, match=r"take_grad\(num_required=1\): timed out"):
        acc.take_grad(1, timeout=0.01)
    acc.close()
    with pytest.raises(AccumulatorClosed):
        acc.take_sparse_coo(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_dtypes(dtype):
    acc = SparseConditionalAccumulator(dtype=dtype)
    for v in range(10):
        acc.apply_indexed_slices_grad(T([0]), T([[float(v)]], dtype=dtype), 0)
    out = acc.take_grad(1)
    assert out.values.dtype == dtype and out.values.item() == 4.5


def test_state_dict_round_trip():
    acc = SparseConditionalAccumulator(shape=(None, 2), reduction="row_mean")
    apply_ab(acc)
    buf = io.BytesIO()
    torch.save(acc.state_dict(), buf)
    buf.seek(0)
    other = SparseConditionalAccumulator(shape=(None, 2), reduction="row_mean")
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.num_accumulated == 2
    assert other.take_grad(1).values.tolist() == [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]]
    empty = SparseConditionalAccumulator(shape=(None, 2), reduction="row_mean")
    other.load_state_dict(empty.state_dict())
    assert other.num_accumulated == 0 and other.global_step == 0
    with pytest.raises(
        ValueError,
        match=r"state\['kind'\]: expected "
        r"'SparseConditionalAccumulator', got 'ConditionalAccumulator'",
    ):
        other.load_state_dict(ConditionalAccumulator(shape=(None, 2)).state_dict())


def test_indexed_slices_to_dense_and_coo():
    s = IndexedSlices(T([1, 3]), T([[1.0], [2.0]]), (-1, 1))
    assert s.to_dense().flatten().tolist() == [0.0, 1.0, 0.0, 2.0]
    assert s.to_sparse_coo(num_rows=6).shape == (6, 1)
    known = IndexedSlices(T([1]), T([[1.0]]), (3, 1))
    assert known.to_dense(num_rows=10).shape == (3, 1)  # a known dense_shape wins


def _tf_forms_take(apply) -> torch.Tensor:
    acc = SparseConditionalAccumulator(shape=(5, 3), reduction="sum")
    apply(acc, torch.tensor([0, 3, 3]), torch.arange(9.0).view(3, 3))
    apply(acc, torch.tensor([4]), torch.ones(1, 3))
    return acc.take_grad(2).to_dense(5)


@pytest.mark.parametrize(
    "apply",
    [
        lambda a, i, v: a.apply_grad(i, v, local_step=0),
        lambda a, i, v: a.apply_grad(i, v, (5, 3), 0),
        lambda a, i, v: a.apply_grad(
            grad_indices=i, grad_values=v, grad_shape=[5, 3], local_step=0
        ),
        lambda a, i, v: a.apply_grad(i, grad_values=v, local_step=0),
        lambda a, i, v: a.apply_indexed_slices_grad(IndexedSlices(i, v, (5, 3)), 0),
        lambda a, i, v: a.apply_indexed_slices_grad(IndexedSlices(i, v, (5, 3)), local_step=0),
        lambda a, i, v: a.apply_grad(IndexedSlices(i, v, (5, 3)), 0),
        lambda a, i, v: a.apply_grad(
            torch.sparse_coo_tensor(i[None], v, (5, 3), check_invariants=True), local_step=0
        ),
    ],
    ids=[
        "tf-positional",
        "tf-all-positional",
        "tf-keywords",
        "tf-mixed",
        "slices",
        "slices-kw",
        "slices-apply_grad",
        "coo",
    ],
)
def test_tensorflow_call_forms_sum_like_the_dense_gradients(apply) -> None:
    want = torch.zeros(5, 3)
    want.index_add_(0, torch.tensor([0, 3, 3]), torch.arange(9.0).view(3, 3))
    want[4] += 1
    # the accumulator lives on the CPU (its default device)
    torch.testing.assert_close(_tf_forms_take(apply), want.cpu(), rtol=0, atol=0)


def test_tensorflow_form_with_a_stale_step_is_dropped_and_wrong_mixes_are_named() -> None:
    acc = SparseConditionalAccumulator(shape=(5, 3))
    acc.apply_grad(torch.tensor([0]), torch.ones(1, 3), local_step=0)
    acc.take_grad(1)
    assert acc.apply_grad(torch.tensor([0]), torch.ones(1, 3), local_step=0) is False
    with pytest.raises(TypeError, match="grad_shape"):
        acc.apply_grad(
            torch.sparse_coo_tensor(
                torch.tensor([[0]]), torch.ones(1, 3), (5, 3), check_invariants=True
            ),
            1,
            grad_shape=(5, 3),
        )
    with pytest.raises(TypeError, match="twice"):
        acc.apply_grad(
            torch.tensor([0]), torch.ones(1, 3), grad_values=torch.ones(1, 3), local_step=1
        )
    with pytest.raises(TypeError, match="local_step"):
        acc.apply_grad(IndexedSlices(torch.tensor([0]), torch.ones(1, 3), (5, 3)), 1, 2)


def test_tensorflow_form_takes_python_lists_as_tensorflow_does():
    """``apply_grad([1], [[1., 2.]], local_step=0)``, TensorFlow's form with lists (which it
    converts), raised "indices: expected a torch.Tensor"; float rows are still refused."""
    from_lists = SparseConditionalAccumulator(shape=(4, 2))
    from_tensors = SparseConditionalAccumulator(shape=(4, 2))
    assert from_lists.apply_grad([1, 3], [[1, 2], [3.5, 4]], None, 0)
    assert from_lists.apply_grad([3], [[1.0, 1.0]], local_step=0)
    assert from_tensors.apply_grad(
        torch.tensor([1, 3]), torch.tensor([[1.0, 2.0], [3.5, 4.0]]), None, 0
    )
    assert from_tensors.apply_grad(torch.tensor([3]), torch.tensor([[1.0, 1.0]]), local_step=0)
    a, b = from_lists.take_grad(2), from_tensors.take_grad(2)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert a.values.dtype == torch.float32
    with pytest.raises(TypeError, match="indices: expected an int32 or int64 tensor"):
        from_lists.apply_grad([1.5], [[1.0, 2.0]], local_step=5)

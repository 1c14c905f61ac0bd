"""Bad inputs to gradkit.accumulate: Accumulator, split_batch, the sizing helpers and the
conditional accumulators. A failing call must leave weights, optimizer state, accumulated
gradients and the accumulators' aggregates as they were."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.accumulate import (
    Accumulator,
    AdaptiveBatchSize,
    ConditionalAccumulator,
    DistributedConditionalAccumulator,
    IndexedSlices,
    SparseConditionalAccumulator,
    activation_bytes,
    find_micro_batch_size,
    split_batch,
)

from ._case import Case


class _Fixture:
    """State built on first use and shared by a row's ``run`` and ``unchanged``."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build, self._state = build, None

    def __call__(self) -> Any:
        if self._state is None:
            self._state = self._build()
        return self._state


# ------------------------------------------------------------------------------ Accumulator
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _x() -> torch.Tensor:
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(7, 3, dtype=torch.float64, generator=gen)


def _y() -> torch.Tensor:
    gen = torch.Generator(torch.get_default_device()).manual_seed(2)
    return torch.randn(7, 2, dtype=torch.float64, generator=gen)


def _loss(model: nn.Module, lo: int, hi: int) -> torch.Tensor:
    return ((model(_x()[lo:hi]) - _y()[lo:hi]) ** 2).sum()


def _open_window(
    count: int = 3, **kwargs: Any
) -> tuple[nn.Module, torch.optim.Optimizer, Accumulator]:
    """A model whose Adam has stepped once, and an accumulator with one micro-step of
    ``count`` examples (``_x()[2:2 + count]``) in its open window."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, **kwargs)
    with acc.micro_step(count=2):
        acc.backward(_loss(model, 0, 2))
    acc.step()
    with acc.micro_step(count=count):
        acc.backward(_loss(model, 2, 2 + count))
    return model, opt, acc


def _user_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


def _acc_row(
    id: str,
    act: Callable[[nn.Module, torch.optim.Optimizer, Accumulator], object],
    raises: type[BaseException],
    words: Sequence[str],
    **kwargs: Any,
) -> Case:
    fx = _Fixture(lambda: _open_window(**kwargs))
    return Case(
        id=id,
        run=lambda: act(*fx()),
        raises=raises,
        words=words,
        unchanged=lambda: _user_state(*fx()[:2]),
    )


def _build(**kwargs: Any) -> Callable[[], object]:
    def run() -> object:
        model = _model()
        return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)

    return run


def _micro(acc: Accumulator, model: nn.Module, count: Any, lo: int = 0, hi: int = 2) -> None:
    with acc.micro_step(count=count):
        acc.backward(_loss(model, lo, hi))


def _other_optimizer() -> object:
    model, other = _model(), _model()
    return Accumulator(model, torch.optim.SGD(other.parameters(), lr=0.1))


def _frozen() -> object:
    model = _model().requires_grad_(False)
    return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _scheduler_of_other_optimizer() -> object:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    return Accumulator(model, opt, scheduler=sched)


def _no_backward(model: nn.Module, opt: torch.optim.Optimizer, acc: Accumulator) -> None:
    with acc.micro_step(count=2):
        _loss(model, 0, 2)


def _backward_of(loss: Callable[[nn.Module], Any]) -> Callable[..., None]:
    def act(model: nn.Module, opt: torch.optim.Optimizer, acc: Accumulator) -> None:
        with acc.micro_step(count=2):
            acc.backward(loss(model))

    return act


def _nested(model: nn.Module, opt: torch.optim.Optimizer, acc: Accumulator) -> None:
    with acc.micro_step(count=1), acc.micro_step(count=1):
        pass


def _step_inside(model: nn.Module, opt: torch.optim.Optimizer, acc: Accumulator) -> None:
    with acc.micro_step(count=0):
        acc.step()


def _stale_grads() -> None:
    model = _model()
    _loss(model, 0, 2).backward()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _micro(acc, model, 2)


def _full_batch(model: nn.Module, lo: int, hi: int, n: float) -> list[torch.Tensor]:
    return [g.detach() for g in torch.autograd.grad(_loss(model, lo, hi) / n, model.parameters())]


def _close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], rtol: float = 1e-12) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


class _Keep(torch.optim.SGD):
    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.0)
        self.got: list[torch.Tensor] = []

    def step(self, closure: Any = None) -> Any:
        self.got = [p.grad.clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def _exact_float64_clipped() -> None:
    model = _model()
    want = _full_batch(model, 0, 7, 7)
    norm = float(torch.cat([g.reshape(-1) for g in want]).norm())
    opt = _Keep(model.parameters())
    acc = Accumulator(model, opt, max_grad_norm=norm / 2)
    for lo, hi in [(0, 3), (3, 5), (5, 7)]:
        _micro(acc, model, torch.tensor(hi - lo), lo, hi)  # a tensor count is fine
    result = acc.step()
    assert result.grad_norm is not None and abs(result.grad_norm / norm - 1) < 1e-12
    _close(opt.got, [g / 2 for g in want])


def _empty_micro_batch() -> None:
    model = _model()
    want = _full_batch(model, 0, 7, 7)
    opt = _Keep(model.parameters())
    acc = Accumulator(model, opt)
    for lo, hi in [(0, 4), (4, 4), (4, 7)]:
        _micro(acc, model, hi - lo, lo, hi)
    acc.step()
    _close(opt.got, want)


def _nan_count_skips() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _micro(acc, model, 2)
    _micro(acc, model, math.nan, 2, 4)
    result = acc.step()
    assert not result.stepped and result.skipped_reason == "non-finite or negative count"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def _subset_optimizer() -> None:
    model = _model()
    want = _full_batch(model, 0, 7, 7)[2:]
    model[0].requires_grad_(False)
    opt = _Keep(model[2].parameters())
    acc = Accumulator(model, opt)
    for part in acc.split((_x(), _y()), num_micro_batches=3):
        with acc.micro_step():
            acc.backward(((model(part[0]) - part[1]) ** 2).sum())
    acc.step()
    _close(opt.got, want)


def _split_parts() -> None:
    parts = split_batch(torch.arange(10), num_micro_batches=6)
    assert [len(p) for p in parts] == [2, 2, 2, 2, 1, 1]
    assert torch.equal(torch.cat(parts), torch.arange(10))


def _acc_split(batch: Callable[[], Any], **kwargs: Any) -> Callable[[], object]:
    def run() -> object:
        model = _model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return list(acc.split(batch(), **kwargs))

    return run


# ---------------------------------------------------------------------------- sizing helpers
def _sum_loss(m: nn.Module, b: Any) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1], reduction="sum")


def _sizing(
    batch: Callable[[], Any] = lambda: (_x(), _y()),
    model: Callable[[], Any] = _model,
    loss_fn: Any = _sum_loss,
    **kwargs: Any,
) -> Callable[[], object]:
    def run() -> object:
        return find_micro_batch_size(model(), loss_fn, batch(), **kwargs)

    return run


def _bn_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).double()
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    activation_bytes(model, lambda m, b: m(b).sum(), _x())
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


def _abs(**kwargs: Any) -> Callable[[], object]:
    return lambda: AdaptiveBatchSize(**{"micro_batch_size": 4, **kwargs})


# ----------------------------------------------------------------------- conditional accumulators
def _dense_state(acc: ConditionalAccumulator) -> list[torch.Tensor]:
    s = acc.state_dict()
    return [s["aggregate"], torch.tensor([s["counter"], s["global_step"], s["num_dropped"]])]


def _dense_row(id: str, act: Callable[[Any], object], raises: type, words: Sequence[str]) -> Case:
    def build() -> ConditionalAccumulator:
        acc = ConditionalAccumulator(shape=(2,))
        acc.apply_grad(torch.tensor([1.0, 2.0]), local_step=0)
        return acc

    fx = _Fixture(build)
    return Case(id, lambda: act(fx()), raises, words, lambda: _dense_state(fx()))


def _sparse_state(acc: SparseConditionalAccumulator) -> list[torch.Tensor]:
    s = acc.state_dict()
    counters = torch.tensor([s["counter"], s["global_step"], s["num_dropped"]])
    return [s["indices"], s["values"], s["counts"], counters]


def _sparse_row(id: str, act: Callable[[Any], object], raises: type, words: Sequence[str]) -> Case:
    def build() -> SparseConditionalAccumulator:
        acc = SparseConditionalAccumulator(shape=(4, 2))
        acc.apply_indexed_slices_grad(torch.tensor([1]), torch.ones(1, 2), local_step=0)
        return acc

    fx = _Fixture(build)
    return Case(id, lambda: act(fx()), raises, words, lambda: _sparse_state(fx()))


def _slices(acc: Any, indices: Any, values: Any, **kwargs: Any) -> object:
    return acc.apply_indexed_slices_grad(indices, values, local_step=0, **kwargs)


def _hint_below_the_indices() -> None:
    acc = SparseConditionalAccumulator(reduction="sum")
    acc.apply_grad(torch.ones(3, 2).to_sparse(), local_step=0)  # dense_shape[0] = 3
    acc.apply_indexed_slices_grad(torch.tensor([5]), torch.ones(1, 2), local_step=0)
    got = acc.take_sparse_coo(1).to_dense()
    want = torch.zeros(6, 2)
    want[:3] += 1
    want[5] += 1
    assert torch.equal(got, want)


def _add_param_group_is_seen() -> None:
    model = _model()
    want = _full_batch(model, 0, 7, 7)
    opt = _Keep(model[2].parameters())
    acc = Accumulator(model, opt)
    opt.add_param_group({"params": list(model[0].parameters())})
    for lo, hi in [(0, 3), (3, 7)]:
        _micro(acc, model, hi - lo, lo, hi)
    acc.step()
    _close(opt.got, want[2:] + want[:2])


_META2 = torch.zeros(2, device="meta")
_A = "accumulate.Accumulator"
_C = "accumulate.ConditionalAccumulator"
_S = "accumulate.SparseConditionalAccumulator"

ROWS: list[Case] = [
    # Accumulator(...): types and values of the arguments
    Case(f"{_A}.max_grad_norm_str", _build(max_grad_norm="1.0"), TypeError,
         ("max_grad_norm", "positive number", "'1.0'")),
    Case(f"{_A}.max_grad_norm_bool", _build(max_grad_norm=True), TypeError,
         ("max_grad_norm", "got true")),
    Case(f"{_A}.max_grad_norm_nan", _build(max_grad_norm=math.nan), ValueError,
         ("max_grad_norm", "nan")),
    Case(f"{_A}.normalize_mean", _build(normalize="mean"), ValueError,
         ("normalize", "'examples', 'tokens', 'sum'", "'mean'")),
    Case(f"{_A}.skip_nonfinite_str", _build(skip_nonfinite="no"), TypeError,
         ("skip_nonfinite", "true or false", "'no'")),
    Case(f"{_A}.scaler_not_a_scaler", _build(scaler=1.0), TypeError,
         ("scaler", "gradscaler", "1.0")),
    Case(f"{_A}.scheduler_not_a_scheduler", _build(scheduler=1), TypeError,
         ("scheduler", "step()", "got 1")),
    Case(f"{_A}.scheduler_of_another_optimizer", _scheduler_of_other_optimizer, ValueError,
         ("scheduler", "same optimizer")),
    Case(f"{_A}.model_list",
         lambda: Accumulator([_model()], torch.optim.SGD(_model().parameters())),
         TypeError, ("model", "torch.nn.Module", "list")),
    Case(f"{_A}.optimizer_params_list",
         lambda: Accumulator(_model(), list(_model().parameters())), TypeError,
         ("optimizer", "torch.optim.Optimizer", "list")),
    Case(f"{_A}.optimizer_of_another_model", _other_optimizer, ValueError,
         ("optimizer", "none of them", "sequential", "model.parameters()")),
    Case(f"{_A}.all_parameters_frozen", _frozen, ValueError,
         ("model", "trainable parameters", "requires_grad")),
    Case(f"{_A}.meta_parameters",
         lambda: Accumulator(nn.Linear(2, 2, device="meta"),
                             torch.optim.SGD(nn.Linear(2, 2, device="meta").parameters())),
         ValueError, ("optimizer", "meta device", "to_empty")),
    # micro_step / backward / step: each failing call leaves the user's state as it was
    _acc_row(f"{_A}.count_str", lambda m, o, a: _micro(a, m, "3"), TypeError,
             ("count", "a number", "'3'")),
    _acc_row(f"{_A}.count_bool", lambda m, o, a: _micro(a, m, True), TypeError,
             ("count", "got true")),
    _acc_row(f"{_A}.count_vector", lambda m, o, a: _micro(a, m, torch.tensor([1, 2])), TypeError,
             ("count", "one-element", "shape=(2,)")),
    _acc_row(f"{_A}.count_nan_no_skip", lambda m, o, a: _micro(a, m, math.nan), ValueError,
             ("count", "finite number >= 0", "nan", "skip_nonfinite"), skip_nonfinite=False),
    _acc_row(f"{_A}.count_negative_no_skip", lambda m, o, a: _micro(a, m, -2), ValueError,
             ("count", "finite number >= 0", "-2"), skip_nonfinite=False),
    _acc_row(f"{_A}.count_missing_tokens", lambda m, o, a: _micro(a, m, None), ValueError,
             ("count", "number of tokens", "none"), normalize="tokens"),
    _acc_row(f"{_A}.backward_outside_micro_step",
             lambda m, o, a: a.backward(_loss(m, 0, 1)), GradkitError,
             ("backward", "inside", "micro_step")),
    _acc_row(f"{_A}.backward_vector_loss",
             _backward_of(lambda m: m(_x()[:2]).sum(1)), ValueError,
             ("loss", "scalar tensor", "shape=(2,)", ".sum()")),
    _acc_row(f"{_A}.backward_detached_loss",
             _backward_of(lambda m: _loss(m, 0, 2).detach()), ValueError,
             ("loss", "requires_grad", "does not require grad")),
    _acc_row(f"{_A}.backward_int_loss", _backward_of(lambda m: torch.tensor(3)), TypeError,
             ("loss", "floating-point", "int64")),
    _acc_row(f"{_A}.backward_not_a_tensor", _backward_of(lambda m: 3.0), ValueError,
             ("loss", "scalar tensor", "3.0")),
    _acc_row(f"{_A}.micro_step_without_backward", _no_backward, GradkitError,
             ("without acc.backward", "count=0", "nothing was added")),
    _acc_row(f"{_A}.nested_micro_steps", _nested, GradkitError, ("do not nest",)),
    _acc_row(f"{_A}.step_inside_micro_step", _step_inside, GradkitError,
             ("step()", "inside a micro_step")),
    _acc_row(f"{_A}.step_of_a_zero_count_window", lambda m, o, a: a.step(), GradkitError,
             ("count", "is 0", "acc.reset()", "nothing was changed"), count=0),
    Case(f"{_A}.stale_gradients_before_the_first_window", _stale_grads, GradkitError,
         ("already hold gradients", "zero_grad")),
    Case(f"{_A}.split_mismatched_lengths",
         _acc_split(lambda: (_x(), _y()[:5]), micro_batch_size=2), ValueError,
         ("batch[0]: 7", "batch[1]: 5", "same length")),
    # answers that must be right (checked against the full-batch gradient)
    Case(f"{_A}.float64_exact_with_clipping", _exact_float64_clipped),
    Case(f"{_A}.empty_micro_batch_adds_nothing", _empty_micro_batch),
    Case(f"{_A}.nan_count_skips_the_window", _nan_count_skips),
    Case(f"{_A}.optimizer_over_part_of_the_model", _subset_optimizer),
    Case(f"{_A}.param_group_added_after_construction", _add_param_group_is_seen),
    # split_batch
    Case("accumulate.split_batch.mismatched_lengths",
         lambda: split_batch((torch.zeros(5, 2), torch.zeros(3)), micro_batch_size=2),
         ValueError, ("batch", "batch[0]: 5", "batch[1]: 3", "same length")),
    Case("accumulate.split_batch.zero_dim_leaf",
         lambda: split_batch({"x": torch.zeros(3), "w": torch.tensor(1.0)}, micro_batch_size=2),
         ValueError, ("batch['w']", "0-dimensional", "dimension 0")),
    Case("accumulate.split_batch.empty_dict", lambda: split_batch({}, micro_batch_size=2),
         TypeError, ("batch", "tuple, list or dict of tensors", "{}")),
    Case("accumulate.split_batch.num_micro_batches_zero",
         lambda: split_batch(torch.zeros(4), num_micro_batches=0), ValueError,
         ("num_micro_batches", "an int", "0")),
    Case("accumulate.split_batch.num_micro_batches_float",
         lambda: split_batch(torch.zeros(4), num_micro_batches=2.5), TypeError,
         ("num_micro_batches", "an int", "2.5")),
    Case("accumulate.split_batch.micro_batch_size_bool",
         lambda: split_batch(torch.zeros(4), micro_batch_size=True), TypeError,
         ("micro_batch_size", "an int", "true")),
    Case("accumulate.split_batch.both_sizes",
         lambda: split_batch(torch.zeros(4), micro_batch_size=2, num_micro_batches=2),
         ValueError, ("micro_batch_size / num_micro_batches", "exactly one")),
    Case("accumulate.split_batch.nearly_equal_parts", _split_parts),
    # find_micro_batch_size / activation_bytes
    Case("accumulate.find_micro_batch_size.negative_budget", _sizing(budget_bytes=-5),
         ValueError, ("budget_bytes", "> 0", "-5")),
    Case("accumulate.find_micro_batch_size.budget_str", _sizing(budget_bytes="1e6"),
         TypeError, ("budget_bytes", "'1e6'")),
    Case("accumulate.find_micro_batch_size.budget_below_one_example", _sizing(budget_bytes=1),
         ValueError, ("budget_bytes", "micro-batch of 1 example", "raise the budget")),
    Case("accumulate.find_micro_batch_size.max_size_zero",
         _sizing(budget_bytes=10**6, max_size=0), ValueError, ("max_size", "an int", "0")),
    Case("accumulate.find_micro_batch_size.model_list",
         _sizing(budget_bytes=10**6, model=lambda: [nn.Linear(3, 2)]), TypeError,
         ("model", "torch.nn.Module", "list")),
    Case("accumulate.find_micro_batch_size.loss_fn_not_callable",
         _sizing(budget_bytes=10**6, loss_fn="mse"), TypeError, ("loss_fn", "callable", "'mse'")),
    Case("accumulate.find_micro_batch_size.loss_fn_returns_a_vector",
         _sizing(budget_bytes=10**6, loss_fn=lambda m, b: m(b[0]).sum(1)), ValueError,
         ("loss_fn", "scalar loss", "shape=(")),
    Case("accumulate.find_micro_batch_size.mismatched_batch",
         _sizing(budget_bytes=10**6, batch=lambda: (_x(), _y()[:3])), ValueError,
         ("batch[0]: 7", "batch[1]: 3")),
    Case("accumulate.activation_bytes.model_list",
         lambda: activation_bytes([nn.Linear(3, 2)], _sum_loss, (_x(), _y())), TypeError,
         ("activation_bytes", "model", "torch.nn.Module")),
    Case("accumulate.activation_bytes.leaves_batchnorm_and_rng_untouched", _bn_untouched),
    # AdaptiveBatchSize
    Case("accumulate.AdaptiveBatchSize.micro_batch_size_zero", _abs(micro_batch_size=0),
         ValueError, ("micro_batch_size", "an int", "0")),
    Case("accumulate.AdaptiveBatchSize.micro_batch_size_str", _abs(micro_batch_size="8"),
         TypeError, ("micro_batch_size", "an int", "'8'")),
    Case("accumulate.AdaptiveBatchSize.min_micro_float", _abs(min_micro=1.5), TypeError,
         ("min_micro", "an int", "1.5")),
    Case("accumulate.AdaptiveBatchSize.max_micro_inf", _abs(max_micro=math.inf), TypeError,
         ("max_micro", "an int", "inf")),
    Case("accumulate.AdaptiveBatchSize.smoothing_str", _abs(smoothing="0.5"), TypeError,
         ("smoothing", "[0, 1)", "'0.5'")),
    Case("accumulate.AdaptiveBatchSize.smoothing_one", _abs(smoothing=1.0), ValueError,
         ("smoothing", "[0, 1)", "1.0")),
    Case("accumulate.AdaptiveBatchSize.cabs_lr_str", _abs(rule="cabs", lr="0.1"), TypeError,
         ("lr", "learning rate", "'0.1'")),
    Case("accumulate.AdaptiveBatchSize.update_empty_stats", lambda: _abs()().update({}),
         TypeError, ("stats", "per_example.track", "nothing was tracked")),
    Case("accumulate.AdaptiveBatchSize.update_list", lambda: _abs()().update([1.0]),
         TypeError, ("stats", "per_example.track", "list")),
    # ConditionalAccumulator: a failing apply leaves the aggregate and counters unchanged
    _dense_row(f"{_C}.apply_grad_meta", lambda a: a.apply_grad(_META2, local_step=0),
               ValueError, ("grad", "tensor with data", "meta device", "nothing was added")),
    _dense_row(f"{_C}.apply_grad_int", lambda a: a.apply_grad(torch.ones(2, dtype=torch.int64), 0),
               TypeError, ("grad.dtype", "torch.float32", "torch.int64")),
    _dense_row(f"{_C}.apply_grad_float64_into_float32",
               lambda a: a.apply_grad(torch.ones(2, dtype=torch.float64), 0), TypeError,
               ("grad.dtype", "without loss", "torch.float64")),
    _dense_row(f"{_C}.apply_grad_wrong_shape", lambda a: a.apply_grad(torch.ones(3), 0),
               ValueError, ("grad", "shape (2,)", "shape (3,)", "nothing was added")),
    _dense_row(f"{_C}.apply_grad_list", lambda a: a.apply_grad([1.0, 2.0], 0), TypeError,
               ("grad", "torch.tensor", "list")),
    _dense_row(f"{_C}.apply_grad_sparse", lambda a: a.apply_grad(torch.ones(2).to_sparse(), 0),
               TypeError, ("grad", "dense", "sparse_coo", "sparseconditionalaccumulator")),
    _dense_row(f"{_C}.local_step_bool", lambda a: a.apply_grad(torch.ones(2), True), TypeError,
               ("local_step", "an int", "true")),
    _dense_row(f"{_C}.local_step_meta",
               lambda a: a.apply_grad(torch.ones(2), torch.tensor(0, device="meta")), TypeError,
               ("local_step", "meta device")),
    _dense_row(f"{_C}.take_grad_zero", lambda a: a.take_grad(0), ValueError,
               ("num_required", "positive int", "nothing was consumed")),
    _dense_row(f"{_C}.take_grad_bool", lambda a: a.take_grad(True), TypeError,
               ("num_required", "an int", "true")),
    _dense_row(f"{_C}.take_grad_negative_timeout", lambda a: a.take_grad(1, timeout=-1),
               ValueError, ("timeout", "seconds >= 0", "-1")),
    Case(f"{_C}.device_gpu", lambda: ConditionalAccumulator((2,), device="gpu"), ValueError,
         ("device", "device string", "'gpu'")),
    Case(f"{_C}.device_meta", lambda: ConditionalAccumulator((2,), device="meta"), ValueError,
         ("device", "holds data", "'meta'")),
    Case(f"{_C}.device_unavailable", lambda: ConditionalAccumulator((2,), device="cuda:99"),
         ValueError, ("device", "available", "cuda:99")),
    Case(f"{_C}.dtype_int", lambda: ConditionalAccumulator((2,), dtype=torch.int64), TypeError,
         ("dtype", "floating or complex", "torch.int64")),
    Case(f"{_C}.shape_negative", lambda: ConditionalAccumulator((2, -1)), ValueError,
         ("shape", "ints >= 0", "(2, -1)")),
    Case("accumulate.DistributedConditionalAccumulator.poll_interval_str",
         lambda: DistributedConditionalAccumulator((2,), poll_interval="fast"), TypeError,
         ("poll_interval", "seconds", "'fast'")),
    # SparseConditionalAccumulator
    _sparse_row(f"{_S}.values_meta",
                lambda a: _slices(a, torch.tensor([0]), torch.ones(1, 2, device="meta")),
                ValueError, ("values", "tensor with data", "meta device")),
    _sparse_row(f"{_S}.indices_meta",
                lambda a: _slices(a, torch.tensor([0], device="meta"), torch.ones(1, 2)),
                ValueError, ("indices", "tensor with data", "meta device")),
    _sparse_row(f"{_S}.values_wrong_row_shape",
                lambda a: _slices(a, torch.tensor([0]), torch.ones(1, 3)), ValueError,
                ("values", "rows of shape (2,)", "(3,)", "nothing was added")),
    _sparse_row(f"{_S}.values_float64", lambda a: _slices(
                a, torch.tensor([0]), torch.ones(1, 2, dtype=torch.float64)), TypeError,
                ("values.dtype", "torch.float32", "torch.float64")),
    _sparse_row(f"{_S}.index_out_of_range",
                lambda a: _slices(a, torch.tensor([4]), torch.ones(1, 2)), ValueError,
                ("indices", "< 4", "index 4")),
    _sparse_row(f"{_S}.float_indices",
                lambda a: _slices(a, torch.tensor([0.0]), torch.ones(1, 2)), TypeError,
                ("indices", "int32 or int64", "float32")),
    _sparse_row(f"{_S}.uint8_indices",
                lambda a: _slices(a, torch.tensor([1], dtype=torch.uint8), torch.ones(1, 2)),
                TypeError, ("indices", "int32 or int64", "uint8")),
    _sparse_row(f"{_S}.indexed_slices_of_lists",
                lambda a: a.apply_grad(IndexedSlices([0], [[1.0, 1.0]], (4, 2)), 0), TypeError,
                ("grad.indices", "torch.tensor", "list")),
    _sparse_row(f"{_S}.coo_meta",
                lambda a: a.apply_grad(torch.ones(4, 2).to_sparse().to("meta"), 0), ValueError,
                ("grad", "tensor with data", "meta device")),
    _sparse_row(f"{_S}.coo_zero_dim",
                lambda a: a.apply_grad(torch.ones(()).to_sparse(), 0), ValueError,
                ("grad", "0-dimensional", "at least one dimension")),
    _sparse_row(f"{_S}.take_sparse_coo_num_rows_str",
                lambda a: a.take_sparse_coo(1, num_rows="4"), TypeError,
                ("num_rows", "int >= 0", "'4'", "nothing was consumed")),
    Case(f"{_S}.take_sparse_coo_rows_cover_every_index", _hint_below_the_indices),
    Case("accumulate.IndexedSlices.to_dense_num_rows_too_small",
         lambda: IndexedSlices(torch.tensor([0, 2]), torch.ones(2, 1), (-1, 1)).to_dense(2),
         ValueError, ("num_rows", ">= 3", "got 2")),
    _sparse_row(f"{_S}.dense_grad", lambda a: a.apply_grad(torch.ones(4, 2), 0), TypeError,
                ("grad", "sparse coo", "strided")),
]  # fmt: skip

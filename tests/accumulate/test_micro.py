"""Exact micro-batch accumulation: the accumulated gradient equals the full-batch gradient."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradkit
from gradkit import GradkitError
from gradkit.accumulate import Accumulator, split_batch
from gradkit.testing import assert_close


def model_fn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


class Capture(torch.optim.SGD):
    """An SGD with lr=0 that records the gradient it was asked to apply."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def full_batch(model, loss_of):
    model.zero_grad()
    loss_of(model).backward()
    out = grads(model)
    model.zero_grad()
    return out


@pytest.mark.parametrize("sizes", [[5, 3], [1, 7], [3, 3, 2], [8]])
def test_example_mean_unequal_micro_batches(sizes):
    model = model_fn()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    want = full_batch(model, lambda m: F.mse_loss(m(x), y, reduction="none").sum(1).mean())
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt)
    start = 0
    for s in sizes:
        xb, yb = x[start : start + s], y[start : start + s]
        with acc.micro_step(count=s):
            acc.backward(F.mse_loss(model(xb), yb, reduction="none").sum())
        start += s
    result = acc.step()
    assert result.count == 8 and result.micro_steps == len(sizes) and result.stepped
    assert_close(opt.seen[0], want, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_naive_mean_over_micro_batches_is_wrong_for_unequal_sizes():
    # the trap this class exists for: averaging per-micro-batch means
    model = model_fn()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    want = full_batch(model, lambda m: F.mse_loss(m(x), y))
    for xb, yb in [(x[:5], y[:5]), (x[5:], y[5:])]:
        (F.mse_loss(model(xb), yb) / 2).backward()
    naive = grads(model)
    assert max((a - b).abs().max() for a, b in zip(naive, want, strict=True)) > 1e-3


def test_token_mean_with_padding_via_split():
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 6), nn.Linear(6, 10)
    model = nn.Sequential(emb, nn.Tanh(), head)
    tokens = torch.randint(1, 10, (6, 7))
    labels = torch.randint(0, 10, (6, 7))
    lengths = torch.tensor([2, 7, 5, 1, 3, 6])
    labels[torch.arange(7)[None, :] >= lengths[:, None]] = -100  # padding

    def token_sum(m, t, lab):
        return F.cross_entropy(
            m(t).reshape(-1, 10), lab.reshape(-1), ignore_index=-100, reduction="sum"
        )

    want = full_batch(model, lambda m: token_sum(m, tokens, labels) / (labels != -100).sum())
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt, normalize="tokens")
    for t, lab in acc.split((tokens, labels), micro_batch_size=4):
        with acc.micro_step(count=int((lab != -100).sum())):
            acc.backward(token_sum(model, t, lab))
    assert acc.step().count == float(lengths.sum())
    assert_close(opt.seen[0], want, rtol=1e-6, atol=1e-7)


def test_short_last_window_is_its_own_mean():
    model = model_fn()
    x, y = torch.randn(10, 4), torch.randn(10, 2)
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt)
    for start in range(0, 10, 4):  # windows of 4, 4, 2 examples, micro-batches of 2
        for xb, yb in acc.split((x[start : start + 4], y[start : start + 4]), micro_batch_size=2):
            with acc.micro_step():
                acc.backward(F.mse_loss(model(xb), yb, reduction="sum"))
        acc.step()
    last = full_batch(model, lambda m: F.mse_loss(m(x[8:]), y[8:], reduction="sum") / 2)
    assert_close(opt.seen[-1], last, rtol=1e-6, atol=1e-7)


def test_clip_once_per_window_and_scheduler_once():
    model = model_fn()
    x, y = 10 * torch.randn(8, 4), torch.randn(8, 2)
    want = full_batch(model, lambda m: F.mse_loss(m(x), y, reduction="sum") / 8)
    total = torch.sqrt(sum((g**2).sum() for g in want))
    opt = Capture(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    acc = Accumulator(model, opt, max_grad_norm=0.5, scheduler=sched)
    for xb, yb in acc.split((x, y), num_micro_batches=3):
        with acc.micro_step():
            acc.backward(F.mse_loss(model(xb), yb, reduction="sum"))
    result = acc.step()
    assert result.grad_norm == pytest.approx(float(total), rel=1e-5)
    assert_close(opt.seen[0], [g * (0.5 / total) for g in want], rtol=1e-5, atol=1e-7)
    assert sched.last_epoch == 1


def test_nonfinite_window_is_skipped():
    model = model_fn()
    opt = Capture(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    acc = Accumulator(model, opt, scheduler=sched)
    with acc.micro_step(count=1):
        acc.backward(model(torch.full((1, 4), float("inf"))).sum())
    result = acc.step()
    assert not result.stepped and result.skipped_reason == "non-finite gradient"
    assert opt.seen == [] and sched.last_epoch == 0 and acc.skipped == 1
    assert all(p.grad is None for p in model.parameters())


def test_amp_grad_scaler_unscales_once(device):
    model = model_fn()
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    want = full_batch(model, lambda m: F.mse_loss(m(x), y, reduction="sum") / 6)
    opt = Capture(model.parameters())
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    acc = Accumulator(model, opt, scaler=scaler)
    for xb, yb in acc.split((x, y), micro_batch_size=4):
        with acc.micro_step():
            acc.backward(F.mse_loss(model(xb), yb, reduction="sum"))
    assert acc.step().stepped
    assert_close(opt.seen[0], want, rtol=1e-6, atol=1e-7)


def test_track_composes_over_the_window():
    model = model_fn().double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    ref = gradkit.testing.per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with gradkit.per_example.track(model, "variance", loss_reduction="sum") as stats:
        for xb, yb in acc.split((x, y), micro_batch_size=3):
            with acc.micro_step():
                acc.backward(((model(xb) - yb) ** 2).sum())
    acc.step()
    for name, g in ref.items():
        assert_close(stats[name].variance, g.var(0, unbiased=False))


def test_batchnorm_warns():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="BatchNorm1d in training mode"), acc.micro_step(2):
        acc.backward(model(torch.randn(2, 4)).sum())


class _FunctionalNorm(nn.Module):
    def __init__(self, instance: bool) -> None:
        super().__init__()
        self.instance = instance
        self.conv = nn.Conv1d(2, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.instance:  # statistics per example: exact
            return torch.nn.functional.instance_norm(h)
        return torch.nn.functional.batch_norm(h, None, None, training=True)


def test_a_functional_batch_norm_warns_and_an_instance_norm_does_not():
    """``F.batch_norm(training=True)`` outside a BatchNorm module uses the micro-batch's
    statistics too (31 % off the full batch); the loss's graph of the first backward says so."""
    for instance in (False, True):
        model = _FunctionalNorm(instance)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):  # the graph is read at the first backward only
                with acc.micro_step(3):
                    acc.backward(model(torch.randn(3, 2, 5)).pow(2).sum())
        texts = [str(w.message) for w in seen]
        assert texts == ([] if instance else [texts[0]])
        if not instance:
            assert "NativeBatchNormBackward0" in texts[0] and seen[0].filename == __file__


def test_errors():
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, normalize="tokens")
    with pytest.raises(GradkitError, match=r"inside `with acc.micro_step"):
        acc.backward(model(torch.randn(2, 4)).sum())
    with pytest.raises(GradkitError, match="no micro-step in this window"):
        acc.step()
    with pytest.raises(ValueError, match="count: expected the number of tokens"), acc.micro_step():
        pass
    with pytest.raises(ValueError, match="normalize: expected one of 'examples', 'tokens', 'sum'"):
        Accumulator(model, opt, normalize="mean")
    with pytest.raises(ValueError, match="max_grad_norm"):
        Accumulator(model, opt, max_grad_norm=0)
    with (
        pytest.raises(ValueError, match=r"loss: expected a scalar tensor"),
        acc.micro_step(count=2),
    ):
        acc.backward(model(torch.randn(2, 4)))
    model(torch.randn(2, 4)).sum().backward()  # stale gradients before the first window
    fresh = Accumulator(model, opt)
    with pytest.raises(GradkitError, match="already hold gradients"), fresh.micro_step(1):
        pass


def test_a_backward_outside_the_micro_steps_is_refused_in_every_window():
    """A stray loss.backward() between two windows would be added to the next one (its
    gradient 6 % off on a Linear); it is refused there as before the first window, and a
    window after acc.reset() is the full batch's again."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt)

    def window() -> list[torch.Tensor]:
        for part in acc.split((x, y), micro_batch_size=3):
            with acc.micro_step():
                acc.backward(F.mse_loss(model(part[0]), part[1], reduction="sum"))
        summed = [p.grad.clone() for p in model.parameters()]  # step() divides them by 8
        acc.step()
        return summed

    want = torch.autograd.grad(F.mse_loss(model(x), y, reduction="sum"), model.parameters())
    assert_close(window(), list(want))
    F.mse_loss(model(x), y).backward()  # outside any micro-step
    with pytest.raises(GradkitError, match="already hold gradients.*acc.reset()"):
        window()
    acc.reset()
    assert_close(window(), list(want))


def test_split_batch_splits_lists_of_one_value_per_example():
    """A string field as default_collate gives it (a list of n strings) goes with its
    examples; per-example weights in a list too. A tuple of values, and a list of another
    length, are shared by every micro-batch."""
    x = torch.arange(6.0)[:, None]
    texts = [f"t{i}" for i in range(6)]
    batch = {"x": x, "text": texts, "w": [0.5 * i for i in range(6)], "names": ("a", "b")}
    parts = split_batch(batch, micro_batch_size=4)
    assert [p["text"] for p in parts] == [texts[:4], texts[4:]]
    assert [p["w"] for p in parts] == [[0.0, 0.5, 1.0, 1.5], [2.0, 2.5]]
    assert all(p["names"] == ("a", "b") for p in parts)
    for p in parts:  # every value with its own example
        assert [f"t{int(v)}" for v in p["x"][:, 0]] == p["text"]
    shared = split_batch((x, ["a", "b", "c"]), num_micro_batches=3)
    assert all(p[1] == ["a", "b", "c"] for p in shared)


def test_split_batch_structures_and_errors():
    parts = split_batch({"x": torch.zeros(5, 2), "y": torch.ones(5)}, micro_batch_size=2)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 1]
    with pytest.raises(ValueError, match="exactly one of them"):
        split_batch(torch.zeros(3))
    with pytest.raises(TypeError, match="batch: expected a tensor"):
        split_batch(3, micro_batch_size=1)


def test_split_batch_keeps_a_namedtuple():
    """A namedtuple batch was rebuilt from one generator: a raw TypeError from its __new__."""
    from collections import namedtuple

    Batch = namedtuple("Batch", "x y")
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    parts = split_batch(Batch(x, y), micro_batch_size=2)
    assert all(type(p) is Batch for p in parts)
    assert [p.y.tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert torch.equal(torch.cat([p.x for p in parts]), x)


def test_split_batch_refuses_arrays_it_cannot_slice():
    """A NumPy array in the batch (per-example weights, say) was handed whole to every
    micro-batch: with micro-batches of one example it broadcast silently (5x off the weighted
    mean). Numbers and strings are still shared."""
    np = pytest.importorskip("numpy")
    x, y = torch.zeros(4, 2), torch.zeros(4)
    with pytest.raises(TypeError, match=r"batch\[2\]: .*ndarray of shape \(4,\).*as_tensor"):
        split_batch((x, y, np.ones(4)), micro_batch_size=1)
    with pytest.raises(TypeError, match=r"batch\['w'\]"):
        split_batch({"x": x, "w": np.ones((4, 1))}, num_micro_batches=2)
    parts = split_batch((x, "tag", 0.5, np.float64(2.0), None), micro_batch_size=3)
    assert [p[0].shape[0] for p in parts] == [3, 1] and parts[1][1:] == ("tag", 0.5, 2.0, None)


def test_step_under_a_float64_default_dtype_divides_float32_gradients_once():
    """With torch.set_default_dtype(torch.float64), the finite check of float32 gradients made
    float64 scale tensors, which AMP's kernel refuses: step() raised after dividing the float64
    gradients, and a retry divided them again (by the count squared)."""
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 4).double()
            self.b = nn.Linear(4, 2).float()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).float()).double()

    model = Mixed()
    x = torch.randn(6, 3, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    want = [p.grad / 6 for p in model.parameters()]
    model.zero_grad()
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with acc.micro_step(count=6):
            acc.backward(model(x).pow(2).sum())
        assert acc.step().stepped
    finally:
        torch.set_default_dtype(previous)
    for got, ref in zip(opt.seen[0], want, strict=True):
        assert_close(got, ref.to(got.dtype), rtol=1e-6, atol=1e-7)


def test_last_must_be_a_bool_or_none():
    model = nn.Linear(2, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with (
        pytest.raises(
            TypeError,
            match=r"Accumulator.micro_step\(count\): last: expected None, True or False, got "
            r"'yes'; pass a bool",
        ),
        acc.micro_step(count=1, last="yes"),
    ):
        pass
    with acc.micro_step(count=2, last=True):  # without FSDP it changes nothing
        acc.backward(model(torch.ones(2, 2)).sum())
    assert acc.step().count == 2

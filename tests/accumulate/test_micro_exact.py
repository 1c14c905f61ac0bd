"""Exactness in float64 (rtol 1e-12 against the full-batch gradient), counts that cannot
normalize a window, empty micro-batches and windows, and optimizers that do not cover the
model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.accumulate import Accumulator, split_batch

RTOL = 1e-12
SIZES = [3, 2, 2]  # N = 7: not a power of two


def lm(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Tanh(), nn.Linear(6, 11)).to(dtype)


def token_data():
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    tokens = torch.randint(1, 11, (7, 5), generator=g)
    labels = torch.randint(0, 11, (7, 5), generator=g)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1])
    labels[torch.arange(5)[None, :] >= lengths[:, None]] = -100  # padding
    return tokens, labels


def token_sum(model, t, lab):
    logits = model(t).reshape(-1, 11)
    return F.cross_entropy(logits, lab.reshape(-1), ignore_index=-100, reduction="sum")


class Capture(torch.optim.SGD):
    """SGD (lr 0 unless given) that records the gradient it was asked to apply."""

    def __init__(self, params, lr: float = 0.0):
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def full_batch_grads(model, loss):
    return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]


def close(got, want, rtol=RTOL):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


def run_window(model, opt, normalize, **kwargs):
    tokens, labels = token_data()
    acc = Accumulator(model, opt, normalize=normalize, **kwargs)
    start = 0
    for s in SIZES:
        t, lab = tokens[start : start + s], labels[start : start + s]
        count = s if normalize == "examples" else (lab != -100).sum()  # a tensor is fine
        with acc.micro_step(count=count):
            acc.backward(token_sum(model, t, lab))
        start += s
    return acc.step()


def want_of(normalize):
    tokens, labels = token_data()
    n = 7 if normalize == "examples" else int((labels != -100).sum())
    model = lm()
    return full_batch_grads(model, token_sum(model, tokens, labels) / n), n


@pytest.mark.parametrize("normalize", ["examples", "tokens"])
@pytest.mark.parametrize("max_grad_norm", [None, math.inf, 0.05])
def test_float64_window_equals_full_batch_to_1e_12(normalize, max_grad_norm):
    want, n = want_of(normalize)
    norm = float(torch.cat([g.reshape(-1) for g in want]).norm())
    model = lm()
    opt = Capture(model.parameters())
    result = run_window(model, opt, normalize, max_grad_norm=max_grad_norm)
    assert result.count == n and result.stepped
    if max_grad_norm is None:
        assert result.grad_norm is None
    else:
        assert result.grad_norm == pytest.approx(norm, rel=RTOL)
    factor = 1.0 if max_grad_norm is None or norm <= max_grad_norm else max_grad_norm / norm
    if max_grad_norm == 0.05:
        assert factor < 1  # the clipping case clips
    close(opt.seen[0], [g * factor for g in want])


def test_float64_with_a_non_power_of_two_amp_scale(device):
    want, _ = want_of("tokens")
    model = lm()
    opt = Capture(model.parameters())
    scaler = torch.amp.GradScaler(device.type, init_scale=1000.0)  # 1/1000 is inexact in float32
    assert run_window(model, opt, "tokens", scaler=scaler).stepped
    close(opt.seen[0], want)


def test_mixed_precision_model_keeps_float64_parameters_exact_when_clipping():
    torch.manual_seed(0)
    low, high = nn.Linear(4, 6), nn.Linear(6, 2).double()
    model = nn.ModuleDict({"low": low, "high": high})
    x, y = torch.randint(-4, 5, (7, 4)) / 4.0, torch.randn(7, 2, dtype=torch.float64)
    with torch.no_grad():  # float32 activations exact whatever the BLAS kernel of a batch size
        low.weight.copy_(torch.randint(-4, 5, low.weight.shape) / 4.0)
        low.bias.copy_(torch.randint(-4, 5, low.bias.shape) / 4.0)

    def loss(xb, yb):
        return ((high(torch.relu(low(xb)).double()) - yb) ** 2).sum()

    want = full_batch_grads(model, loss(x, y) / 7)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in want))
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt, max_grad_norm=norm / 3)
    for xb, yb in acc.split((x, y), num_micro_batches=3):
        with acc.micro_step():
            acc.backward(loss(xb, yb))
    result = acc.step()
    assert result.grad_norm == pytest.approx(norm, rel=1e-6)  # float32 terms: float32 digits
    factor = (norm / 3) / result.grad_norm  # applied as a double to the float64 gradients
    for got, w in zip(opt.seen[0], want, strict=True):
        rtol = RTOL if w.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got, w * factor, rtol=rtol, atol=rtol * 1e-2)


def test_an_empty_micro_batch_contributes_exactly_nothing():
    want, _ = want_of("tokens")
    tokens, labels = token_data()
    model = lm()
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt, normalize="tokens")
    for lo, hi in [(0, 3), (3, 3), (3, 7)]:
        t, lab = tokens[lo:hi], labels[lo:hi]
        with acc.micro_step(count=int((lab != -100).sum())):
            acc.backward(token_sum(model, t, lab))
    with acc.micro_step(count=0):  # an empty micro-batch may leave out the backward
        pass
    result = acc.step()
    assert result.micro_steps == 4
    close(opt.seen[0], want)


def snapshot(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    out += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


def same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "bad",
    [
        lambda: math.nan,
        lambda: math.inf,
        lambda: -3.0,
        lambda: torch.tensor(math.nan),
        lambda: torch.tensor(-3),
    ],
    ids=["nan", "inf", "negative", "tensor_nan", "tensor_negative"],
)
def test_a_bad_count_skips_the_window_like_a_non_finite_gradient(bad):
    model = lm()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    tokens, labels = token_data()
    acc = Accumulator(model, opt, normalize="tokens", scheduler=sched)
    before = [p.detach().clone() for p in model.parameters()]
    for count in (5, bad()):
        with acc.micro_step(count=count):
            acc.backward(token_sum(model, tokens[:2], labels[:2]))
    result = acc.step()
    assert not result.stepped and result.skipped_reason == "non-finite or negative count"
    assert acc.skipped == 1 and sched.last_epoch == 0 and not opt.state
    same([p.detach() for p in model.parameters()], before)
    assert all(p.grad is None for p in model.parameters())
    # the next window is normal
    with acc.micro_step(count=3):
        acc.backward(token_sum(model, tokens[:2], labels[:2]))
    assert acc.step().stepped


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1])
def test_a_bad_count_raises_without_skip_and_changes_nothing(bad):
    model = lm()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    tokens, labels = token_data()
    acc = Accumulator(model, opt, normalize="tokens", skip_nonfinite=False)
    with acc.micro_step(count=4):
        acc.backward(token_sum(model, tokens[:2], labels[:2]))
    before = snapshot(model, opt)
    with (
        pytest.raises(ValueError, match="count: expected a finite number >= 0"),
        acc.micro_step(count=bad),
    ):
        acc.backward(token_sum(model, tokens[:2], labels[:2]))
    same(snapshot(model, opt), before)
    assert acc.step().count == 4


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_a_bad_tensor_count_raises_at_step_and_changes_nothing(bad):
    """A tensor count is read in step() (a micro-step never waits for the device), so a bad
    one raises there; the window stays as it was, and reset() drops it."""
    model = lm()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    tokens, labels = token_data()
    acc = Accumulator(model, opt, normalize="tokens", skip_nonfinite=False)
    with acc.micro_step(count=torch.tensor(4)):
        acc.backward(token_sum(model, tokens[:2], labels[:2]))
    with acc.micro_step(count=torch.tensor(bad)):
        acc.backward(token_sum(model, tokens[:2], labels[:2]))
    before = snapshot(model, opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="count: expected a finite number >= 0 in every micro"):
        acc.step()
    same(snapshot(model, opt), before)
    same([p.grad for p in model.parameters()], grads)
    with pytest.raises(ValueError, match="tensor count number 1"):
        acc.step()  # still the same window
    acc.reset()
    with acc.micro_step(count=torch.tensor(3)):
        acc.backward(token_sum(model, tokens[:2], labels[:2]))
    assert acc.step().count == 3


def test_tensor_counts_give_the_step_of_number_counts():
    tokens, labels = token_data()
    steps = []
    for as_tensor in (False, True):
        torch.manual_seed(0)
        model = lm()
        opt = Capture(model.parameters())
        acc = Accumulator(model, opt, normalize="tokens", max_grad_norm=0.05)
        for lo, hi in ((0, 3), (3, 5), (5, 5)):
            count = (labels[lo:hi] != -100).sum()
            with acc.micro_step(count=count if as_tensor else int(count)):
                if hi > lo:
                    acc.backward(token_sum(model, tokens[lo:hi], labels[lo:hi]))
        steps.append((acc.step(), opt.seen[0]))
    (number, g_number), (tensor, g_tensor) = steps
    assert tensor.count == number.count and tensor.grad_norm == number.grad_norm
    same(g_tensor, g_number)


def test_a_window_of_count_zero_raises_and_stays_open():
    model = lm()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    tokens, labels = token_data()
    acc = Accumulator(model, opt, normalize="tokens")
    with acc.micro_step(count=0):
        acc.backward(token_sum(model, tokens[:0], labels[:0]))
    before = snapshot(model, opt)
    with pytest.raises(GradkitError, match=r"count \(normalize='tokens'\) is 0"):
        acc.step()
    same(snapshot(model, opt), before)
    acc.reset()
    assert all(p.grad is None for p in model.parameters())
    with acc.micro_step(count=2):
        acc.backward(token_sum(model, tokens[:1], labels[:1]))
    assert acc.step().count == 2


def test_an_error_after_backward_still_counts_the_micro_step():
    want, _ = want_of("examples")
    tokens, labels = token_data()
    model = lm()
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt)
    with pytest.raises(KeyError), acc.micro_step(count=3):
        acc.backward(token_sum(model, tokens[:3], labels[:3]))
        raise KeyError("logging failed after the backward")
    with pytest.raises(KeyError), acc.micro_step(count=4):
        raise KeyError("the forward failed: nothing was added")
    with acc.micro_step(count=4):
        acc.backward(token_sum(model, tokens[3:], labels[3:]))
    assert acc.step().micro_steps == 2
    close(opt.seen[0], want)


def test_a_micro_step_without_backward_raises():
    model = lm()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens, labels = token_data()
    with pytest.raises(GradkitError, match="ended without acc.backward"), acc.micro_step(3):
        token_sum(model, tokens[:3], labels[:3]).backward()  # the accumulator cannot see it


def test_optimizer_over_none_of_the_models_parameters_raises():
    model, other = lm(), lm()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer: expected an optimizer over trainable"):
        Accumulator(model, opt)
    frozen = lm().requires_grad_(False)
    with pytest.raises(ValueError, match="model: expected a model with trainable parameters"):
        Accumulator(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))


def test_optimizer_over_part_of_the_model_is_exact_for_that_part():
    want, _ = want_of("examples")
    model = lm()
    model[0].weight.requires_grad_(False)  # a frozen embedding
    head = list(model[2].parameters())
    opt = Capture(head)
    result = run_window(model, opt, "examples")
    assert result.stepped
    close(opt.seen[0], want[1:])


def test_split_batch_parts_and_mismatched_lengths():
    assert [len(p) for p in split_batch(torch.zeros(10), num_micro_batches=6)] == [2] * 4 + [1] * 2
    assert [len(p) for p in split_batch(torch.zeros(3), num_micro_batches=5)] == [1, 1, 1]
    assert split_batch(torch.zeros(0, 2), micro_batch_size=4) == []
    with pytest.raises(ValueError, match=r"batch\[0\]: 5, batch\[1\]: 3"):
        split_batch((torch.zeros(5, 2), torch.zeros(3)), micro_batch_size=2)
    with pytest.raises(ValueError, match=r"batch\['y'\]: expected a tensor with the examples"):
        split_batch({"x": torch.zeros(4), "y": torch.tensor(1.0)}, micro_batch_size=2)


def test_one_rank_group_reduces_once_per_step_and_refuses_sparse_gradients(monkeypatch):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        calls: list[int] = []
        plain = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            calls.append(tensor.numel())
            return plain(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", counted)
        want, _ = want_of("examples")
        model = lm()
        opt = Capture(model.parameters())
        assert run_window(model, opt, "examples").stepped
        close(opt.seen[0], want)
        numel = sum(p.numel() for p in model.parameters())
        flags = len(list(model.parameters()))
        assert calls == [4 + flags, numel]  # the tally (4 numbers, a flag each), the gradients
        sparse = nn.Embedding(5, 2, sparse=True).double()
        acc = Accumulator(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1))
        with acc.micro_step(count=2):
            acc.backward(sparse(torch.tensor([1, 3])).sum())
        before = sparse.weight.grad.to_dense().clone()
        with pytest.raises(GradkitError, match="sparse gradients"):
            acc.step()
        assert torch.equal(sparse.weight.grad.to_dense(), before)
    finally:
        dist.destroy_process_group()


def test_a_tensor_count_changed_in_place_after_its_micro_step_keeps_its_value():
    tokens, labels = token_data()
    model = lm()
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt, normalize="tokens")
    counter = torch.zeros((), dtype=torch.int64)
    for lo, hi in ((0, 3), (3, 7)):
        counter.fill_(int((labels[lo:hi] != -100).sum()))  # one tensor reused as the count
        with acc.micro_step(count=counter):
            acc.backward(token_sum(model, tokens[lo:hi], labels[lo:hi]))
    counter.fill_(10**6)
    assert acc.step().count == int((labels != -100).sum())

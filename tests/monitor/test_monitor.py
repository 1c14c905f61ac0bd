"""GradientMonitor against the one-example-at-a-time oracle (float64), its schedule, its
writers and its errors."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch
from torch import nn

from gradkit import GradkitError
from gradkit.monitor import QUANTILES, GradientMonitor, read_records

D = torch.float64


def problem(n=12):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)
    x = torch.randn(n, 3, dtype=D)
    y = torch.randint(0, 2, (n,))
    return model, x, y


def per_example(model, x, y):
    """``{name: [n, *shape]}`` by one backward per example."""
    out = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for n, p in model.named_parameters():
            out[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(v) for n, v in out.items()}


def reduced(g: dict[str, torch.Tensor]) -> dict[str, float]:
    n = next(iter(g.values())).shape[0]
    mean = torch.cat([v.mean(0).reshape(-1) for v in g.values()])
    var = torch.cat([v.var(0, unbiased=True).reshape(-1) for v in g.values()])
    second = torch.cat([v.square().mean(0).reshape(-1) for v in g.values()])
    top = torch.cat([v.square().mean(0).max().expand(v[0].numel()) for v in g.values()])
    c = 256 * torch.finfo(D).eps  # entries whose ratio is rounding noise are left out
    ok = (var > c * second) & (second > c**2 * top)
    # |G|^2 without bias: E|mean|^2 = |G|^2 + tr(Sigma) / N; None where it does not resolve
    signal = float(mean.square().sum() - var.sum() / n)
    return {
        "grad_norm": float(mean.norm()),
        "grad_variance": float(var.sum()),
        "noise_scale": float(var.sum()) / signal if signal > 0 else None,
        "snr_median": middle(mean[ok].square() / var[ok]),
    }


def middle(values: torch.Tensor) -> float:
    """The median by its definition: the middle value, or the mean of the two middle values
    of an even count."""
    v = values.sort().values
    n = len(v)
    return float(v[n // 2]) if n % 2 else float((v[n // 2 - 1] + v[n // 2]) / 2)


def test_a_tracked_step_logs_the_oracle_statistics_over_its_micro_batches():
    model, x, y = problem()
    g = per_example(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    monitor = GradientMonitor(model, optimizer=opt)
    with monitor.step() as step:
        for part in (slice(0, 5), slice(5, 12)):  # two micro-batches, unequal
            loss = nn.functional.cross_entropy(model(x[part]), y[part])
            loss.backward()
        step.loss = 0.7
    (record,) = monitor.records
    assert record is step.record and record["step"] == 0 and record["examples"] == 12
    want = reduced(g)
    for key, value in want.items():
        assert record[key] == pytest.approx(value, rel=1e-10), key
    norms = torch.stack(
        [torch.cat([v[i].reshape(-1) for v in g.values()]).norm() for i in range(12)]
    )
    levels = torch.quantile(norms, torch.tensor(QUANTILES, dtype=D))
    for level, q in zip(QUANTILES, levels, strict=True):
        assert record[f"example_norm_q{round(level * 100)}"] == pytest.approx(float(q), rel=1e-10)
    trace = sum(float(v.var(0, unbiased=True).sum()) for v in g.values())
    assert record["cabs_batch_size"] == round(5.0 * trace / 0.7) > 1 and record["loss"] == 0.7
    for layer in ("0", "2"):
        sub = {n: v for n, v in g.items() if n.startswith(layer + ".")}
        for key, value in reduced(sub).items():
            assert record["layers"][layer][key] == pytest.approx(value, rel=1e-10)


def test_untracked_steps_install_nothing_and_every_picks_the_steps():
    model, x, y = problem()
    seen = []
    monitor = GradientMonitor(model, every=3, writer=seen.append)
    for i in range(7):
        with monitor.step() as step:
            hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
            assert (hooks > 0) == step.tracked == (i % 3 == 0)
            nn.functional.cross_entropy(model(x), y).backward()
        if not step.tracked:
            assert step.stats is None and step.record is None
        model.zero_grad()
    assert [r["step"] for r in seen] == [0, 3, 6] and seen == monitor.records
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_explicit_step_numbers_and_the_pair_of_calls():
    model, x, y = problem()
    monitor = GradientMonitor(model, every=5, layers=False)
    step = monitor.begin(10)
    nn.functional.cross_entropy(model(x), y).backward()
    record = monitor.end(loss=torch.tensor(0.5, dtype=D))
    assert record is not None and record["step"] == 10 and "layers" not in record
    assert "cabs_batch_size" not in record and record["loss"] == 0.5  # no learning rate known
    assert monitor.begin().index == 11 and monitor.end() is None and step.tracked


def test_a_failed_step_removes_the_hooks_and_logs_nothing():
    model, x, y = problem()
    monitor = GradientMonitor(model)
    with pytest.raises(RuntimeError, match="boom"), monitor.step():
        model(x)
        raise RuntimeError("boom")
    assert not monitor.records
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    with monitor.step():  # the monitor goes on
        nn.functional.cross_entropy(model(x), y).backward()
    assert [r["step"] for r in monitor.records] == [1]


def test_json_lines_and_tensorboard_writers(tmp_path):
    model, x, y = problem()

    class Board:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    board = Board()
    path = tmp_path / "logs" / "grads.jsonl"
    monitor = GradientMonitor(model, every=2, writer=[str(path), board])
    for _ in range(4):
        with monitor.step():
            nn.functional.cross_entropy(model(x), y).backward()
    assert read_records(path) == json.loads(json.dumps(monitor.records))
    tags = {tag for tag, _, _ in board.scalars}
    assert {"gradkit/noise_scale", "gradkit/layers/0/snr_median", "gradkit/examples"} <= tags
    assert {step for _, _, step in board.scalars} == {0, 2}
    assert all(math.isfinite(v) for _, v, _ in board.scalars)


def test_a_real_summary_writer(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    model, x, y = problem()
    writer = tensorboard.SummaryWriter(str(tmp_path))
    monitor = GradientMonitor(model, writer=writer)
    with monitor.step():
        nn.functional.cross_entropy(model(x), y).backward()
    writer.close()
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_an_undefined_ratio_is_logged_as_null(tmp_path):
    """A zero mean gradient with noise: the noise scale is infinite; JSON gets null."""
    model = nn.Linear(1, 1, bias=False).to(D)
    x = torch.tensor([[1.0], [-1.0]], dtype=D)
    path = tmp_path / "g.jsonl"
    monitor = GradientMonitor(model, writer=path, loss_reduction="sum")
    with monitor.step():
        model(x).sum().backward()  # gradients +1 and -1
    (record,) = read_records(path)
    assert record["noise_scale"] is None and record["grad_norm"] == 0.0


def test_a_step_of_one_example_logs_no_variance_instead_of_stopping(tmp_path):
    """A last partial batch of one example (or a batch size of 1): the unbiased variance is
    undefined. Reading it raised inside the record, which stopped a Trainer at the end of an
    epoch; the record now has the gradient norm and null for what needs a variance."""
    model, x, y = problem()
    path = tmp_path / "g.jsonl"
    monitor = GradientMonitor(model, writer=path, lr=0.1)
    with monitor.step() as step:
        loss = nn.functional.cross_entropy(model(x[:1]), y[:1])
        loss.backward()
        step.loss = float(loss.detach())
    (record,) = read_records(path)
    ref = per_example(model, x[:1], y[:1])
    norm = math.sqrt(sum(float(g[0].square().sum()) for g in ref.values()))
    assert record["examples"] == 1 and record["grad_norm"] == pytest.approx(norm, rel=1e-10)
    for key in ("grad_variance", "noise_scale", "snr_median"):
        assert record[key] is None, key
    assert "cabs_batch_size" not in record
    assert all(layer["grad_variance"] is None for layer in record["layers"].values())


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"quantities": ("batch_l2",)}, ValueError, r"quantities: expected 'variance' among"),
        ({"quantities": "variance"}, TypeError, r"quantities: expected a tuple of quantity"),
        ({"every": 0}, ValueError, r"every: expected an int >= 1, got 0"),
        ({"writer": 3}, TypeError, r"writer: expected None, a path \(JSON lines\)"),
        ({"optimizer": "sgd"}, TypeError, r"optimizer: expected None or a torch.optim"),
        ({"lr": -1.0}, ValueError, r"lr: expected None or a number > 0, got -1.0"),
        ({"loss_reduction": "avg"}, ValueError, r"loss_reduction"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    model, _, _ = problem()
    with pytest.raises(error, match=pattern):
        GradientMonitor(model, **kwargs)


def test_steps_must_not_overlap():
    model, x, y = problem()
    monitor = GradientMonitor(model)
    with pytest.raises(GradkitError, match=r"no step is open"):
        monitor.end()
    monitor.begin()
    with pytest.raises(GradkitError, match=r"step 0 is still open"):
        monitor.begin()
    monitor.end(failed=True)


def test_read_records_names_a_bad_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"step": 0}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"line 3 is not JSON"):
        read_records(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 2 is not a monitor record"):
        read_records(path)


def test_scale_to_grad_makes_the_mean_the_accumulated_gradient():
    """A loss divided by hand (a token count over the window, as trainers do): with
    loss_reduction="sum" and scale_to_grad, the individual gradients' mean is the gradient in
    .grad, and the noise scale and SNR are those of the per-example losses."""
    model, x, y = problem()
    g = per_example(model, x, y)
    monitor = GradientMonitor(model, loss_reduction="sum", scale_to_grad=True)
    with monitor.step():
        for part in (slice(0, 4), slice(4, 12)):
            loss = nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum") / 7.3
            loss.backward()
    (record,) = monitor.records
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert record["grad_norm"] == pytest.approx(float(grad.norm()), rel=1e-10)
    want = reduced(g)
    for key in ("noise_scale", "snr_median"):
        assert record[key] == pytest.approx(want[key], rel=1e-10), key
    assert record["grad_variance"] == pytest.approx((12 / 7.3) ** 2 * want["grad_variance"])
    norms = torch.stack(
        [torch.cat([v[i].reshape(-1) for v in g.values()]).norm() for i in range(12)]
    )
    median = float(torch.quantile(norms, 0.5))
    assert record["example_norm_q50"] == pytest.approx(12 / 7.3 * median, rel=1e-10)


def test_scale_to_grad_needs_a_summed_loss():
    model, _, _ = problem()
    with pytest.raises(ValueError, match=r"scale_to_grad: expected False unless loss_reduction"):
        GradientMonitor(model, scale_to_grad=True)


def test_scale_to_grad_reads_a_mean_loss_as_shares():
    """With scale_to_grad the loss may be a plain mean (Lightning with no accumulation): each
    example's share l_i / n, times n, is its own gradient."""
    model, x, y = problem()
    g = per_example(model, x, y)
    monitor = GradientMonitor(model, loss_reduction="sum", scale_to_grad=True)
    with monitor.step():
        nn.functional.cross_entropy(model(x), y).backward()
    (record,) = monitor.records
    for key, value in reduced(g).items():  # the variance too: the shares times N are the g_i
        assert record[key] == pytest.approx(value, rel=1e-10), key


def test_scale_to_grad_gives_the_examples_own_statistics_for_unequal_micro_batch_means():
    """Each micro-batch's mean divided by the number of micro-batches (Lightning; the HF
    Trainer without num_items_in_batch) gives the examples of a short micro-batch a larger
    share: read as shares times the step's examples, the step's variance came out 58 % above
    the examples' own (micro-batches of 8 and 2). Such passes are read as means, and the
    statistics are the examples' own, as the oracle's; equal micro-batches give the same
    record as before, whose mean is .grad. A step mixing a mean pass with a sum pass warns."""
    model, x, y = problem()
    g = per_example(model, x, y)
    want = reduced(g)
    for parts in ([slice(0, 6), slice(6, 12)], [slice(0, 9), slice(9, 12)]):
        monitor = GradientMonitor(model, loss_reduction="sum", scale_to_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with monitor.step():
                for part in parts:
                    (nn.functional.cross_entropy(model(x[part]), y[part]) / 2).backward()
        (record,) = monitor.records
        for key in ("grad_norm", "grad_variance", "noise_scale", "snr_median"):
            assert record[key] == pytest.approx(want[key], rel=1e-9), (parts, key)
        if parts[0].stop == 6:  # equal: the mean is the gradient in .grad
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert record["grad_norm"] == pytest.approx(float(grad.norm()), rel=1e-10)
        model.zero_grad()
    mixed = GradientMonitor(model, loss_reduction="sum", scale_to_grad=True)
    mixes = "mixed backward passes whose loss was a micro-batch"
    with pytest.warns(UserWarning, match=mixes), mixed.step():
        nn.functional.cross_entropy(model(x[:6]), y[:6]).backward()
        nn.functional.cross_entropy(model(x[6:]), y[6:], reduction="sum").backward()


@pytest.mark.parametrize("split", [(11,), (10,), (5, 10), (1,)])
def test_a_micro_batch_of_one_example_goes_with_the_mean_passes(split):
    """A micro-batch of one example (an epoch's remainder) has a loss whose mean is its sum:
    read as a sum, it made the step "mixed" and every statistic came out times the step's
    examples over the micro-batches (2.5x for 4 + 1 examples), the variance that squared. It
    goes with the other passes, whichever kind they are; all passes of one row are read as
    either."""
    model, x, y = problem()
    bounds = [0, *split, 12] if split != (1,) else list(range(13))
    parts = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    g = per_example(model, x, y)
    want = reduced(g)
    monitor = GradientMonitor(model, loss_reduction="sum", scale_to_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.step():
            for part in parts:
                loss = nn.functional.cross_entropy(model(x[part]), y[part])
                (loss / len(parts)).backward()
    (record,) = monitor.records
    for key in ("grad_norm", "grad_variance", "noise_scale", "snr_median"):
        assert record[key] == pytest.approx(want[key], rel=1e-9), (split, key)


def test_divided_by_names_the_trainers_divisor():
    """Lightning divides each micro-batch's mean by accumulate_grad_batches also in an
    epoch's last window of fewer micro-batches: read with the number of passes, the statistics
    came out that fraction of the examples' own (2/3 of the norms, 4/9 of the variance)."""
    model, x, y = problem()
    want = reduced(per_example(model, x, y))
    monitor = GradientMonitor(model, loss_reduction="sum", scale_to_grad=True)
    monitor.begin(0)
    for part in (slice(0, 6), slice(6, 12)):  # two passes of a window of three
        (nn.functional.cross_entropy(model(x[part]), y[part]) / 3).backward()
    record = monitor.end(divided_by=3)
    assert record is not None
    for key in ("grad_norm", "grad_variance", "noise_scale", "snr_median"):
        assert record[key] == pytest.approx(want[key], rel=1e-9), key
    monitor.begin(1)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"divided_by: expected an int >= 1, got 0"):
        monitor.end(divided_by=0)
    assert monitor.end() is not None  # the refused call left the step open


def test_json_lines_are_strict_json_and_bad_paths_are_refused_at_once(tmp_path):
    """A NaN gradient norm was written as a bare NaN (jq and JavaScript refuse the line); a
    folder given as the path was accepted and failed at the first tracked step, after its
    backward pass, with a bare IsADirectoryError."""
    import json

    from gradkit.monitor import JsonLinesWriter

    path = tmp_path / "g.jsonl"
    JsonLinesWriter(path)(
        {"step": 0, "grad_norm": float("nan"), "layers": {"0": {"x": float("inf")}}}
    )
    assert json.loads(path.read_text()) == {
        "step": 0,
        "grad_norm": None,
        "layers": {"0": {"x": None}},
    }
    with pytest.raises(
        ValueError, match=r"JsonLinesWriter\(path\): path: expected a file .* folder"
    ):
        GradientMonitor(nn.Linear(2, 1), writer=tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"whose folder cannot be created"):
        JsonLinesWriter(blocker / "sub" / "g.jsonl")


def test_a_tracked_step_without_backward_records_zero_examples_instead_of_stopping(tmp_path):
    """A tracked step with no backward pass (a batch the training loop skipped) raised a
    GradkitError from the per-example norms, which stopped the training; it is now a record
    of 0 examples without statistics (one warning), and the next step is the oracle's."""
    model, x, y = problem()
    path = tmp_path / "g.jsonl"
    monitor = GradientMonitor(model, writer=path)
    with pytest.warns(UserWarning, match="step 0 had no backward pass"), monitor.step() as step:
        step.loss = 1.5
    with monitor.step():
        nn.functional.cross_entropy(model(x), y).backward()
    empty, record = read_records(path)
    assert empty["step"] == 0 and empty["examples"] == 0 and empty["loss"] == 1.5
    for key in ("grad_norm", "grad_variance", "noise_scale", "snr_median"):
        assert empty[key] is None, key
    assert set(empty["layers"]) == {"0", "2"}
    assert all(v is None for layer in empty["layers"].values() for v in layer.values())
    ref = per_example(model, x, y)
    norm = math.sqrt(sum(float(g.mean(0).square().sum()) for g in ref.values()))
    assert record["examples"] == len(x)
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-10)

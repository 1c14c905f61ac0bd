"""The gradient monitor inside Lightning: an MLP (float64) trained by ``Trainer(max_steps=3)``
on CPU with gradient accumulation. The logged noise scale and SNR of a tracked step equal the
per-example oracle over that step's accumulated batch; the metrics reach the logger; the
untracked steps run without any hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

lightning = pytest.importorskip("lightning")

from gradkit.integrations.lightning import GradientMonitorCallback  # noqa: E402

# Lightning's own use of torch internals that torch 2.13 deprecates
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning",
        "ignore:.*does not have many workers:UserWarning",
    ),
    # the Trainer places the model and the batches itself (accelerator="cpu" here, its CPU
    # GradScaler standing in for CUDA's); a run on a GPU's trainer is a check of its own
    pytest.mark.cpu_only,
]

D = torch.float64
N, B = 48, 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(D)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(N, 5, generator=g, dtype=D), torch.randint(0, 3, (N,), generator=g)


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Captured(lightning.pytorch.loggers.Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "captured"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def oracle(model, x, y):
    params = list(model.parameters())
    rows = []
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    g = torch.stack(rows)
    mean, var = g.mean(0), g.var(0, unbiased=True)
    signal = float(mean.square().sum() - var.sum() / len(g))  # |G|^2 without bias
    return float(var.sum()) / signal if signal > 0 else None  # None: not resolved


def _hooks(module):
    return sum(len(m._forward_hooks) for m in module.modules())


@pytest.mark.parametrize("accumulation", [1, 3])
def test_lightning_logs_the_oracle_statistics_of_the_accumulated_batch(tmp_path, accumulation):
    x, y = data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False
    )
    module = Module()
    start = mlp()
    hooks = []

    class Probe(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            hooks.append((trainer.global_step, batch_idx, _hooks(pl_module)))

    logger = Captured()
    monitor = GradientMonitorCallback(every=2, writer=str(tmp_path / "g.jsonl"))
    trainer = lightning.Trainer(
        max_steps=3, accumulate_grad_batches=accumulation, logger=logger, log_every_n_steps=1,
        callbacks=[monitor, Probe()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, loader)
    records = monitor.monitor.records
    assert [r["step"] for r in records] == [0, 2]
    assert records[0]["examples"] == B * accumulation
    window = slice(0, B * accumulation)
    want = oracle(start, x[window], y[window])
    assert records[0]["noise_scale"] == (None if want is None else pytest.approx(want, rel=1e-9))
    logged = [(step, m) for step, m in logger.rows if "gradkit/grad_norm" in m]
    assert [step for step, _ in logged] == [0, 2]  # at the steps they describe, once
    # an undefined value (None) is not logged
    assert [m.get("gradkit/noise_scale") for _, m in logged] == [r["noise_scale"] for r in records]
    # the hooks are there while the tracked windows' micro-batches run, and only then
    for step, batch_idx, count in hooks:
        # the window's last micro-batch ends after the optimizer step: tracking has ended
        tracked_window = step in (0, 2) and batch_idx % accumulation != accumulation - 1
        assert (count > 0) == tracked_window, (step, batch_idx, count)
    assert _hooks(module) == 0


def test_a_16_mixed_gradscaler_is_divided_out_of_the_statistics(tmp_path):
    """Under "16-mixed" the precision plugin backpropagates ``scaler.scale(loss)``: the
    monitor's absolute numbers came out multiplied by the scale. The callback reads the
    plugin's scaler, so a scale of 1024 gives the records of a scale of 1 (same autocast). A
    CPU ``GradScaler`` stands in for the CUDA one."""
    from lightning.pytorch.plugins import MixedPrecision

    x, y = data()

    def first_record(scale):
        module = Module()
        module.net = module.net.float()
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x.float(), y), batch_size=B, shuffle=False
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        monitor = GradientMonitorCallback(every=1)
        trainer = lightning.Trainer(
            max_steps=1, accumulate_grad_batches=2, logger=False, callbacks=[monitor],
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            accelerator="cpu", default_root_dir=str(tmp_path),
        )  # fmt: skip
        trainer.fit(module, loader)
        return monitor.monitor.records[0]

    plain, scaled = first_record(1.0), first_record(1024.0)
    for key in ("grad_norm", "grad_variance", "example_norm_q50", "noise_scale"):
        want = None if plain[key] is None else pytest.approx(plain[key], rel=1e-5)
        assert scaled[key] == want, key


@pytest.mark.parametrize("examples", [18, 17, 20])
def test_an_epochs_short_last_window_gives_the_examples_own_statistics(tmp_path, examples):
    """Lightning divides each micro-batch's mean by accumulate_grad_batches (3) also in an
    epoch's last window of fewer micro-batches ([4, 2] of 18 examples, [4, 1] of 17, [4, 4] of
    20): read with the window's number of passes, the norms came out 2/3 of the examples' own
    and the variance 4/9 (a one-example micro-batch made it 3x and 9x)."""
    x, y = data()
    x, y = x[:examples], y[:examples]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False
    )
    module = Module()
    weights = []

    class Keep(lightning.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % 3 == 0:
                weights.append({k: v.clone() for k, v in pl_module.net.state_dict().items()})

    monitor = GradientMonitorCallback(every=1)
    trainer = lightning.Trainer(
        max_epochs=1, accumulate_grad_batches=3, logger=False, callbacks=[monitor, Keep()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, loader)
    record = monitor.monitor.records[-1]
    first = 12  # the last window's examples: from the second window on
    net = mlp()
    net.load_state_dict(weights[-1])
    params = list(net.parameters())
    rows = []
    for i in range(first, examples):
        loss = nn.functional.cross_entropy(net(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    g = torch.stack(rows)
    assert record["examples"] == examples - first
    assert record["grad_norm"] == pytest.approx(float(g.mean(0).norm()), rel=1e-9)
    assert record["grad_variance"] == pytest.approx(float(g.var(0).sum()), rel=1e-9)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")
def test_a_skipped_batch_is_recorded_with_zero_examples_and_training_goes_on(tmp_path):
    """``training_step`` returning None (Lightning's way to skip a batch) in a tracked step
    stopped the training with a GradkitError; the step is now a record of 0 examples without
    statistics (one warning) and the next steps are the oracle's."""
    x, y = data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False
    )

    class Skipping(Module):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 0 else super().training_step(batch, batch_idx)

    monitor = GradientMonitorCallback(every=1)
    trainer = lightning.Trainer(
        max_steps=2, logger=False, callbacks=[monitor], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    with pytest.warns(UserWarning, match="step 0 had no backward pass"):
        trainer.fit(Skipping(), loader)
    empty, second = monitor.monitor.records
    assert empty["examples"] == 0 and empty["grad_norm"] is None
    assert empty["noise_scale"] is None and empty["grad_variance"] is None
    # the skipped batch changed no weight: the second batch at the initial ones
    net, window = mlp(), slice(B, 2 * B)
    params = list(net.parameters())
    rows = []
    for i in range(window.start, window.stop):
        loss = nn.functional.cross_entropy(net(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    g = torch.stack(rows)
    assert second["examples"] == B
    assert second["grad_norm"] == pytest.approx(float(g.mean(0).norm()), rel=1e-9)
    assert second["grad_variance"] == pytest.approx(float(g.var(0).sum()), rel=1e-9)
    assert _hooks(trainer.lightning_module) == 0


def test_options_are_checked_when_the_callback_is_made():
    with pytest.raises(ValueError, match=r"^GradientMonitorCallback\(every, \.\.\.\): every:"):
        GradientMonitorCallback(every=0)
    with pytest.raises(ValueError, match=r"\): loss_reduction: expected 'sum' or left out"):
        GradientMonitorCallback(loss_reduction="mean")
    with pytest.raises(TypeError, match=r"\): evry: expected one of its options: every, "):
        GradientMonitorCallback(evry=3)
    with pytest.raises(ValueError, match=r"^GradientMonitorCallback\(every, \.\.\.\): fallback"):
        GradientMonitorCallback(fallback="never")

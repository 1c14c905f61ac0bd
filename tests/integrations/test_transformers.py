"""The gradient monitor inside the Hugging Face ``Trainer``: a GPT-2 from a small config
(float64, no download), gradient accumulation over 2 micro-batches, a few steps on CPU. The
logged noise scale and SNR of a tracked step equal the per-example oracle over that step's
accumulated batch (the examples' own token losses, one at a time), its gradient norm equals
the Trainer's own pre-clipping ``grad_norm``, the metrics reach the Trainer's log, and the
untracked steps run without any hook."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

# the Trainer places the model and the batches itself (use_cpu=True here, a CPU GradScaler
# standing in for CUDA's); a run of its GPU path is a check of its own
pytestmark = pytest.mark.cpu_only

from gradkit.integrations.transformers import monitor_trainer  # noqa: E402

D = torch.float64
V, T, N = 30, 8, 24


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(D)


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator(torch.get_default_device()).manual_seed(1)
        self.ids = torch.randint(3, V, (N, T), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


class Recorder:
    """The collator, recording each micro-batch it builds (in the Trainer's order)."""

    def __init__(self):
        self.batches = []

    def __call__(self, features):
        ids = torch.stack([f["input_ids"] for f in features])
        b = {"input_ids": ids, "labels": ids.clone()}
        self.batches.append(b)
        return b


def token_sum(model, ids):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="sum")


def oracle(model, ids):
    """noise scale and median SNR of g_i = grad of example i's summed token loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(ids)):
        g = torch.autograd.grad(token_sum(model, ids[i : i + 1]), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1)
                               for x, p in zip(g, params, strict=True)]))  # fmt: skip
    g = torch.stack(rows)
    mean, var = g.mean(0), g.var(0, unbiased=True)
    c, second = 256 * torch.finfo(D).eps, g.square().mean(0)
    top = torch.cat([s.max().expand(s.numel()) for s in second.split([p.numel() for p in params])])
    ok = (var > c * second) & (second > c**2 * top)  # the monitor's rounding floors
    ratios = (mean[ok].square() / var[ok]).sort().values
    k = len(ratios) // 2  # the median: the middle value, or the mean of the two middle ones
    snr = float(ratios[k]) if len(ratios) % 2 else float((ratios[k - 1] + ratios[k]) / 2)
    signal = float(mean.square().sum() - var.sum() / len(g))  # |G|^2 without bias
    scale = float(var.sum()) / signal if signal > 0 else None  # None: not resolved
    return scale, snr, float(var.sum()), float(mean.norm())


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_logs_the_oracle_statistics_of_the_accumulated_batch(tmp_path, accumulation):
    model = gpt2()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = Recorder()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, max_steps=3, logging_steps=1,
        learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(), data_collator=recorder
    )
    hooks_seen = []

    class Probe(transformers.TrainerCallback):  # runs after the monitor's callback
        def on_step_begin(self, args, state, control, **kwargs):
            hooks_seen.append((state.global_step, _hooks(model)))

        def on_substep_end(self, args, state, control, **kwargs):
            hooks_seen.append((state.global_step, _hooks(model)))

    trainer.add_callback(Probe())
    log = tmp_path / "grads.jsonl"
    callback = monitor_trainer(trainer, every=2, writer=str(log))
    trainer.train()
    records = callback.monitor.records
    assert [r["step"] for r in records] == [0, 2]
    first = records[0]
    assert first["examples"] == 4 * accumulation
    # the oracle: the first optimizer step's micro-batches, at the initial weights
    reference = gpt2()
    reference.load_state_dict(start)
    ids = torch.cat([b["input_ids"] for b in recorder.batches[:accumulation]])
    scale, snr, variance, norm = oracle(reference, ids)
    assert first["noise_scale"] == (None if scale is None else pytest.approx(scale, rel=1e-8))
    assert first["snr_median"] == pytest.approx(snr, rel=1e-6)  # a median of ratios
    # the individual gradients are the examples' own ones scaled so that their mean is the
    # gradient the Trainer applied (its own divisor of the summed token losses)
    c = first["grad_norm"] / norm
    assert first["grad_variance"] == pytest.approx(c**2 * variance, rel=1e-8)
    # the Trainer's own log: its pre-clipping gradient norm, and the monitor's metrics
    logged = [h for h in trainer.state.log_history if "gradkit/grad_norm" in h]
    assert [h["step"] for h in logged] == [1, 3]
    own = {h["step"]: h for h in trainer.state.log_history if "loss" in h}  # its own lines
    assert logged[0]["gradkit/grad_norm"] == pytest.approx(float(own[1]["grad_norm"]), rel=1e-6)
    assert logged[0].get("gradkit/noise_scale") == first["noise_scale"]  # None: not logged
    assert all(math.isfinite(v) for k, v in logged[0].items() if k.startswith("gradkit/"))
    assert not any(k.startswith("gradkit/layers/") for k in logged[0])  # log_layers=False
    assert "layers" in records[0]  # the writer's records keep them
    # hooks only while a tracked step runs (steps 0 and 2), never on step 1
    assert all(h == 0 for step, h in hooks_seen if step == 1)
    assert all(h > 0 for step, h in hooks_seen if step in (0, 2))
    assert _hooks(model) == 0
    assert log.read_text().count("\n") == 2


def _hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def _gpt2_trainer(tmp_path, *, max_steps: int, logging_steps: int):  # type: ignore[no-untyped-def]
    """A Trainer of :func:`gpt2` on :class:`Rows`, batches of 4, on the CPU."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=max_steps,
        logging_steps=logging_steps, learning_rate=1e-3, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    return transformers.Trainer(
        model=gpt2(), args=args, train_dataset=Rows(), data_collator=Recorder()
    )


def test_the_trainers_own_logged_loss_is_left_as_it_is(tmp_path):
    """The metrics go out in log lines of their own: forcing a log at each tracked step reset
    the window the Trainer averages its loss over (the loss logged at step 8 came out 0.36 for
    1.64 with logging_steps=4 and every=3)."""

    def losses(monitored):
        trainer = _gpt2_trainer(tmp_path, max_steps=8, logging_steps=4)
        if monitored:
            monitor_trainer(trainer, every=3)
        trainer.train()
        history = trainer.state.log_history
        mine = [h["step"] for h in history if "gradkit/grad_norm" in h]
        return [(h["step"], h["loss"]) for h in history if "loss" in h], mine

    plain, _ = losses(False)
    monitored, steps = losses(True)
    assert monitored == plain and [s for s, _ in plain] == [4, 8]
    assert steps == [1, 4, 7]


def test_an_fp16_gradscaler_is_divided_out_of_the_statistics(tmp_path):
    """Under fp16 the accelerator backpropagates ``scaler.scale(loss)``: the monitor's absolute
    numbers came out multiplied by the scale (the gradient norm 1024x, the variance 1024^2 x).
    ``monitor_trainer`` passes the accelerator's scaler on, so a run with a scale of 1024 gives
    the records of a run without one. A CPU ``GradScaler`` stands in for the CUDA one."""

    def first_record(scaler):
        trainer = _gpt2_trainer(tmp_path, max_steps=1, logging_steps=1)
        trainer.accelerator.scaler = scaler
        callback = monitor_trainer(trainer, every=1)
        trainer.train()
        return callback.monitor.records[0]

    plain = first_record(None)
    scaled = first_record(torch.amp.GradScaler("cpu", init_scale=1024.0))
    for key in ("grad_norm", "grad_variance", "example_norm_q50", "noise_scale"):
        want = None if plain[key] is None else pytest.approx(plain[key], rel=1e-9)
        assert scaled[key] == want, key

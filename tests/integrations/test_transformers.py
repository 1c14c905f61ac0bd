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

from gradkit import GradkitError  # noqa: E402
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


def _grad_norms(trainer):
    """The Trainer's own pre-clipping gradient norm of each step (its log lines: step + 1)."""
    return {h["step"] - 1: h["grad_norm"] for h in trainer.state.log_history if "loss" in h}


def _fail_once(model, when):
    """Make the model's ``when(call, batch size)``-th training forward raise an out-of-memory
    error."""
    calls = []

    def pre(module, args, kwargs):
        if module.training:
            calls.append(kwargs["input_ids"].shape[0])
            if when(len(calls), calls[-1]):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    model.register_forward_pre_hook(pre, with_kwargs=True)


def test_a_step_interrupted_by_an_out_of_memory_retry_is_not_merged_into_the_next(tmp_path):
    """``auto_find_batch_size=True``: the Trainer catches an out-of-memory error in the second
    micro-batch of tracked step 0 and trains again with a smaller batch. The open step stayed
    open, its hooks on the model, and the first step of the new run counted the old
    micro-batch too: 22 examples for 14, grad_norm 1.2538 for the Trainer's 0.8435."""
    model = gpt2()
    _fail_once(model, lambda call, size: call == 2 and size == 8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_steps=2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0, auto_find_batch_size=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(), data_collator=Recorder()
    )
    callback = monitor_trainer(trainer, every=1)
    trainer.train()
    size = trainer._train_batch_size
    assert size < 8
    records = callback.monitor.records
    assert [(r["step"], r["examples"]) for r in records] == [(0, 2 * size), (1, N - 2 * size)]
    own = _grad_norms(trainer)
    for r in records:
        assert r["grad_norm"] == pytest.approx(own[r["step"]], rel=1e-6), r["step"]
    assert _hooks(model) == 0


def test_a_train_that_raised_leaves_no_hook_and_the_next_train_is_exact(tmp_path):
    """An error in the third micro-batch of tracked step 0, caught by the user: the Trainer has
    no event for it, and 17 forward hooks stayed on the model (running on whatever the model
    did next); the next ``train()`` merged the two micro-batches into its first step."""
    model = gpt2()
    _fail_once(model, lambda call, size: call == 3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=4,
        max_steps=2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(), data_collator=Recorder()
    )
    callback = monitor_trainer(trainer, every=1)
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.train()
    assert _hooks(model) == 0 and not callback.window._open
    trainer.train()
    records = callback.monitor.records
    assert [(r["step"], r["examples"]) for r in records] == [(0, 12), (1, 12)]
    own = _grad_norms(trainer)
    for r in records:
        assert r["grad_norm"] == pytest.approx(own[r["step"]], rel=1e-6), r["step"]


@pytest.mark.parametrize("how", ["Trainer(callbacks=...)", "add_callback"])
def test_a_hand_added_callback_reaches_the_loggers_before_it(tmp_path, how):
    """Added by hand, the callback came after the Trainer's reporting callbacks (TensorBoard,
    W&B, ...) and put its metrics into ``logs`` once they had run: none reached them. It now
    goes first among the callbacks and logs its own lines, as with ``monitor_trainer``."""
    from gradkit.integrations.transformers import GradientMonitorCallback

    seen = []

    class Logger(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "gradkit/grad_norm" in logs:
                seen.append((state.global_step, logs["gradkit/grad_norm"]))

    callback = GradientMonitorCallback(every=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    hand = [Logger(), callback] if how != "add_callback" else [Logger()]
    trainer = transformers.Trainer(
        model=gpt2(), args=args, train_dataset=Rows(), data_collator=Recorder(), callbacks=hand
    )
    if how == "add_callback":
        trainer.add_callback(callback)
    trainer.train()
    own = _grad_norms(trainer)
    assert [step for step, _ in seen] == [1, 3]
    for step, norm in seen:
        assert norm == pytest.approx(own[step - 1], rel=1e-6)
    assert trainer.callback_handler.callbacks[0] is callback
    # lines of their own: the Trainer's lines (and the loss it averages) are left as they are
    assert not any("loss" in h for h in trainer.state.log_history if "gradkit/grad_norm" in h)


def test_reentrant_gradient_checkpointing_is_refused_with_the_setting_that_works(tmp_path):
    """Reentrant checkpointing hides the examples from the monitor: the refusal spoke of
    batch_dim; it now names the Trainer's setting and use_reentrant=False, which works."""

    def run(reentrant):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
            logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
            disable_tqdm=True, seed=0, activation_checkpointing=True,
            activation_checkpointing_kwargs={"use_reentrant": reentrant},
        )  # fmt: skip
        model = gpt2()
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Rows(), data_collator=Recorder()
        )
        callback = monitor_trainer(trainer, every=1)
        return trainer, callback, model

    trainer, _, model = run(True)
    with pytest.raises(GradkitError, match=r"activation_checkpointing_kwargs.*use_reentrant=False"):
        trainer.train()
    # only the Trainer's own hook (its embeddings' output requires grad) stays
    assert _hooks(model) == len(model.transformer.wte._forward_hooks) == 1
    trainer, callback, _ = run(False)
    trainer.train()
    (record,) = callback.monitor.records
    assert record["grad_norm"] == pytest.approx(_grad_norms(trainer)[0], rel=1e-6)


_MT = r"^monitor_trainer\(trainer, \.\.\.\): "
_CB = r"^GradientMonitorCallback\(every, \.\.\.\): "


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda t: monitor_trainer(t, every=0), ValueError, _MT + "every:"),
        (
            lambda t: monitor_trainer(t, loss_reduction="mean"),
            ValueError,
            _MT + "loss_reduction: expected 'sum' or left out",
        ),
        (lambda t: monitor_trainer(t, quantities=("batch_l2",)), ValueError, _MT + "quantities"),
        (lambda t: monitor_trainer(t, writer=123), TypeError, _MT + "writer"),
        (
            lambda t: monitor_trainer(t, evry=5),
            TypeError,
            _MT + "evry: expected one of its options: every, ",
        ),
        (lambda t: monitor_trainer(t.model), TypeError, _MT + "trainer: expected a transfo"),
        (lambda t: monitor_trainer(None), TypeError, _MT + "trainer: .* got None"),
        (lambda t: _callback(every=0), ValueError, _CB + "every:"),
        (lambda t: _callback(fallback="never"), ValueError, _CB + "fallback"),
    ],
)
def test_option_errors_name_the_call_made_and_the_argument_passed(tmp_path, make, error, pattern):
    """They named GradientMonitor(model, ...), or scale_to_grad (never passed), or came as a
    bare TypeError or AttributeError, or only once training had started."""
    trainer = _gpt2_trainer(tmp_path, max_steps=1, logging_steps=1)
    with pytest.raises(error, match=pattern):
        make(trainer)


def _callback(**options):
    from gradkit.integrations.transformers import GradientMonitorCallback

    return GradientMonitorCallback(**options)

"""gradkit in the Hugging Face ``Trainer``: a :class:`GradientMonitor` inside the Trainer's own
gradient accumulation, logged through the Trainer's loggers.

Use it as::

    from gradkit.integrations.transformers import monitor_trainer

    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = monitor_trainer(trainer, every=50, writer="runs/grads.jsonl")
    trainer.train()

Every ``every``-th optimizer step, the statistics of the individual gradients of the whole
accumulated batch (all its micro-batches, and all ranks) are summarized, as
:class:`~gradkit.monitor.GradientMonitor` does, and logged with the step's other metrics under
``gradkit/...`` keys (TensorBoard, W&B, MLflow, the console: whatever ``report_to`` names), and
to ``writer`` when given. Other steps run without any hook.

The Trainer normalizes the loss itself (by the window's token count when the model takes
``num_items_in_batch``, else by the number of micro-batches), so the monitor takes each
example's share of the backpropagated loss (``loss_reduction="sum"``) scaled by the number of
examples (``scale_to_grad=True``): the individual gradients' mean is then the gradient in
``.grad`` before clipping, and the noise scale and SNR are those of the examples' own losses
(a micro-batch's mean divided by the number of micro-batches is read as a mean: also for an
epoch's short last micro-batch, see ``docs/monitor.md``).
Under ``fp16`` the Trainer's accelerator also multiplies the loss by its ``GradScaler``:
:func:`monitor_trainer` passes that scaler on (``loss_scale``), so its scale, read at each
tracked step, is divided out; with the callback alone, pass
``loss_scale=trainer.accelerator.scaler``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from gradkit.integrations._common import MonitorWindow
from gradkit.monitor import GradientMonitor

__all__ = ["GradientMonitorCallback", "monitor_trainer"]


class GradientMonitorCallback(TrainerCallback):
    """A ``TrainerCallback`` running a :class:`~gradkit.monitor.GradientMonitor` on the
    Trainer's model: tracking starts at ``on_step_begin`` (before the window's first
    micro-batch) of every ``every``-th optimizer step and ends at ``on_pre_optimizer_step``
    (after its last backward). Prefer :func:`monitor_trainer`, which also puts the callback
    first so that the Trainer's loggers receive its metrics.

    Args:
        every: track optimizer steps ``0, every, 2 every, ...``.
        writer, quantities, layers, **options: as :class:`~gradkit.monitor.GradientMonitor`
            (``loss_reduction`` and ``scale_to_grad`` are set for the Trainer's loss).
        log_layers: also put the per-layer numbers in the Trainer's logs (they always reach
            ``writer``); off by default: three numbers per layer crowd the console.
        model: the model to watch (default: the Trainer's, at ``on_train_begin``).

    Attributes:
        monitor: the :class:`~gradkit.monitor.GradientMonitor` (after training starts).
    """

    def __init__(
        self,
        every: int = 50,
        *,
        writer: Any = None,
        quantities: tuple[str, ...] = ("variance", "batch_l2"),
        layers: bool = True,
        log_layers: bool = False,
        model: torch.nn.Module | None = None,
        **options: Any,
    ) -> None:
        self.window = MonitorWindow(every, writer, quantities, layers, log_layers, options)
        self._pending: dict[str, float] | None = None
        # set by monitor_trainer: the metrics then go out through trainer.log, leaving the
        # Trainer's own logging (and the loss it averages between logs) as it is
        self.trainer: Any = None
        if model is not None:
            self.window.attach(model)

    @property
    def monitor(self) -> GradientMonitor | None:
        """The :class:`~gradkit.monitor.GradientMonitor` (after training starts)."""
        return self.window.monitor

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if kwargs.get("model") is not None:
            self.window.attach(kwargs["model"], kwargs.get("optimizer"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.window.monitor is None and kwargs.get("model") is not None:
            self.window.attach(kwargs["model"], kwargs.get("optimizer"))
        self.window.start(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        numbers = self.window.finish()
        if numbers is not None:
            self._pending = numbers

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._pending is None:
            return control
        if self.trainer is not None:  # a log line of their own, at this step
            numbers, self._pending = self._pending, None
            self.trainer.log(dict(numbers))
            return control
        # added by hand: this step's log carries them (its loss averages over fewer steps)
        control.should_log = True
        return control

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if self._pending is None or logs is None:
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.window.abort()


def monitor_trainer(trainer: Any, every: int = 50, **options: Any) -> GradientMonitorCallback:
    """Add a :class:`GradientMonitorCallback` to ``trainer``, first among its callbacks (so
    that the loggers ``report_to`` names receive its metrics), and return it.

    Args:
        trainer: a ``transformers.Trainer``.
        every, **options: as :class:`GradientMonitorCallback`.
    """
    # under fp16 the accelerator's GradScaler multiplies the loss the Trainer backpropagates
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    if scaler is not None and options.get("loss_scale") is None:
        options["loss_scale"] = scaler
    callback = GradientMonitorCallback(every, model=trainer.model, **options)
    callback.trainer = trainer
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback

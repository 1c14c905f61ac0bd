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

import functools
import inspect
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import CallbackHandler

from gradkit._errors import GradkitError, describe, message
from gradkit.integrations._common import MonitorWindow
from gradkit.monitor import GradientMonitor

__all__ = ["GradientMonitorCallback", "monitor_trainer"]

_CALL = "GradientMonitorCallback(every, ...)"
_OWN = ("every", "log_layers", "model")


def _caller(callback: Any) -> tuple[Any, Any]:
    """The Trainer's ``CallbackHandler`` calling ``callback`` now and the Trainer that owns it,
    found up the stack (None where not found): an event passes neither."""
    handler = trainer = None
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if handler is None:
                if isinstance(owner, CallbackHandler) and any(
                    c is callback for c in owner.callbacks
                ):
                    handler = owner
            elif isinstance(owner, Trainer) and owner.callback_handler is handler:
                trainer = owner
                break
            frame = frame.f_back
    finally:
        del frame
    return handler, trainer


class GradientMonitorCallback(TrainerCallback):
    """A ``TrainerCallback`` running a :class:`~gradkit.monitor.GradientMonitor` on the
    Trainer's model: tracking starts at ``on_step_begin`` (before the window's first
    micro-batch) of every ``every``-th optimizer step and ends at ``on_pre_optimizer_step``
    (after its last backward). Added by hand (``Trainer(callbacks=[...])``,
    ``trainer.add_callback``), it moves itself first among the Trainer's callbacks when the
    Trainer first calls it, as :func:`monitor_trainer` puts it, so that the Trainer's loggers
    receive its metrics.

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
        call = options.pop("_call", _CALL)  # monitor_trainer's errors name monitor_trainer
        self.window = MonitorWindow(
            every, writer, quantities, layers, log_layers, options, call, _OWN
        )
        self._pending: dict[str, float] | None = None
        # the Trainer (set by monitor_trainer, else found when the Trainer calls): the metrics
        # then go out through trainer.log, leaving the Trainer's own logging (and the loss it
        # averages between logs) as it is
        self.trainer: Any = None
        self._warned_order = False
        self._guarded: Any = None  # the Trainer whose training_step closes an open step
        if model is not None:
            self.window.attach(model)

    @property
    def monitor(self) -> GradientMonitor | None:
        """The :class:`~gradkit.monitor.GradientMonitor` (after training starts)."""
        return self.window.monitor

    def _lead(self) -> None:
        """Go first among the Trainer's callbacks, so that the reporting callbacks (TensorBoard,
        W&B, the console) after it see its metrics in ``logs``, and log through that Trainer; a
        warning, once, where the Trainer cannot be found."""
        handler, trainer = _caller(self)
        if handler is None:
            if not self._warned_order:
                self._warned_order = True
                warnings.warn(
                    f"{_CALL}: the Trainer calling this callback was not found, so it cannot "
                    "go first among the Trainer's callbacks: its gradkit/... metrics reach only "
                    "the loggers that come after it. Add it with "
                    "gradkit.integrations.transformers.monitor_trainer(trainer, ...). Said once.",
                    stacklevel=3,
                )
            return
        callbacks = handler.callbacks
        if callbacks[0] is not self:
            # (CallbackHandler walks the list by index: the callbacks after this one still run)
            del callbacks[next(i for i, c in enumerate(callbacks) if c is self)]
            callbacks.insert(0, self)
        if trainer is not None:
            self.trainer = trainer

    def _guard(self, trainer: Any, args: Any) -> None:
        """Close the open step when the Trainer's ``training_step`` raises (the Trainer has no
        event for it): no hook stays on the model after a ``train()`` that raised."""
        if self._guarded is trainer:
            return
        self._guarded = trainer
        window, step = self.window, trainer.training_step
        # (transformers 5 names them activation_checkpointing, with the old names as aliases)
        name = (
            "activation_checkpointing"
            if hasattr(args, "activation_checkpointing")
            else "gradient_checkpointing"
        )
        kwargs = getattr(args, name + "_kwargs", None) or {}
        reentrant = bool(getattr(args, name, False)) and kwargs.get("use_reentrant") is True

        @functools.wraps(step)
        def training_step(*a: Any, **kw: Any) -> Any:
            try:
                return step(*a, **kw)
            except GradkitError as err:
                tracked = window._open
                window.abort()
                if tracked and reentrant:
                    raise GradkitError(
                        message(
                            window.call,
                            f"the Trainer's {name}_kwargs",
                            "use_reentrant=False (the monitor follows each example's gradient "
                            "through non-reentrant checkpointing, not through the reentrant "
                            "one)",
                            f"{kwargs!r}",
                            f"pass TrainingArguments({name}=True, "
                            f"{name}_kwargs={{'use_reentrant': False}})",
                        )
                    ) from err
                raise
            except BaseException:
                window.abort()
                raise

        trainer.training_step = training_step

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._lead()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a step left open by a train() that raised part-way (under auto_find_batch_size the
        # Trainer itself catches the out-of-memory error and trains again): its hooks go, its
        # micro-batches are not counted in the new run's first step
        self.window.abort()
        self._pending = None
        self._lead()
        if self.trainer is not None:
            self._guard(self.trainer, args)
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
        # no Trainer found: this step's log carries them (its loss averages over fewer steps)
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
    call = "monitor_trainer(trainer, ...)"
    if not isinstance(trainer, Trainer):
        raise TypeError(
            message(
                call,
                "trainer",
                "a transformers.Trainer",
                describe(trainer),
                "make the Trainer first (Trainer(model=model, args=args, ...)) and pass it; "
                "a model alone has no training loop to hook into",
            )
        )
    if "model" in options:
        raise TypeError(
            message(
                call,
                "model",
                "left out (the Trainer's model is watched)",
                describe(options["model"]),
                "leave model out, or add GradientMonitorCallback(model=...) yourself",
            )
        )
    # under fp16 the accelerator's GradScaler multiplies the loss the Trainer backpropagates
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    if scaler is not None and options.get("loss_scale") is None:
        options["loss_scale"] = scaler
    callback = GradientMonitorCallback(every, model=trainer.model, _call=call, **options)
    callback.trainer = trainer
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback

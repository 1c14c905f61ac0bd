"""gradkit in Lightning: a :class:`~gradkit.monitor.GradientMonitor` inside Lightning's own
gradient accumulation, logged through the trainer's loggers.

Use it as::

    from gradkit.integrations.lightning import GradientMonitorCallback

    trainer = lightning.Trainer(callbacks=[GradientMonitorCallback(every=50)], ...)

Every ``every``-th optimizer step, tracking starts at the window's first micro-batch
(``on_train_batch_start``) and ends after its last backward (``on_before_optimizer_step``,
before Lightning clips); the summary goes to the trainer's loggers under ``gradkit/...`` keys,
at the step it describes, and to ``writer`` when given. Other steps run without any hook.

Lightning divides the loss by ``accumulate_grad_batches`` and the loss is usually a mean over
the micro-batch, so the monitor takes each example's share of the backpropagated loss
(``loss_reduction="sum"``) scaled by the number of examples (``scale_to_grad=True``): the
individual gradients' mean is the gradient in ``.grad`` before clipping (in windows of equal
micro-batches; in others, the examples' own mean), and the noise scale
and SNR are those of the examples' own losses (each micro-batch's mean divided by
``accumulate_grad_batches`` is read as a mean: also for an epoch's short last micro-batch, or
its last window of fewer micro-batches, see ``docs/monitor.md``). Under
``precision="16-mixed"`` the loss is also multiplied by the precision plugin's ``GradScaler``:
its scale, read at each tracked step, is divided out (``loss_scale``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from gradkit.integrations._common import MonitorWindow
from gradkit.monitor import GradientMonitor

__all__ = ["GradientMonitorCallback"]

_CALL = "GradientMonitorCallback(every, ...)"


class GradientMonitorCallback(Callback):
    """A Lightning ``Callback`` running a :class:`~gradkit.monitor.GradientMonitor` on the
    LightningModule.

    Args:
        every: track optimizer steps ``0, every, 2 every, ...`` (``trainer.global_step``).
        writer, quantities, layers, **options: as :class:`~gradkit.monitor.GradientMonitor`
            (``loss_reduction`` and ``scale_to_grad`` are set for Lightning's loss).
        log_layers: also send the per-layer numbers to the trainer's loggers (they always
            reach ``writer``).

    Attributes:
        monitor: the :class:`~gradkit.monitor.GradientMonitor` (after ``setup``).
    """

    def __init__(
        self,
        every: int = 50,
        *,
        writer: Any = None,
        quantities: tuple[str, ...] = ("variance", "batch_l2"),
        layers: bool = True,
        log_layers: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self.window = MonitorWindow(every, writer, quantities, layers, log_layers, options, _CALL)

    @property
    def monitor(self) -> GradientMonitor | None:
        """The :class:`~gradkit.monitor.GradientMonitor` (after ``setup``)."""
        return self.window.monitor

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # under "16-mixed", the precision plugin's GradScaler multiplies the loss backpropagated
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        self.window.attach(pl_module, scaler=scaler)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % max(1, trainer.accumulate_grad_batches) == 0:  # a step's first
            self.window.start(trainer.global_step)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning divides every micro-batch's loss by accumulate_grad_batches, also in an
        # epoch's last window of fewer micro-batches
        numbers = self.window.finish(divided_by=max(1, trainer.accumulate_grad_batches))
        if numbers is None:
            return
        # straight to the loggers: log_dict would store float32 copies and emit them again at
        # later steps that logged nothing
        for logger in trainer.loggers:
            logger.log_metrics(numbers, step=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.window.abort()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.window.abort()

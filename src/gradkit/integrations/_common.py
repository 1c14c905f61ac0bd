"""What the trainer callbacks share: the monitor's options for a trainer's own loss
normalization, and a record as the flat ``gradkit/...`` metrics trainers log."""

from __future__ import annotations

from typing import Any

import torch

from gradkit.monitor import GradientMonitor
from gradkit.monitor._writers import flat_scalars

__all__ = ["MonitorWindow", "metrics", "monitor_options"]


def monitor_options(
    writer: Any, quantities: tuple[str, ...], layers: bool, options: dict[str, Any]
) -> dict[str, Any]:
    """Keyword arguments of :class:`~gradkit.monitor.GradientMonitor` for a trainer that
    divides the loss itself: each example's share, scaled so that the individual gradients'
    mean is the gradient in ``.grad``."""
    return {
        "writer": writer,
        "quantities": quantities,
        "layers": layers,
        "loss_reduction": "sum",
        "scale_to_grad": True,
        **options,
    }


def metrics(record: dict[str, Any], layers: bool) -> dict[str, float]:
    """The record's numbers as ``gradkit/<key>`` (and ``gradkit/layers/<layer>/<key>`` with
    ``layers``)."""
    return {
        f"gradkit/{tag}": value
        for tag, value in flat_scalars(record)
        if layers or not tag.startswith("layers/")
    }


class MonitorWindow:
    """A :class:`~gradkit.monitor.GradientMonitor` driven by a trainer's hooks: ``start`` at the
    first micro-batch of an optimizer step, ``finish`` after its last backward (the record as
    ``gradkit/...`` metrics), ``abort`` when training stops in between."""

    def __init__(
        self,
        every: int,
        writer: Any,
        quantities: tuple[str, ...],
        layers: bool,
        log_layers: bool,
        options: dict[str, Any],
    ) -> None:
        self.every = every
        self.log_layers = log_layers
        self._options = monitor_options(writer, quantities, layers, options)
        self.monitor: GradientMonitor | None = None
        self._open = False

    def attach(
        self, model: torch.nn.Module, optimizer: Any = None, scaler: Any = None
    ) -> GradientMonitor:
        """The monitor of ``model`` (a new one when the model changed); ``optimizer`` gives the
        learning rate of the CABS batch size; ``scaler``, the trainer's ``GradScaler`` under
        fp16, the factor its backpropagated loss carries (read at each tracked step; a
        ``loss_scale`` given in the options wins)."""
        if self.monitor is None or self.monitor.model is not model:
            lr_source = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
            options = dict(self._options)
            if scaler is not None and options.get("loss_scale") is None:
                options["loss_scale"] = scaler
            self.monitor = GradientMonitor(model, every=self.every, optimizer=lr_source, **options)
        return self.monitor

    def start(self, step: int) -> None:
        """Open optimizer step ``step`` when it is tracked (nothing otherwise)."""
        if self.monitor is not None and not self._open and self.monitor.tracks(step):
            self.monitor.begin(step)
            self._open = True

    def finish(self, divided_by: int | None = None) -> dict[str, float] | None:
        """Close the open step: its metrics (None when no step was open); ``divided_by``: as
        :meth:`~gradkit.monitor.GradientMonitor.end`."""
        if not self._open or self.monitor is None:
            return None
        self._open = False
        record = self.monitor.end(divided_by=divided_by)
        return None if record is None else metrics(record, self.log_layers)

    def abort(self) -> None:
        """Remove the hooks of an open step and log nothing."""
        if self._open and self.monitor is not None:
            self._open = False
            self.monitor.end(failed=True)

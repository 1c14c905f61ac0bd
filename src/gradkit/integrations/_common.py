"""What the trainer callbacks share: the monitor's options for a trainer's own loss
normalization, and a record as the flat ``gradkit/...`` metrics trainers log."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from gradkit._errors import message
from gradkit._validate import check_bool
from gradkit.monitor import GradientMonitor
from gradkit.monitor._monitor import check_options
from gradkit.monitor._writers import flat_scalars, make_writers
from gradkit.per_example import track

__all__ = ["MonitorWindow", "check_window_options", "metrics", "monitor_options"]

# the keyword arguments of GradientMonitor the callbacks pass on (every, the model and the
# optimizer are the trainer's)
_MONITOR_OPTIONS = (
    "writer",
    "quantities",
    "layers",
    "lr",
    "loss_reduction",
    "scale_to_grad",
    "group",
)


def check_window_options(
    call: str, every: Any, options: dict[str, Any], given: dict[str, Any], own: tuple[str, ...]
) -> None:
    """Check a callback's options when it is made (before it has a model), naming ``call``:
    ``options`` the monitor's keyword arguments, ``given`` those the user passed among them,
    ``own`` the callback's other arguments (for the message)."""
    accepted = _MONITOR_OPTIONS + tuple(
        name
        for name in inspect.signature(track).parameters
        if name not in ("model", "quantities", *_MONITOR_OPTIONS)
    )
    unknown = [name for name in given if name not in accepted]
    if unknown:
        raise TypeError(
            message(
                call,
                unknown[0],
                "one of its options: " + ", ".join(own + accepted),
                f"{unknown[0]}={given[unknown[0]]!r}",
                "check the spelling of the option",
            )
        )
    reduction = given.get("loss_reduction", "sum")
    if reduction != "sum" and "scale_to_grad" not in given:
        raise ValueError(
            message(
                call,
                "loss_reduction",
                "'sum' or left out (the trainer divides the loss itself: the callback takes "
                "each example's share of it, scaled so that the individual gradients' mean is "
                "the gradient in .grad)",
                repr(reduction),
                "leave loss_reduction out",
            )
        )
    check_options(
        call,
        quantities=options["quantities"],
        every=every,
        layers=options["layers"],
        loss_reduction=options["loss_reduction"],
        scale_to_grad=options["scale_to_grad"],
        optimizer=None,
        lr=options.get("lr"),
    )
    make_writers(options["writer"], call)
    track_options = {k: v for k, v in options.items() if k not in _MONITOR_OPTIONS}
    track_options["loss_reduction"] = options["loss_reduction"]
    if isinstance(track_options.get("batch_dim"), dict):  # module names: checked with the model
        del track_options["batch_dim"]
    try:
        track(nn.Linear(1, 1), *options["quantities"], **track_options)
    except (TypeError, ValueError) as err:
        text = str(err).replace("per_example.track(model, ...)", call, 1)
        raise type(err)(text) from None


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
        call: str,
        own: tuple[str, ...] = ("every", "log_layers"),
    ) -> None:
        self.call = call
        self._options = monitor_options(writer, quantities, layers, options)
        check_window_options(call, every, self._options, options, own)
        check_bool(log_layers, call, "log_layers")
        self.every = every
        self.log_layers = log_layers
        self.monitor: GradientMonitor | None = None
        self._open = False
        self._step: int | None = None  # the open step's number
        self._warned_stale = False

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
        """Open optimizer step ``step`` when it is tracked (nothing otherwise). A tracked step
        still open did not reach its optimizer step (the training loop left it, or skipped
        it): its hooks are removed and its micro-batches dropped, with a warning, rather than
        counted in step ``step``."""
        if self._open:
            if not self._warned_stale:
                self._warned_stale = True
                warnings.warn(
                    f"{self.call}: tracked step {self._step} did not reach its optimizer step "
                    f"before step {step} began: its statistics are dropped (no record), and "
                    f"step {step} is counted on its own. Said once per callback.",
                    stacklevel=3,
                )
            self.abort()
        if self.monitor is not None and self.monitor.tracks(step):
            self.monitor.begin(step)
            self._open = True
            self._step = step

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

"""What the trainer callbacks share: the monitor's options for a trainer's own loss
normalization, and a record as the flat ``gradkit/...`` metrics trainers log."""

from __future__ import annotations

from typing import Any

from gradkit.monitor._writers import flat_scalars

__all__ = ["metrics", "monitor_options"]


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

"""Gradient statistics over training, logged: :class:`GradientMonitor` tracks one step in every
``k`` with :func:`gradkit.per_example.track` and writes a summary (gradient norm, noise scale,
SNR, per-example norm quantiles, CABS batch size; whole model and per layer) to JSON lines,
TensorBoard or any callable. Trainer integrations live in :mod:`gradkit.integrations`."""

from gradkit._validate import expose
from gradkit.monitor._monitor import GradientMonitor, MonitorStep, read_records
from gradkit.monitor._summary import QUANTILES
from gradkit.monitor._writers import JsonLinesWriter, TensorBoardWriter

__all__ = [
    "QUANTILES",
    "GradientMonitor",
    "JsonLinesWriter",
    "MonitorStep",
    "TensorBoardWriter",
    "read_records",
]

expose(globals(), __all__, __name__)

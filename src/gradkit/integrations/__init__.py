"""Integrations with the training loops users already run, each imported on its own (nothing
here is imported by ``import gradkit``):

* :mod:`gradkit.integrations.transformers`: a :class:`~gradkit.monitor.GradientMonitor` in the
  Hugging Face ``Trainer`` (``monitor_trainer(trainer, every=...)``); needs ``transformers``
  and ``accelerate``.
* :mod:`gradkit.integrations.lightning`: the same as a Lightning ``Callback``
  (``GradientMonitorCallback(every=...)``); needs ``lightning``.
"""

__all__: list[str] = []

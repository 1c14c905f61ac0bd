"""gradkit: everything about gradients that ``loss.backward()`` does not give you.

Pillars (each a subpackage):

* :mod:`gradkit.func`: TensorFlow-style ``gradients``/``hessians`` on PyTorch graphs, Jacobians
  with automatic forward/reverse choice, Hessians, HVP operators, ``custom_gradient``.
* :mod:`gradkit.per_example`: statistics of individual gradients (moments, variance, norms,
  per-example gradients) inside one batched backward pass.
* :mod:`gradkit.accumulate`: exact micro-batch accumulation, TensorFlow's
  ConditionalAccumulator with its traps fixed, data-parallel training.
* :mod:`gradkit.optim` and :mod:`gradkit.hyper`: differentiable functional optimizers and
  hypergradients (reverse with replay and checkpointing, forward, truncated, implicit).
* :mod:`gradkit.curvature`: matrix-free Hessian, GGN and Fisher operators, diagonals, traces,
  eigenvalues.
* :mod:`gradkit.monitor`: gradient statistics over training, logged (and
  :mod:`gradkit.integrations` for the Hugging Face ``Trainer``).
* :mod:`gradkit.testing`: the oracles every result is checked against.
"""

from gradkit import accumulate, curvature, func, hyper, monitor, optim, per_example, testing
from gradkit._errors import GradkitError
from gradkit._validate import expose
from gradkit._version import __version__

__all__ = [
    "GradkitError",
    "__version__",
    "accumulate",
    "curvature",
    "func",
    "hyper",
    "monitor",
    "optim",
    "per_example",
    "testing",
]

expose(globals(), __all__, __name__)

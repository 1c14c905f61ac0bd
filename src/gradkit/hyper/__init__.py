"""gradkit.hyper: hypergradients, d(outer loss)/d(hyperparameters), through training.

* :func:`reverse`: exact reverse mode through T optimizer steps; the state history is one
  preallocated buffer and each step is replayed once with a vector-Jacobian product
  (optionally with checkpointing every k steps);
* :func:`forward`: forward mode, tangents pushed through the steps; memory independent of T;
* :func:`truncated`: reverse mode through the last K steps;
* :func:`implicit`: implicit differentiation at an inner optimum (CG, Neumann series, fixed
  point), matrix-free through Hessian-vector products;
* :class:`HyperResult`: what the engines return with ``full_output=True``;
* :class:`HyperOptimizer`: the outer loop over the hyperparameters (reverse, truncated,
  forward, real-time forward = RTHO, implicit) with a ``torch.optim`` optimizer, projections,
  a history (:class:`HyperStep`) and ``state_dict`` to resume;
* projections onto constraint sets: :func:`project_box`, :func:`project_simplex`,
  :func:`project_l1_ball`, :func:`project_capped_simplex`, and :func:`projection` by name.

The inner dynamics are a :mod:`gradkit.optim` optimizer; hyperparameters are tensors the
optimizer was built with or that the losses close over.
"""

from gradkit._validate import expose
from gradkit.hyper._budget import MemoryBudgetWarning
from gradkit.hyper._forward import forward
from gradkit.hyper._implicit import NotStationaryWarning, implicit
from gradkit.hyper._optimizer import HyperOptimizer, HyperStep
from gradkit.hyper._problem import HyperResult
from gradkit.hyper._projections import (
    project_box,
    project_capped_simplex,
    project_l1_ball,
    project_simplex,
    projection,
)
from gradkit.hyper._reverse import reverse, truncated

__all__ = [
    "HyperOptimizer",
    "HyperResult",
    "HyperStep",
    "MemoryBudgetWarning",
    "NotStationaryWarning",
    "forward",
    "implicit",
    "project_box",
    "project_capped_simplex",
    "project_l1_ball",
    "project_simplex",
    "projection",
    "reverse",
    "truncated",
]

expose(globals(), __all__, __name__)

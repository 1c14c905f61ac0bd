"""gradkit.hyper: hypergradients, d(outer loss)/d(hyperparameters), through training.

* :func:`reverse`: exact reverse mode through T optimizer steps; the state history is one
  preallocated buffer and each step is replayed once with a vector-Jacobian product
  (optionally with checkpointing every k steps);
* :func:`forward`: forward mode, tangents pushed through the steps; memory independent of T;
* :func:`truncated`: reverse mode through the last K steps;
* :func:`implicit`: implicit differentiation at an inner optimum (CG, Neumann series, fixed
  point), matrix-free through Hessian-vector products;
* :class:`HyperResult`: what the engines return with ``full_output=True``.

The inner dynamics are a :mod:`gradkit.optim` optimizer; hyperparameters are tensors the
optimizer was built with or that the losses close over.
"""

from gradkit.hyper._forward import forward
from gradkit.hyper._implicit import implicit
from gradkit.hyper._problem import HyperResult
from gradkit.hyper._reverse import reverse, truncated

__all__ = ["HyperResult", "forward", "implicit", "reverse", "truncated"]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("gradkit.hyper._"):
        _obj.__module__ = __name__
del _name, _obj

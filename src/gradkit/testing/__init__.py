"""gradkit.testing: the oracles gradkit is tested against, offered to users who write rules.

* :func:`per_example_grads`: one example at a time with autograd (float64 by default);
* :func:`finite_difference_grad`, :func:`finite_difference_jacobian`,
  :func:`finite_difference_hvp`: central differences in float64;
* :func:`tolerances` and :func:`assert_close`: one tolerance policy by dtype, every mismatch
  reported;
* :func:`run_ranks`: a script as several gloo ranks on this machine, for distributed tests.
"""

from gradkit._validate import expose
from gradkit.testing._distributed import free_port, run_ranks
from gradkit.testing._oracles import (
    finite_difference_grad,
    finite_difference_hvp,
    finite_difference_jacobian,
    per_example_grads,
)
from gradkit.testing._tolerance import assert_close, tolerances

__all__ = [
    "assert_close",
    "finite_difference_grad",
    "finite_difference_hvp",
    "finite_difference_jacobian",
    "free_port",
    "per_example_grads",
    "run_ranks",
    "tolerances",
]

expose(globals(), __all__, __name__)

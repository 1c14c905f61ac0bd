"""gradkit.func: differentiation beyond ``loss.backward()``.

* TensorFlow's graph API on PyTorch graphs: :func:`gradients`, :func:`hessians`.
* Function transforms: :func:`grad`, :func:`value_and_grad`, :func:`jvp`, :func:`vjp`,
  :func:`jacobian` (automatic forward/reverse choice), :func:`batch_jacobian`,
  :func:`hessian`, :func:`hvp`, :func:`hvp_operator`, :func:`stop_gradient`,
  :func:`custom_gradient`.
* The same on ``(model, loss_fn, batch)``: :func:`module_grad`, :func:`module_value_and_grad`,
  :func:`module_hvp`, :func:`module_hvp_operator`, :func:`module_ggnvp`, :func:`module_hessian`,
  :func:`module_jacobian`.
"""

from gradkit._validate import expose
from gradkit.func._custom import custom_gradient
from gradkit.func._gradients import AggregationMethod, UnconnectedGradients, gradients, hessians
from gradkit.func._hvp import HVPOperator, hvp, hvp_operator
from gradkit.func._module import (
    module_grad,
    module_hessian,
    module_jacobian,
    module_value_and_grad,
)
from gradkit.func._module_ggnvp import module_ggnvp
from gradkit.func._module_hvp import module_hvp, module_hvp_operator
from gradkit.func._transforms import (
    batch_jacobian,
    grad,
    hessian,
    jacobian,
    jvp,
    stop_gradient,
    value_and_grad,
    vjp,
)

__all__ = [
    "AggregationMethod",
    "HVPOperator",
    "UnconnectedGradients",
    "batch_jacobian",
    "custom_gradient",
    "grad",
    "gradients",
    "hessian",
    "hessians",
    "hvp",
    "hvp_operator",
    "jacobian",
    "jvp",
    "module_ggnvp",
    "module_grad",
    "module_hessian",
    "module_hvp",
    "module_hvp_operator",
    "module_jacobian",
    "module_value_and_grad",
    "stop_gradient",
    "value_and_grad",
    "vjp",
]

expose(globals(), __all__, __name__)

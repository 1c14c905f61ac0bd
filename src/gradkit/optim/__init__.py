"""gradkit.optim: functional, differentiable optimizers.

* :func:`sgd` (momentum, dampening, Nesterov, weight decay), :func:`adam`, :func:`adamw`,
  :func:`rmsprop`: each an :class:`Optimizer` with ``init(params) -> state`` and
  ``update(grads, state, params, **hyper) -> (new_params, new_state)``, out of place, step for
  step as ``torch.optim``, differentiable with respect to every tensor hyperparameter (scalar,
  per-parameter, or per-step schedule); the update itself from ``delta`` or
  ``update(..., return_delta=True)``; optional masks that keep pruned weights at zero.
* :func:`apply_updates`: ``params + delta``.
* :func:`state_layout`: parameters and optimizer state as one contiguous vector (the rows of
  the hypergradient engines' history buffers).
"""

from gradkit._tree import Grads, Params
from gradkit._validate import expose
from gradkit.optim._adam import AdamState, adam, adamw
from gradkit.optim._base import Optimizer, apply_updates
from gradkit.optim._flat import StateLayout, state_layout
from gradkit.optim._rmsprop import RMSpropState, rmsprop
from gradkit.optim._sgd import SGDState, sgd

__all__ = [
    "AdamState",
    "Grads",
    "Optimizer",
    "Params",
    "RMSpropState",
    "SGDState",
    "StateLayout",
    "adam",
    "adamw",
    "apply_updates",
    "rmsprop",
    "sgd",
    "state_layout",
]

expose(globals(), __all__, __name__)

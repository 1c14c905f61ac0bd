"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, step for
step as ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradkit._errors import message
from gradkit._validate import check_bool
from gradkit.optim._base import Optimizer, no_buffer
from gradkit.optim._values import Bounds, Scalar, is_zero

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`: the number of updates done, the momentum buffers (None without
    momentum), shaped like the parameters, and per parameter the number of updates of its
    momentum buffer (0: the next gradient starts the buffer; without momentum: its updates;
    None: ``step`` for all)."""

    step: int
    momentum_buffer: Any = None
    counts: Any = None


def _rule(nesterov: bool, maximize: bool, has_momentum: bool) -> Any:
    def rule(
        g: torch.Tensor,
        p: torch.Tensor,
        slots: dict[str, torch.Tensor],
        count: int,
        h: dict[str, Scalar],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if maximize:
            g = -g
        if not is_zero(h["weight_decay"]):
            g = g + h["weight_decay"] * p
        mu = h["momentum"]
        if not has_momentum and not is_zero(mu):
            raise ValueError(no_buffer("sgd", "momentum", mu))
        if not has_momentum or is_zero(mu):
            # torch.optim.SGD without momentum (this parameter's value is the number 0): no
            # buffer, no dampening, the buffer of earlier steps left alone
            return -h["lr"] * g, {}
        # torch.optim.SGD starts the buffer at the parameter's first gradient, undampened
        buf = g if count == 0 else mu * slots["momentum_buffer"] + (1 - h["dampening"]) * g
        g = g + mu * buf if nesterov else buf
        return -h["lr"] * g, {"momentum_buffer": buf}

    return rule


def sgd(
    lr: Any,
    momentum: Any = 0.0,
    dampening: Any = 0.0,
    weight_decay: Any = 0.0,
    *,
    nesterov: bool = False,
    maximize: bool = False,
    mask: Any = None,
) -> Optimizer:
    r"""Stochastic gradient descent, as ``torch.optim.SGD``, functional and differentiable.

    With :math:`\eta` = ``lr``, :math:`\mu` = ``momentum``, :math:`\tau` = ``dampening``,
    :math:`\lambda` = ``weight_decay`` and :math:`k` the number of earlier updates of the
    parameter's buffer (``state.counts``; the step count :math:`t` when every step had a
    gradient):

    .. math::
        g_t = \nabla_t + \lambda \theta_t, \quad
        b_t = \begin{cases} g_t & k = 0 \\ \mu b_{t-1} + (1 - \tau) g_t & k > 0 \end{cases},
        \quad \theta_{t+1} = \theta_t - \eta \,(g_t + \mu b_t \text{ if nesterov else } b_t)

    (without momentum: :math:`\theta_{t+1} = \theta_t - \eta g_t`). As in ``torch.optim.SGD``,
    a parameter without a gradient (``None``) is skipped, its buffer starts undampened at its
    first gradient, and a parameter whose momentum is the number 0 (one value per parameter,
    like a parameter group with ``momentum=0``) has no buffer and no dampening. A tensor
    momentum always drives the buffer (the smooth formula, whose derivative at 0 is the one a
    search over the momentum needs): with a dampening, a tensor momentum of value exactly 0
    dampens where ``torch.optim`` would not.

    Every hyperparameter may be a float, a 0-d tensor, a 1-d tensor indexed by the step count
    :math:`t` (a schedule), or one value per parameter (a dict for dict parameters, a tuple for
    tuple parameters; entries are numbers or tensors that broadcast to the parameter). Tensors
    are checked like numbers (finite, in range) when given, and may require grad. Results are
    differentiable with respect to every tensor.

    Args:
        lr: learning rate :math:`\eta`.
        momentum: :math:`\mu`; a tensor, or a nonzero number, turns the momentum buffer on.
        dampening: :math:`\tau`.
        weight_decay: L2 coefficient :math:`\lambda` added to the gradient.
        nesterov: Nesterov momentum (needs momentum and no dampening).
        maximize: ascend instead of descend.
        mask: None or a dict/tuple of boolean tensors (True = trainable, None = no mask);
            masked entries get no gradient, no state, and stay exactly zero.

    Returns:
        An :class:`Optimizer` whose state is an :class:`SGDState`.

    Examples:
        >>> import torch
        >>> from gradkit.optim import sgd
        >>> opt = sgd(lr=0.1, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params)
        >>> params, state, delta = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params,
        ...                                   return_delta=True)
        >>> delta["w"], params["w"], state.step
        (tensor([-0.1900, -0.1900]), tensor([0.7100, 1.7100]), 2)

    Hypergradients come from tensor hyperparameters:

        >>> lr = torch.tensor(0.1, requires_grad=True)
        >>> opt = sgd(lr=lr)
        >>> new, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> torch.autograd.grad(new["w"].sum(), lr)
        (tensor(-2.),)
    """
    call = "sgd"
    check_bool(nesterov, call, "nesterov")
    check_bool(maximize, call, "maximize")
    has_momentum = not is_zero(momentum)
    if nesterov and (not has_momentum or not is_zero(dampening)):
        raise ValueError(
            message(
                call,
                "nesterov",
                "momentum != 0 and dampening == 0 (as torch.optim.SGD)",
                f"momentum={momentum!r}, dampening={dampening!r}",
                "give a momentum and no dampening, or nesterov=False",
            )
        )
    rule = _rule(nesterov, maximize, has_momentum)
    return Optimizer(
        "sgd",
        rule,
        SGDState,
        ("momentum_buffer",) if has_momentum else (),
        {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay},
        {
            "lr": Bounds(),
            "momentum": Bounds(),
            "dampening": Bounds(0.0, 1.0),
            "weight_decay": Bounds(),
        },
        {"nesterov": nesterov, "maximize": maximize},
        mask=mask,
    )

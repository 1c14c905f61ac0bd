"""RMSprop, step for step as ``torch.optim.RMSprop`` (eps added outside the square root,
optional centering and momentum)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradkit._validate import check_bool
from gradkit.optim._base import Optimizer, lerp, no_buffer, safe_sqrt
from gradkit.optim._values import Bounds, Scalar, is_zero

__all__ = ["RMSpropState", "rmsprop"]


class RMSpropState(NamedTuple):
    """State of :func:`rmsprop`: the number of updates done, the running mean of squared
    gradients, the momentum buffer (None without momentum) and the running mean of gradients
    (``centered=True``, else None), and per parameter the number of updates of its state
    (``torch.optim``'s ``state[p]["step"]``; None: ``step`` for all)."""

    step: int
    square_avg: Any = None
    momentum_buffer: Any = None
    grad_avg: Any = None
    counts: Any = None


def _rule(centered: bool, maximize: bool, has_momentum: bool) -> Any:
    def rule(
        g: torch.Tensor,
        p: torch.Tensor,
        slots: dict[str, torch.Tensor],
        count: int,
        h: dict[str, Scalar],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if maximize:
            g = -g
        lr, alpha, eps, wd, mu = h["lr"], h["alpha"], h["eps"], h["weight_decay"], h["momentum"]
        if not is_zero(wd):
            g = g + wd * p
        sq = slots["square_avg"] * alpha + (1 - alpha) * g * g
        new = {"square_avg": sq}
        if centered:
            ga = lerp(slots["grad_avg"], g, 1 - alpha)
            new["grad_avg"] = ga
            avg = safe_sqrt(sq - ga * ga) + eps
        else:
            avg = safe_sqrt(sq) + eps
        if not has_momentum and not is_zero(mu):
            raise ValueError(no_buffer("rmsprop", "momentum", mu))
        if has_momentum and not is_zero(mu):
            buf = slots["momentum_buffer"] * mu + g / avg
            new["momentum_buffer"] = buf
            return -lr * buf, new
        # no momentum (this parameter's value is the number 0): the buffer is left alone
        return -lr * (g / avg), new

    return rule


def rmsprop(
    lr: Any = 1e-2,
    alpha: Any = 0.99,
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    momentum: Any = 0.0,
    *,
    centered: bool = False,
    maximize: bool = False,
    mask: Any = None,
) -> Optimizer:
    r"""RMSprop, as ``torch.optim.RMSprop``, functional and differentiable.

    With :math:`\eta` = ``lr``, :math:`\alpha` = ``alpha``, :math:`\mu` = ``momentum``:

    .. math::
        g = \nabla + \lambda\theta, \quad s \leftarrow \alpha s + (1 - \alpha) g^2, \quad
        \bar g \leftarrow \alpha \bar g + (1 - \alpha) g \text{ (centered)}, \\
        a = \sqrt{s - \bar g^2 \text{ (centered) or } s} + \epsilon, \quad
        b \leftarrow \mu b + g / a, \quad \theta \leftarrow \theta - \eta b
        \quad (\theta \leftarrow \theta - \eta g / a \text{ without momentum})

    The square root has derivative 0 at 0, and a negative centered variance from round-off
    gives 0 instead of NaN. Hyperparameter forms as in :func:`sgd`.

    Args:
        lr: learning rate.
        alpha: smoothing constant in [0, 1].
        eps: added to the denominator, > 0.
        weight_decay: L2 coefficient added to the gradient.
        momentum: :math:`\mu`; a tensor, or a nonzero number, turns the buffer on.
        centered: normalize by the estimated variance instead of the second moment.
        maximize: ascend instead of descend.
        mask: boolean masks, as in :func:`sgd`.

    Returns:
        An :class:`Optimizer` whose state is an :class:`RMSpropState`.

    Examples:
        >>> import torch
        >>> from gradkit.optim import rmsprop
        >>> opt = rmsprop(lr=0.01, alpha=0.75)
        >>> params = {"w": torch.tensor([1.0])}
        >>> new, state = opt.update({"w": torch.tensor([3.0])}, opt.init(params), params)
        >>> new["w"], state.square_avg["w"]  # 1 - 0.01 * 3 / sqrt(0.25 * 9)
        (tensor([0.9800]), tensor([2.2500]))
    """
    call = "rmsprop"
    check_bool(centered, call, "centered")
    check_bool(maximize, call, "maximize")
    has_momentum = not is_zero(momentum)
    slots: tuple[str, ...] = ("square_avg",)
    if has_momentum:
        slots += ("momentum_buffer",)
    if centered:
        slots += ("grad_avg",)
    return Optimizer(
        "rmsprop",
        _rule(centered, maximize, has_momentum),
        RMSpropState,
        slots,
        {"lr": lr, "alpha": alpha, "eps": eps, "weight_decay": weight_decay, "momentum": momentum},
        {
            "lr": Bounds(),
            "alpha": Bounds(0.0, 1.0),
            "eps": Bounds(low_open=True),
            "weight_decay": Bounds(),
            "momentum": Bounds(),
        },
        {"centered": centered, "maximize": maximize},
        mask=mask,
    )

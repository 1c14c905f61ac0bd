"""Adam and AdamW, step for step as ``torch.optim.Adam`` / ``torch.optim.AdamW``: eps added
after dividing by the bias-corrected square root (not inside it), bias corrections from the
current betas, optional AMSGrad."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradkit._errors import describe, message
from gradkit._validate import check_bool
from gradkit.optim._base import Optimizer, lerp, safe_sqrt
from gradkit.optim._values import Bounds, Scalar, is_zero

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`: the number of updates done, the first and second
    moment estimates, their running maximum with ``amsgrad=True`` (else None), and per
    parameter the number of updates of its moments (``torch.optim``'s ``state[p]["step"]``,
    the exponent of the bias corrections; None: ``step`` for all)."""

    step: int
    exp_avg: Any = None
    exp_avg_sq: Any = None
    max_exp_avg_sq: Any = None
    counts: Any = None


def _rule(amsgrad: bool, maximize: bool, decoupled: bool) -> Any:
    def rule(
        g: torch.Tensor,
        p: torch.Tensor,
        slots: dict[str, torch.Tensor],
        count: int,
        h: dict[str, Scalar],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if maximize:
            g = -g
        lr, b1, b2, eps, wd = h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
        decay = None
        if not is_zero(wd):
            if decoupled:
                decay = -(lr * wd) * p
            else:
                g = g + wd * p
        m = lerp(slots["exp_avg"], g, 1 - b1)
        v = slots["exp_avg_sq"] * b2 + (1 - b2) * g * g
        new = {"exp_avg": m, "exp_avg_sq": v}
        step = count + 1
        bias1 = 1 - b1**step
        bias2 = 1 - b2**step
        if amsgrad:
            v = torch.maximum(slots["max_exp_avg_sq"], v)
            new["max_exp_avg_sq"] = v
        denom = safe_sqrt(v) / bias2**0.5 + eps
        d = -(lr / bias1) * (m / denom)
        return (d if decay is None else decay + d), new

    return rule


def _build(
    name: str,
    lr: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    amsgrad: bool,
    maximize: bool,
    mask: Any,
) -> Optimizer:
    check_bool(amsgrad, name, "amsgrad")
    check_bool(maximize, name, "maximize")
    if not isinstance(betas, (tuple, list)):
        raise TypeError(
            message(
                name, "betas", "a pair (beta1, beta2)", describe(betas), "pass e.g. (0.9, 0.999)"
            )
        )
    if len(betas) != 2:
        raise ValueError(
            message(
                name, "betas", "a pair (beta1, beta2)", describe(betas), "pass e.g. (0.9, 0.999)"
            )
        )
    slots = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    unit = Bounds(0.0, 1.0, high_open=True)
    return Optimizer(
        name,
        _rule(amsgrad, maximize, decoupled=name == "adamw"),
        AdamState,
        slots,
        {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay},
        {
            "lr": Bounds(),
            "beta1": unit,
            "beta2": unit,
            "eps": Bounds(low_open=True),
            "weight_decay": Bounds(),
        },
        {"amsgrad": amsgrad, "maximize": maximize},
        mask=mask,
        aliases={"betas": ("beta1", "beta2")},
    )


def adam(
    lr: Any = 1e-3,
    betas: Any = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Any = None,
) -> Optimizer:
    r"""Adam, as ``torch.optim.Adam``, functional and differentiable.

    With :math:`\eta` = ``lr``, :math:`(\beta_1, \beta_2)` = ``betas``, :math:`\epsilon` =
    ``eps``, :math:`\lambda` = ``weight_decay`` and :math:`k` the parameter's own number of
    updates including this one (``state.counts + 1``, ``torch.optim``'s ``state[p]["step"]``;
    a parameter without a gradient at a step is skipped and does not count it):

    .. math::
        g = \nabla + \lambda \theta, \quad m \leftarrow \beta_1 m + (1 - \beta_1) g, \quad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2, \\
        \theta \leftarrow \theta - \frac{\eta}{1 - \beta_1^k}\,
        \frac{m}{\sqrt{\hat v} / \sqrt{1 - \beta_2^k} + \epsilon}

    with :math:`\hat v = v` (or its running maximum with ``amsgrad``). ``eps`` is added after
    the bias-corrected square root, as in ``torch.optim.Adam`` (higher#71 was a drift from it).
    The square root has derivative 0 where :math:`\hat v = 0` (never-updated entries), so
    hypergradients stay finite.

    Every hyperparameter may be a float, a 0-d tensor, a 1-d schedule indexed by the global
    step count, or one value per parameter (see :func:`sgd`); ``betas`` is a pair of such values
    and may be overridden per step with ``update(..., betas=(b1, b2))``.

    Args:
        lr: learning rate.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, > 0.
        weight_decay: L2 coefficient added to the gradient (see :func:`adamw` for decoupled).
        amsgrad: normalize by the running maximum of :math:`v`.
        maximize: ascend instead of descend.
        mask: boolean masks, as in :func:`sgd`.

    Returns:
        An :class:`Optimizer` whose state is an :class:`AdamState`.

    Examples:
        >>> import torch
        >>> from gradkit.optim import adam
        >>> opt = adam(lr=0.1)
        >>> params = (torch.tensor([1.0, -1.0]),)
        >>> new, state = opt.update((torch.tensor([2.0, -0.5]),), opt.init(params), params)
        >>> new[0]  # the first Adam step moves every weight by about lr
        tensor([ 0.9000, -0.9000])
    """
    return _build("adam", lr, betas, eps, weight_decay, amsgrad, maximize, mask)


def adamw(
    lr: Any = 1e-3,
    betas: Any = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 1e-2,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Any = None,
) -> Optimizer:
    r"""AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay,
    :math:`\theta \leftarrow \theta - \eta \lambda \theta - (\text{Adam step})`, the gradient
    left without the L2 term.

    Arguments and state as :func:`adam` (default ``weight_decay=1e-2``, as torch).

    Examples:
        >>> import torch
        >>> from gradkit.optim import adamw
        >>> opt = adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> new, _ = opt.update({"w": torch.tensor([0.0])}, opt.init(params), params)
        >>> new["w"]  # zero gradient: only the decay acts, 2 * (1 - 0.1 * 0.5)
        tensor([1.9000])
    """
    return _build("adamw", lr, betas, eps, weight_decay, amsgrad, maximize, mask)

"""The parameters a ``(model, loss_fn, batch)`` transform differentiates, chosen by name
(:mod:`gradkit.func`'s module transforms and :mod:`gradkit.curvature`'s operators)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gradkit._errors import describe, message
from gradkit._validate import check_module

__all__ = ["LossFn", "select_params"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, targets) -> scalar``."""


def select_params(
    model: nn.Module,
    params: Iterable[str] | str | None,
    call: str,
    *,
    given_order: bool = False,
    fix: str = "pass the model itself",
) -> dict[str, torch.Tensor]:
    """The parameters to differentiate by name: those with ``requires_grad=True`` when
    ``params`` is None, else the named ones (a name or a list of names; each must exist and
    require grad). In ``model.named_parameters()`` order, or in the order given with
    ``given_order``. ``fix`` is the remedy when ``model`` is not a module.

    Examples:
        >>> from torch import nn
        >>> list(select_params(nn.Linear(2, 1), "bias", "f"))
        ['bias']
    """
    check_module(model, call, fix)
    named: dict[str, torch.Tensor] = dict(model.named_parameters())
    if params is None:
        chosen = {n: p for n, p in named.items() if p.requires_grad}
    else:
        if not isinstance(params, (str, Iterable)) or isinstance(params, (bytes, dict)):
            raise TypeError(
                message(
                    call,
                    "params",
                    "None, a parameter name or a list of names",
                    describe(params),
                    f"pass e.g. params={list(named)[:2]}",
                )
            )
        wanted = [params] if isinstance(params, str) else list(params)
        unknown = [n for n in wanted if not isinstance(n, str) or n not in named]
        if unknown:
            raise ValueError(
                message(
                    call,
                    "params",
                    "names from model.named_parameters()",
                    repr(unknown),
                    f"choose among {list(named)[:8]}",
                )
            )
        frozen = [n for n in wanted if not named[n].requires_grad]
        if frozen:
            raise ValueError(
                message(
                    call,
                    "params",
                    "parameters with requires_grad=True",
                    f"frozen {frozen}",
                    "unfreeze them (p.requires_grad_()) or leave them out of params",
                )
            )
        if given_order:
            chosen = {n: named[n] for n in wanted}
        else:
            keep = set(wanted)
            chosen = {n: p for n, p in named.items() if n in keep}
    if not chosen:
        raise ValueError(
            message(
                call,
                "params",
                "at least one parameter with requires_grad=True",
                "none (all frozen or none selected)",
                "set requires_grad=True or name parameters in params=",
            )
        )
    return chosen

"""Checks of :class:`~gradkit.hyper.HyperOptimizer`'s arguments: projections by name or
function, the outer ``torch.optim`` optimizer (an instance over exactly the hyperparameters, a
factory, or the default), options that apply to some methods only, and the state a run is
resumed from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gradkit._errors import describe, message
from gradkit._validate import check_bool
from gradkit.hyper._problem import check_last
from gradkit.hyper._projections import projection
from gradkit.hyper._reverse import checkpoint_stride

__all__ = ["check_projections", "check_state_dict", "only_for", "outer_optimizer"]

_CALL = "HyperOptimizer"


def check_projections(
    projections: Any, names: Sequence[str]
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    if projections is None:
        return {}
    if not isinstance(projections, Mapping):
        raise TypeError(
            message(
                _CALL,
                "projections",
                "None or a dict hyperparameter name -> projection (a name or a function)",
                describe(projections),
                "pass e.g. projections={'w': projection('capped_simplex', radius=500)}",
            )
        )
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name, proj in projections.items():
        if name not in names:
            raise ValueError(
                message(
                    _CALL,
                    f"projections[{name!r}]",
                    f"a projection for one of the hyperparameters {list(names)}",
                    repr(name),
                    "name a hyperparameter listed in hyper",
                )
            )
        if proj is None:
            continue
        if isinstance(proj, str):
            out[name] = projection(proj)
        elif callable(proj):
            out[name] = proj
        else:
            raise TypeError(
                message(
                    _CALL,
                    f"projections[{name!r}]",
                    "a projection name ('box', 'nonnegative', 'simplex', 'l1_ball') or a "
                    "function tensor -> tensor",
                    describe(proj),
                    "use gradkit.hyper.projection(name, **options) for options",
                )
            )
    return out


def outer_optimizer(outer_opt: Any, hypers: list[torch.Tensor]) -> torch.optim.Optimizer:
    for h in hypers:
        if not h.is_leaf:
            raise ValueError(
                message(
                    _CALL,
                    "hyper",
                    "leaf tensors (the outer optimizer updates them in place)",
                    "a tensor computed from others (it has a grad_fn)",
                    "make the hyperparameter a leaf: h = h.detach().clone()",
                )
            )
    if outer_opt is None:
        return torch.optim.Adam(hypers, lr=1e-3)
    if isinstance(outer_opt, torch.optim.Optimizer):
        held = {id(p) for g in outer_opt.param_groups for p in g["params"]}
        if held != {id(h) for h in hypers}:
            raise ValueError(
                message(
                    _CALL,
                    "outer_opt",
                    "a torch.optim optimizer over exactly the hyperparameter tensors",
                    f"one over {len(held)} other or different tensors",
                    "build it as torch.optim.Adam(list(hyper.values()), lr=...) or pass a "
                    "factory: functools.partial(torch.optim.Adam, lr=...)",
                )
            )
        return outer_opt
    if callable(outer_opt):
        built = outer_opt(list(hypers))
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                message(
                    _CALL,
                    "outer_opt",
                    "a factory returning a torch.optim.Optimizer",
                    describe(built),
                    "pass e.g. functools.partial(torch.optim.Adam, lr=0.01)",
                )
            )
        return outer_optimizer(built, hypers)
    raise TypeError(
        message(
            _CALL,
            "outer_opt",
            "None (Adam, lr 1e-3), a torch.optim.Optimizer over the hyperparameters, or a "
            "factory params -> optimizer",
            describe(outer_opt),
            "pass e.g. functools.partial(torch.optim.Adam, lr=0.01)",
        )
    )


_IMPLICIT_OPTIONS = ("method", "tol", "maxiter", "alpha", "damping", "stationary_tol", "batch")


def check_method_options(
    method: str,
    steps: int,
    checkpoint_every: Any,
    last: Any,
    implicit_options: Any,
    warm_start: Any,
) -> int | None:
    """Check the options of :class:`HyperOptimizer` that belong to one method each; returns
    ``last`` as an int (``"truncated"``) or ``None``."""
    only_for(checkpoint_every, "checkpoint_every", method, ("reverse", "truncated"))
    checkpoint_stride(checkpoint_every, steps, _CALL)
    only_for(last, "last", method, ("truncated",))
    only_for(implicit_options, "implicit_options", method, ("implicit",))
    if method == "truncated":
        if last is None:
            raise ValueError(
                message(
                    _CALL,
                    "last",
                    "the number of steps to back-propagate through (method='truncated')",
                    "None",
                    "pass e.g. last=10",
                )
            )
        last = check_last(last, steps, _CALL)
    check_bool(warm_start, _CALL, "warm_start")
    if warm_start and method == "rtho":
        raise ValueError(
            message(
                _CALL,
                "warm_start",
                "False for method='rtho' (its training never restarts)",
                "True",
                "drop warm_start",
            )
        )
    if implicit_options is not None and not isinstance(implicit_options, Mapping):
        raise TypeError(
            message(
                _CALL,
                "implicit_options",
                "None or a dict of keyword arguments of implicit",
                describe(implicit_options),
                "pass e.g. implicit_options={'method': 'cg', 'damping': 1e-6}",
            )
        )
    unknown = sorted(set(implicit_options or {}) - set(_IMPLICIT_OPTIONS))
    if unknown:
        raise TypeError(
            message(
                _CALL,
                "implicit_options",
                f"keyword arguments of implicit ({', '.join(_IMPLICIT_OPTIONS)})",
                f"unknown {', '.join(map(repr, unknown))}",
                "check the option names",
            )
        )
    return last


def only_for(value: Any, argument: str, method: str, allowed: tuple[str, ...]) -> None:
    if value is not None and method not in allowed:
        raise ValueError(
            message(
                _CALL,
                argument,
                f"None for method={method!r} ({argument} applies to "
                f"{' / '.join(repr(a) for a in allowed)})",
                repr(value),
                f"drop {argument} or choose a method it applies to",
            )
        )


def check_state_dict(
    state_dict: Any,
    format: str,
    method: str,
    names: Sequence[str],
    hyper: Mapping[str, torch.Tensor],
    call: str,
    fix: str,
) -> None:
    """Raise unless ``state_dict`` is a saved run of this format, method and hyperparameters
    (names and shapes), with every entry ``state_dict()`` writes."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != format:
        raise ValueError(
            message(call, "state_dict", f"a state of format {format!r}", describe(state_dict), fix)
        )
    missing = [
        k for k in ("method", "names", "hyper", "outer_opt", "history") if k not in state_dict
    ]
    if missing:
        raise ValueError(
            message(call, "state_dict", "the entries state_dict() writes", f"no {missing}", fix)
        )
    if state_dict["method"] != method or list(state_dict["names"]) != list(names):
        raise ValueError(
            message(
                call,
                "state_dict",
                f"method {method!r} with hyperparameters {list(names)}",
                f"method {state_dict['method']!r} with {list(state_dict['names'])}",
                fix,
            )
        )
    saved = state_dict["hyper"]
    for name, h in hyper.items():
        value = saved.get(name) if isinstance(saved, Mapping) else None
        if not isinstance(value, torch.Tensor) or value.shape != h.shape:
            raise ValueError(
                message(
                    call,
                    f"state_dict['hyper'][{name!r}]",
                    f"a tensor of shape {tuple(h.shape)}",
                    describe(value),
                    fix,
                )
            )

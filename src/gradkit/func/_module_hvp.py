"""Hessian-vector products on ``(model, loss_fn, batch)``, keyed like
``model.named_parameters()`` (the conventions of :mod:`._module`).

They run autograd on the model as it is: double backward is the fastest HVP in eager mode,
and for layers linear in their weights (Linear, Conv) the first backward stops at the layer
outputs (:func:`_layer_output_hvp`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from gradkit._autograd import edges_into, first_grads
from gradkit._autograd import second_grads as _second_grads
from gradkit._errors import describe, message
from gradkit._params import LossFn, select_params
from gradkit._state import named_state
from gradkit.func._common import computes_as
from gradkit.func._hvp import HVPOperator
from gradkit.func._module import _loss

__all__ = ["module_hvp", "module_hvp_operator"]

_T = TypeVar("_T")


def module_hvp_operator(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    params: Iterable[str] | None = None,
    chunk_size: int | None = None,
) -> HVPOperator:
    """The Hessian of the loss w.r.t. the parameters as an operator on flat vectors.

    The flat order is that of ``model.named_parameters()`` (``op.names``); ``op.as_dict(v)``
    splits a vector by name, ready for :func:`module_hvp`.
    Parameters the loss does not use have zero rows and columns (never a silently zero
    Hessian of the wrong function).

    The operator is the Hessian at the parameters as they are now: after an optimizer step, an
    edit of ``p.data``, a change of a buffer or of ``train()``/``eval()``, its products raise a
    :class:`~gradkit.GradkitError` (build a new operator, or use
    :class:`gradkit.curvature.Hessian`, which follows the model).
    """
    call = f"module_hvp_operator({type(model).__name__})"
    chosen = select_params(model, params, call, given_order=True)
    with torch.enable_grad():
        loss = _loss(model, loss_fn, batch, call)
        inputs = batch[0] if isinstance(batch[0], tuple) else (batch[0],)
        data = [
            (f"batch input {i}", t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)
        ]
        if isinstance(batch[1], torch.Tensor):
            data.append(("batch targets", batch[1]))
        return HVPOperator(
            loss,
            list(chosen.values()),
            chunk_size=chunk_size,
            call=call,
            names=list(chosen),
            track=named_state(model, data),
            modules=model,
            rebuild="module_hvp_operator(model, loss_fn, batch)",
        )


def module_hvp(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    v: Mapping[str, torch.Tensor],
    *,
    params: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """``H v`` for ``v`` keyed by parameter name (the keys of ``v`` pick the parameters).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.func import module_hvp
        >>> model = nn.Linear(2, 1, bias=False)
        >>> x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0]])
        >>> module_hvp(model, nn.functional.mse_loss, (x, y), {"weight": torch.ones(1, 2)})
        {'weight': tensor([[ 6., 12.]])}
    """
    call = f"module_hvp({type(model).__name__})"
    chosen, vs = _chosen_vectors(model, v, params, call)
    with torch.enable_grad():
        res = _layer_output_hvp(model, loss_fn, batch, chosen, vs, call)
        if res is None:
            loss = _loss(model, loss_fn, batch, call)
            xs = list(chosen.values())
            gs = first_grads(loss, xs, call=call)
            res = _second_grads(gs, xs, list(vs.values()), retain_graph=False)
    return {n: r.detach() for n, r in zip(chosen, res, strict=True)}


_LINEAR_IN_WEIGHTS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _chosen_vectors(
    model: nn.Module, v: Any, params: Iterable[str] | None, call: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters ``v`` (or ``params``) picks and ``v``'s vectors for them, checked and
    cast to each parameter's dtype."""
    if not isinstance(v, Mapping):
        raise TypeError(
            message(
                call,
                "v",
                "a dict of tensors keyed by parameter name",
                describe(v),
                "pass e.g. {name: torch.randn_like(p)}",
            )
        )
    chosen = select_params(model, list(v) if params is None else params, call, given_order=True)
    for n, p in chosen.items():
        if n not in v or v[n].shape != p.shape:
            raise ValueError(
                message(
                    call,
                    f"v[{n!r}]",
                    f"shape {tuple(p.shape)}",
                    describe(v.get(n)),
                    "shape each vector like its parameter",
                )
            )
        if v[n].dtype != p.dtype:  # a silent cast would round (float64) or truncate (integers)
            raise TypeError(
                message(
                    call,
                    f"v[{n!r}]",
                    f"dtype {p.dtype} (that of the parameter)",
                    describe(v[n]),
                    f"convert it with v[{n!r}].to({p.dtype})",
                )
            )
    return chosen, {n: v[n] for n in chosen}


def _layer_owners(
    model: nn.Module, chosen: Mapping[str, torch.Tensor]
) -> dict[nn.Module, dict[str, str]] | None:
    """``module -> {"weight"/"bias": name}`` when every chosen parameter is the weight or bias
    of a layer whose output is linear in it (Linear, Conv), else None. The layer must compute
    exactly what its torch class computes (:func:`computes_as`: not a subclass overriding
    ``forward``, no forward hooks, no parametrization), as :func:`_layer_directional`
    recomputes its output with torch's own function."""
    owners: dict[nn.Module, dict[str, str]] = {}
    for name in chosen:
        prefix, _, local = name.rpartition(".")
        module = model.get_submodule(prefix) if prefix else model
        plain = any(computes_as(module, base) for base in _LINEAR_IN_WEIGHTS)
        if not plain or local not in ("weight", "bias"):
            return None
        owners.setdefault(module, {})[local] = name
    return owners


LayerCall = tuple[nn.Module, torch.Tensor, torch.Tensor]
"""One call of an owning layer: the layer, its input ``x`` and its output ``z``."""


def _recorded(
    owners: Mapping[nn.Module, Any], run: Callable[[], _T]
) -> tuple[_T, list[LayerCall] | None]:
    """``run()`` with the calls of the ``owners`` layers recorded; None instead of the calls
    where they cannot be used (an input passed by keyword, an output modified in place after
    the layer)."""
    seen: list[tuple[nn.Module, torch.Tensor | None, torch.Tensor, int]] = []

    def keep(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            seen.append((module, x, out, out._version))

    handles = [m.register_forward_hook(keep) for m in owners]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    calls: list[LayerCall] = []
    for module, x, out, version in seen:
        if x is None or out._version != version:
            return result, None
        calls.append((module, x, out))
    return result, calls


def _only_recorded_uses(
    root: torch.Tensor,
    calls: Sequence[LayerCall],
    owners: Mapping[nn.Module, Mapping[str, str]],
    chosen: Mapping[str, torch.Tensor],
) -> bool:
    """Whether the recorded layer calls are the only uses of the chosen parameters in the graph
    of ``root``: each call takes its weight and bias once (an edge into their accumulators),
    so any other use (a weight tied to another module, or read directly: ``F.linear(h,
    self.fc.weight)``) shows as an extra edge, and a call whose output does not reach ``root``
    as a missing one. One walk of the graph."""
    expected = {id(p): 0 for p in chosen.values()}
    for module, _, _ in calls:
        for local in owners[module]:
            expected[id(getattr(module, local))] += 1
    found = edges_into([root.grad_fn], expected)
    return all(len(found.get(pid, ())) == k for pid, k in expected.items())


def _layer_directional(
    calls: Sequence[LayerCall],
    grads_z: Sequence[torch.Tensor | None],
    owners: Mapping[nn.Module, Mapping[str, str]],
    vs: Mapping[str, torch.Tensor],
) -> torch.Tensor | None:
    r""":math:`\sum_l \langle g_l, \mathrm{layer}_l(x_l; v_l) \rangle`: the derivative
    along ``v`` of ``<g, z>`` over the recorded calls (``g_l``: a gradient w.r.t. the output
    ``z_l``, None where it does not reach it); None if no call has one."""
    total: torch.Tensor | None = None
    for (module, x, _), gz in zip(calls, grads_z, strict=True):
        if gz is None:
            continue
        names = owners[module]
        own_weight: torch.Tensor = module.weight  # type: ignore[assignment]
        weight = vs[names["weight"]] if "weight" in names else torch.zeros_like(own_weight)
        bias = vs.get(names.get("bias", ""))
        if isinstance(module, nn.Linear):
            z_v = nn.functional.linear(x, weight, bias)
        else:
            z_v = module._conv_forward(x, weight, bias)  # type: ignore[operator]
        term = (gz * z_v).sum()
        total = term if total is None else total + term
    return total


def _layer_output_hvp(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    chosen: dict[str, torch.Tensor],
    vs: dict[str, torch.Tensor],
    call: str,
) -> list[torch.Tensor] | None:
    r"""``H v`` without forming the first gradient's weight products, when every chosen
    parameter belongs to a layer whose output is linear in it (Linear, Conv):

    .. math:: \langle \nabla_\theta L, v \rangle = \sum_l \langle \partial L/\partial z_l,
              \, \mathrm{layer}_l(x_l; v_l) \rangle, \qquad H v = \nabla_\theta \text{ of it}

    The first backward stops at the layer outputs ``z_l``. Returns None (use the plain double
    backward) for any other model, when an output was modified in place after the layer, or
    when a chosen parameter is also used outside its layer's calls.
    """
    owners = _layer_owners(model, chosen)
    if owners is None:
        return None
    loss, calls = _recorded(owners, lambda: _loss(model, loss_fn, batch, call))
    if not calls or not _only_recorded_uses(loss, calls, owners, chosen):
        return None
    zs = [z for _, _, z in calls]
    grads_z = first_grads(loss, zs, call=call)
    total = _layer_directional(calls, grads_z, owners, vs)
    xs = list(chosen.values())
    if total is None or not total.requires_grad:  # second derivative identically zero
        return [torch.zeros_like(p) for p in xs]
    res = torch.autograd.grad(total, xs, allow_unused=True)
    return [torch.zeros_like(p) if r is None else r for r, p in zip(res, xs, strict=True)]

"""The transforms on ``(model, loss_fn, batch)``, with results keyed like
``model.named_parameters()``.

Conventions shared by every helper:

* ``batch = (inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``, with
  ``model(*inputs)`` when ``inputs`` is a tuple;
* the differentiated parameters are those with ``requires_grad=True`` (frozen ones are skipped),
  or the names given in ``params``; buffers (BatchNorm statistics) are used, never changed by
  the helpers themselves: modules in training mode that own buffers run on copies of them
  (:func:`_forward`), as in :mod:`gradkit.curvature`;
* nothing is written to ``.grad`` or to the model;
* a loss of one element (shape ``[1]``) is the scalar it holds.

Gradients run autograd on the model as it is; Hessians and Jacobians go through
``torch.func.functional_call`` on a flat parameter vector, or by autograd on the model itself
where ``torch.func`` cannot reproduce it (a module reused under several names, a module in
training mode that updates its buffers). Hessian-vector products are in
:mod:`._module_hvp`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, overload

import torch
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit._params import LossFn, select_params
from gradkit._validate import check_bool, check_callable, check_choice
from gradkit.func._common import _check_scalar
from gradkit.func._hvp import HVPOperator
from gradkit.func._jacobian import jacobian
from gradkit.func._transforms import hessian

__all__ = [
    "LossFn",
    "_loss",
    "module_grad",
    "module_hessian",
    "module_jacobian",
    "module_value_and_grad",
]


def _updates_buffers(model: nn.Module) -> bool:
    """Whether a module in training mode owns buffers (BatchNorm updating its running
    statistics): its forward writes to them."""
    return any(m.training and next(m.buffers(False), None) is not None for m in model.modules())


def _forward(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``; where a module in training mode owns buffers, on copies of the
    model's buffers, so that nothing is written to the model (the output is the same: a module
    in training mode does not read the statistics it updates)."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    if not _updates_buffers(model):
        return model(*args)
    copies = {n: b.clone() for n, b in model.named_buffers()}
    return torch.func.functional_call(model, copies, args, strict=False)


def _scalar(loss: Any, call: str) -> torch.Tensor:
    """``loss`` checked to be a scalar, a one-element tensor reshaped to ``()``."""
    _check_scalar(loss, call)
    return loss if loss.dim() == 0 else loss.reshape(())


def _loss(model: nn.Module, loss_fn: LossFn, batch: Any, call: str) -> torch.Tensor:
    _check_batch(loss_fn, batch, call)
    return _scalar(loss_fn(_forward(model, batch[0]), batch[1]), call)


def _check_batch(loss_fn: LossFn, batch: Any, call: str) -> None:
    """Refuse a ``batch`` that is not a non-empty pair ``(inputs, targets)`` and a ``loss_fn``
    that cannot be called."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            message(
                call,
                "batch",
                "a pair (inputs, targets)",
                describe(batch),
                "pass batch=(x, y); loss_fn(model(x), y) is differentiated",
            )
        )
    check_callable(loss_fn, call, "loss_fn", "a loss_fn(output, targets) returning a scalar")
    _check_examples(batch[0], call)


def _check_examples(inputs: Any, call: str) -> None:
    """Refuse a batch of zero examples (its gradient would be 0, or nan for a mean loss)."""
    first = inputs
    if isinstance(inputs, tuple):
        first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == 0:
        raise ValueError(
            message(
                call,
                "batch",
                "inputs with at least one example along dimension 0",
                describe(first),
                "pass a non-empty batch",
            )
        )


def module_value_and_grad(
    model: nn.Module, loss_fn: LossFn, batch: Any, *, params: Iterable[str] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its gradient by parameter name, without touching ``.grad``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.func import module_value_and_grad
        >>> model = nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0)
        >>> x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0]])
        >>> loss, g = module_value_and_grad(model, nn.functional.mse_loss, (x, y))
        >>> loss, g["weight"], model.weight.grad
        (tensor(9.), tensor([[ 6., 12.]]), None)
    """
    call = f"module_value_and_grad({type(model).__name__})"
    chosen = select_params(model, params, call, given_order=True)
    with torch.enable_grad():
        loss = _loss(model, loss_fn, batch, call)
        grads = torch.autograd.grad(loss, list(chosen.values()), allow_unused=True)
    return loss.detach(), {
        n: torch.zeros_like(p) if g is None else g
        for (n, p), g in zip(chosen.items(), grads, strict=True)
    }


def module_grad(
    model: nn.Module, loss_fn: LossFn, batch: Any, *, params: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """The gradient of the loss by parameter name (see :func:`module_value_and_grad`)."""
    return module_value_and_grad(model, loss_fn, batch, params=params)[1]


def _flat_call(
    model: nn.Module, chosen: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """The chosen parameters as one flat vector, and ``model`` as a function of it."""
    names = list(chosen)
    shapes = [p.shape for p in chosen.values()]
    sizes = [p.numel() for p in chosen.values()]

    def call_with(flat: torch.Tensor, inputs: Any) -> Any:
        pieces = {n: t.view(s) for n, t, s in zip(names, flat.split(sizes), shapes, strict=True)}
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return torch.func.functional_call(model, pieces, args)

    flat0 = torch.cat([p.detach().reshape(-1) for p in chosen.values()])
    return flat0, call_with


def _split_last(
    t: torch.Tensor, chosen: dict[str, torch.Tensor], dim: int
) -> dict[str, torch.Tensor]:
    sizes = [p.numel() for p in chosen.values()]
    return {n: part for n, part in zip(chosen, t.split(sizes, dim=dim), strict=True)}


@overload
def module_hessian(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    params: Iterable[str] | None = None,
    flat: Literal[False] = False,
    chunk_size: int | None = None,
) -> dict[str, dict[str, torch.Tensor]]: ...


@overload
def module_hessian(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    params: Iterable[str] | None = None,
    flat: Literal[True],
    chunk_size: int | None = None,
) -> torch.Tensor: ...


@overload
def module_hessian(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    params: Iterable[str] | None = None,
    flat: bool,
    chunk_size: int | None = None,
) -> torch.Tensor | dict[str, dict[str, torch.Tensor]]: ...


def module_hessian(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    params: Iterable[str] | None = None,
    flat: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor | dict[str, dict[str, torch.Tensor]]:
    """The full Hessian of the loss w.r.t. the parameters.

    Returns:
        With ``flat=True`` a ``[P, P]`` tensor in ``named_parameters()`` order; otherwise nested
        dicts ``H[name_i][name_j]`` of shape ``param_i.shape + param_j.shape`` (cross terms
        included).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.func import module_hessian
        >>> model = nn.Linear(2, 1, bias=False)
        >>> x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0]])
        >>> module_hessian(model, nn.functional.mse_loss, (x, y), flat=True)
        tensor([[2., 4.],
                [4., 8.]])
    """
    call = f"module_hessian({type(model).__name__})"
    check_bool(flat, call, "flat")
    check_callable(loss_fn, call, "loss_fn", "a loss_fn(output, targets) returning a scalar")
    chosen = select_params(model, params, call, given_order=True)
    flat0, call_with = _flat_call(model, chosen)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        _loss(model, loss_fn, batch, call)  # raises the batch error
    _check_examples(batch[0], call)

    def loss_of(v: torch.Tensor) -> torch.Tensor:
        return _scalar(loss_fn(call_with(v, batch[0]), batch[1]), call)

    if _reuses_modules(model) or _updates_buffers(model):
        # a module object reached under several names: torch.func.functional_call does not
        # reproduce its reuse faithfully; a module in training mode that updates its buffers
        # (BatchNorm) writes to tensors torch.func transforms cannot let it change. Differentiate
        # the model itself (double backward, on copies of the buffers)
        with torch.enable_grad():
            op = HVPOperator(
                _loss(model, loss_fn, batch, call),
                list(chosen.values()),
                chunk_size=chunk_size,
                call=call,
            )
            h = op.to_dense()
    else:
        with _named_as("hessian(loss_of)", call, "loss_fn(model(inputs), targets)"):
            h = hessian(loss_of, flat0, chunk_size=chunk_size)
    # detached: with params= a subset, the other parameters' graph would be attached to it
    h = h.detach()
    if flat:
        return h
    return {
        ni: {
            nj: blk.reshape((*chosen[ni].shape, *chosen[nj].shape))
            for nj, blk in _split_last(row, chosen, 1).items()
        }
        for ni, row in _split_last(h, chosen, 0).items()
    }


@contextlib.contextmanager
def _named_as(inner: str, call: str, argument: str) -> Iterator[None]:
    """Word the errors of a transform run on an internal function (``inner``, e.g.
    ``"hessian(loss_of)"``) as errors of the module helper ``call``, naming ``argument``
    instead of the internal function's ``f``."""
    try:
        yield
    except (GradkitError, TypeError, ValueError) as err:
        text = str(err)
        if type(err) not in (GradkitError, TypeError, ValueError) or not text.startswith(inner):
            raise
        rest = text[len(inner) :]
        rest = f": {argument}:" + rest[len(": f:") :] if rest.startswith(": f:") else rest
        raise type(err)(call + rest) from err


def _reuses_modules(model: nn.Module) -> bool:
    """Whether a module object or a parameter appears under several names (weight tying,
    a layer used twice in a Sequential)."""
    return len(list(model.named_modules(remove_duplicate=False))) != len(
        list(model.named_modules())
    ) or len(list(model.named_parameters(remove_duplicate=False))) != len(
        list(model.named_parameters())
    )


def module_jacobian(
    model: nn.Module,
    inputs: Any,
    *,
    params: Iterable[str] | None = None,
    mode: str = "auto",
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """The Jacobian of the model's output w.r.t. its parameters, keyed by parameter name.

    Returns:
        ``{name: J}`` with ``J`` of shape ``output.shape + param.shape``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.func import module_jacobian
        >>> model = nn.Linear(2, 1)
        >>> J = module_jacobian(model, torch.tensor([[1.0, 2.0]]))
        >>> J["weight"].shape, J["bias"]
        (torch.Size([1, 1, 1, 2]), tensor([[[1.]]]))
    """
    call = f"module_jacobian({type(model).__name__})"
    check_choice(mode, ("auto", "forward", "reverse"), call, "mode")
    chosen = select_params(model, params, call, given_order=True)
    flat0, call_with = _flat_call(model, chosen)

    def model_output(v: torch.Tensor) -> torch.Tensor:
        return _check_output(call_with(v, inputs), call)

    if _reuses_modules(model) or _updates_buffers(model):
        # see module_hessian: reverse mode on the model itself (on copies of its buffers)
        with torch.enable_grad():
            out = _check_output(_forward(model, inputs), call)
            m = out.numel()
            eye = torch.eye(m, dtype=out.dtype, device=out.device).view(m, *out.shape)
            xs = list(chosen.values())
            rows = torch.autograd.grad(out, xs, eye, is_grads_batched=True, allow_unused=True)
        j = (
            torch.cat(
                [
                    (
                        torch.zeros(m, p.numel(), dtype=p.dtype, device=p.device)
                        if r is None
                        else r.reshape(m, -1)
                    )
                    for r, p in zip(rows, xs, strict=True)
                ],
                dim=1,
            )
            .reshape((*out.shape, -1))
            .detach()
        )
    else:
        with _named_as("jacobian(model_output)", call, "model"):
            j = jacobian(model_output, flat0, mode=mode, chunk_size=chunk_size)
        # detached: with params= a subset, the other parameters' graph would be attached to it
        j = j.detach()
    o_shape = j.shape[:-1]
    return {
        n: blk.reshape((*o_shape, *chosen[n].shape))
        for n, blk in _split_last(j, chosen, -1).items()
    }


def _check_output(out: Any, call: str) -> torch.Tensor:
    """The model's output, refused unless it is one tensor."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            message(
                call,
                "model",
                "a model returning one tensor",
                describe(out),
                "wrap the model so that it returns one tensor (stack or concatenate several)",
            )
        )
    return out

"""``custom_gradient``: TensorFlow's decorator on ``torch.autograd.Function``.

The decorated function returns ``(y, grad_fn)``; ``grad_fn(*dys)`` returns the gradient with
respect to each tensor argument. It works in eager autograd and under ``torch.func`` transforms
(``grad``, ``vmap``, ``jacrev``, ...).

How ``grad_fn`` reaches the backward: ``torch.func`` calls ``forward`` once, at the innermost
level, and ``setup_context`` once per transform level, so the closure is handed over through a
per-call slot (a thread-local stack, one entry per call in flight) rather than a queue.

Captured tensors (TensorFlow's ``variables``): a function may use tensors that require grad
without taking them as arguments (a module's weight). Their gradient can only reach them if they
are inputs of the ``autograd.Function``, so they are found before the call
(:mod:`gradkit.func._captures`) and passed as extra inputs; the forward runs under a
``TorchFunctionMode`` that records which tensors requiring grad it actually touches.
``grad_fn(*dys, variables=[...])`` then returns ``(input_grads, variable_grads)``; a
``grad_fn`` without that keyword is a ``TypeError`` naming the tensors, as in TensorFlow.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, cast

import torch

from gradkit._errors import describe, message
from gradkit._validate import check_callable
from gradkit.func._captures import CaptureCache, Recorder, label

__all__ = ["custom_gradient"]

P = ParamSpec("P")
T = TypeVar("T")

_local = threading.local()


@dataclass
class _Call:
    """One call in flight: what the wrapper passes to the forward and back."""

    nargs: int
    candidates: list[torch.Tensor]
    names: dict[int, str]
    needs_grad: bool
    kwargs: dict[str, Any] = field(default_factory=dict)
    final: bool = False
    grad_fn: Callable[..., Any] | None = None
    used: list[int] = field(default_factory=list)
    missing: list[torch.Tensor] = field(default_factory=list)


class _Retry(Exception):
    """The forward touched captured tensors the wrapper had not passed as inputs."""


def _slots() -> list[_Call]:
    slots: list[_Call] | None = getattr(_local, "slots", None)
    if slots is None:
        slots = _local.slots = []
    return slots


def _takes_variables(grad_fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(grad_fn).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): assume it does not
        return False
    return any(p.name == "variables" or p.kind is p.VAR_KEYWORD for p in params)


def custom_gradient(f: Callable[P, tuple[T, Callable[..., Any]]]) -> Callable[P, T]:
    r"""Give a function its own gradient (``tf.custom_gradient``).

    Args:
        f: a function of tensors (and other values) returning ``(y, grad_fn)``: ``y`` a tensor
            or a tuple of tensors, ``grad_fn(*dys)`` (one ``dy`` per output) returning one
            gradient per tensor argument (a tensor, or a tuple of them; ``None`` for none).
            If ``f`` uses tensors that require grad without taking them as arguments (a
            module's weight), ``grad_fn`` must accept the keyword ``variables``: it is called
            as ``grad_fn(*dys, variables=vs)`` with those tensors, in order of first use, and
            returns ``(input_grads, variable_grads)``, one gradient per tensor of ``vs``.
            Keyword arguments are passed to ``f`` as they are and not differentiated:
            ``grad_fn`` returns gradients for the positional tensor arguments only, and a
            keyword tensor that requires grad is refused (pass it by position to
            differentiate it).

    Returns:
        A function with ``f``'s signature returning ``y``, whose backward calls ``grad_fn``.

    Raises:
        TypeError: ``f`` uses captured tensors that require grad and ``grad_fn`` has no
            ``variables`` keyword (their gradient would be lost); the message names them.
        ValueError: ``grad_fn`` returns the wrong number of gradients, or one shaped unlike
            its argument (torch would sum a larger one down to the argument's shape).

    Examples:
        TensorFlow's numerically stable ``log(1 + exp(x))``: plain autograd gives ``nan`` at
        x = 100 (``exp(100)`` overflows float32), the custom gradient gives 1.

        >>> import torch
        >>> from gradkit.func import custom_gradient, grad
        >>> @custom_gradient
        ... def log1pexp(x):
        ...     e = torch.exp(x)
        ...     return torch.log(1 + e), lambda dy: dy * (1 - 1 / (1 + e))
        >>> grad(log1pexp)(torch.tensor(100.0))
        tensor(1.)

        A straight-through estimator: ``sign`` forward, identity backward.

        >>> @custom_gradient
        ... def ste_sign(x):
        ...     return torch.sign(x), lambda dy: dy
        >>> x = torch.tensor([-0.5, 2.0], requires_grad=True)
        >>> ste_sign(x).sum().backward()
        >>> x.grad
        tensor([1., 1.])

        A captured weight gets its gradient through ``variables``:

        >>> w = torch.tensor([2.0, 3.0], requires_grad=True)
        >>> @custom_gradient
        ... def scale(x):
        ...     def grad_fn(dy, variables):
        ...         return dy * w, [dy * x]
        ...     return x * w, grad_fn
        >>> scale(torch.tensor([1.0, 1.0])).sum().backward()
        >>> w.grad
        tensor([1., 1.])

    Note:
        For second derivatives through ``torch.autograd`` (``create_graph=True``), compute
        ``grad_fn`` from the arguments (``dy * torch.sigmoid(x)``) rather than from values
        computed in the forward: those are constants, as TensorFlow documents. Under nested
        ``torch.func`` transforms (``grad(grad(f))``), the custom gradient is always such a
        constant of the outer level.

    Warning:
        Captured tensors are looked up in ``f``'s closure, the globals it names and the
        modules among them, and remembered once seen; a tensor reached another way (through
        an object's attribute) is found by the forward itself, which then runs a second time
        on the first call that uses it. While grad is enabled the forward runs under a
        ``TorchFunctionMode`` that records the tensors it touches (a few microseconds per
        torch call).
    """
    check_callable(f, "custom_gradient(f)", "f", "a function returning (y, grad_fn)")
    name = getattr(f, "__name__", "f")
    call_name = f"custom_gradient({name})"
    cache = CaptureCache(f)

    class _CustomGradient(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*inputs: Any) -> Any:
            call = _slots()[-1]
            args = inputs[: call.nargs]
            given = [*args, *call.kwargs.values()]
            exclude = {id(a) for a in given if isinstance(a, torch.Tensor)}
            recorder = Recorder(exclude)
            with recorder if call.needs_grad else contextlib.nullcontext():
                out = f(*args, **call.kwargs)
            if not isinstance(out, tuple) or len(out) != 2 or not callable(out[1]):
                raise TypeError(
                    message(
                        call_name,
                        "return value",
                        "(y, grad_fn)",
                        describe(out),
                        "return the output and a function of the output gradients",
                    )
                )
            _bind(call, recorder.used, out[1])
            return out[0]

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            call = _slots()[-1]
            ctx.grad_fn = call.grad_fn
            ctx.tensor_mask = [isinstance(a, torch.Tensor) for a in inputs[: call.nargs]]
            ctx.shapes = [a.shape for a in inputs[: call.nargs] if isinstance(a, torch.Tensor)]
            ctx.n_candidates = len(call.candidates)
            ctx.used = list(call.used)
            ctx.variables = [call.candidates[k] for k in call.used]

        @staticmethod
        def backward(ctx: Any, *dys: Any) -> Any:
            return _backward(ctx, dys, call_name)

    def _bind(call: _Call, used: list[torch.Tensor], grad_fn: Callable[..., Any]) -> None:
        """Match the captured tensors the forward touched with the extra inputs."""
        index = {id(c): k for k, c in enumerate(call.candidates)}
        call.used = [index[id(t)] for t in used if id(t) in index]
        call.missing = [t for t in used if id(t) not in index]
        call.grad_fn = grad_fn
        if not call.needs_grad:
            return
        if call.missing and not call.final:
            raise _Retry
        # a tensor still unknown on the second run is new at every call: not captured from
        # outside, no gradient to deliver
        call.missing = []
        if call.used and not _takes_variables(grad_fn):
            tensors = [call.candidates[k] for k in call.used]
            names = ", ".join(call.names.get(id(t), label(t)) for t in tensors)
            raise TypeError(
                message(
                    call_name,
                    "grad_fn",
                    "a grad_fn(*dys, variables=None) returning (input_grads, variable_grads), "
                    "since the function uses tensors that require grad without taking them as "
                    "arguments",
                    f"a grad_fn without a 'variables' keyword, while the function uses {names}",
                    "add the keyword and return their gradients too, or pass the tensors as "
                    "arguments (their gradient would otherwise be lost)",
                )
            )

    _CustomGradient.__name__ = _CustomGradient.__qualname__ = f"CustomGradient_{name}"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        needs_grad = torch.is_grad_enabled()
        for key, value in kwargs.items():
            if needs_grad and isinstance(value, torch.Tensor) and value.requires_grad:
                raise TypeError(
                    message(
                        call_name,
                        f"keyword argument {key!r}",
                        "keyword arguments that need no gradient (they are not differentiated)",
                        "a tensor that requires grad, whose gradient would be lost",
                        f"pass it by position to differentiate it, or {key}=....detach()",
                    )
                )
        for attempt in range(2):
            candidates, names = cache.candidates(args) if needs_grad else ([], {})
            call = _Call(len(args), candidates, names, needs_grad, kwargs, final=attempt == 1)
            _slots().append(call)
            try:
                return _CustomGradient.apply(*args, *candidates)
            except _Retry:
                cache.remember(call.missing)
            finally:
                _slots().pop()
        raise AssertionError("unreachable: the last attempt never retries")

    return cast(Callable[P, T], functools.wraps(f)(wrapper))


def _backward(ctx: Any, dys: tuple[Any, ...], call_name: str) -> tuple[Any, ...]:
    variables: list[torch.Tensor] = ctx.variables
    n_tensors = sum(ctx.tensor_mask)
    if variables:
        res = ctx.grad_fn(*dys, variables=variables)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            raise ValueError(
                message(
                    call_name,
                    "grad_fn(*dys, variables=...)",
                    "a pair (input_grads, variable_grads)",
                    describe(res),
                    "return the gradients of the arguments and those of the variables",
                )
            )
        grads, var_grads = res
        var_grads = list(var_grads) if isinstance(var_grads, (tuple, list)) else [var_grads]
        if len(var_grads) != len(variables):
            raise ValueError(
                message(
                    call_name,
                    "grad_fn(*dys, variables=...)",
                    f"{len(variables)} variable gradient(s), one per tensor in variables",
                    f"{len(var_grads)}",
                    "return one gradient per variable, in the order of variables (None for none)",
                )
            )
        for i, (g, v) in enumerate(zip(var_grads, variables, strict=True)):
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != v.shape):
                raise ValueError(
                    message(
                        call_name,
                        f"variable gradient {i}",
                        f"a tensor of shape {tuple(v.shape)} (that of variables[{i}])",
                        describe(g),
                        "shape each gradient like its variable",
                    )
                )
    else:
        grads, var_grads = ctx.grad_fn(*dys), []
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    if len(grads) != n_tensors:
        raise ValueError(
            message(
                call_name,
                "grad_fn(*dys)",
                f"{n_tensors} gradient(s), one per positional tensor argument",
                f"{len(grads)}",
                "return one gradient per positional tensor argument (None for none; keyword "
                "arguments are not differentiated, pass a tensor by position to differentiate it)",
            )
        )
    for i, (g, shape) in enumerate(zip(grads, ctx.shapes, strict=True)):
        # autograd would sum a larger gradient down to the input's shape without a word
        if g is not None and (not isinstance(g, torch.Tensor) or g.shape != shape):
            raise ValueError(
                message(
                    call_name,
                    f"gradient {i} of grad_fn(*dys)",
                    f"a tensor of shape {tuple(shape)} (that of positional tensor argument {i})",
                    describe(g),
                    "shape each gradient like its argument (None for none)",
                )
            )
    it = iter(grads)
    extra: list[Any] = [None] * ctx.n_candidates
    for k, g in zip(ctx.used, var_grads, strict=True):
        extra[k] = g
    return (*(next(it) if is_t else None for is_t in ctx.tensor_mask), *extra)

"""``custom_gradient``: TensorFlow's decorator on ``torch.autograd.Function``.

The decorated function returns ``(y, grad_fn)``; ``grad_fn(*dys)`` returns the gradient with
respect to each tensor argument. It works in eager autograd and under ``torch.func`` transforms
(``grad``, ``vmap``, ``jacrev``, ...).

How ``grad_fn`` reaches the backward: ``torch.func`` calls ``forward`` once, at the innermost
level, and ``setup_context`` once per transform level, so the closure is handed over through a
per-call slot (a thread-local stack, one entry per call in flight) rather than a queue.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from gradkit._errors import describe, message

__all__ = ["custom_gradient"]

_local = threading.local()


def _slots() -> list[list[Callable[..., Any]]]:
    slots: list[list[Callable[..., Any]]] | None = getattr(_local, "slots", None)
    if slots is None:
        slots = _local.slots = []
    return slots


def custom_gradient(f: Callable[..., tuple[Any, Callable[..., Any]]]) -> Callable[..., Any]:
    r"""Give a function its own gradient (``tf.custom_gradient``).

    Args:
        f: a function of tensors (and other values) returning ``(y, grad_fn)``: ``y`` a tensor
            or a tuple of tensors, ``grad_fn(*dys)`` (one ``dy`` per output) returning one
            gradient per tensor argument (a tensor, or a tuple of them; ``None`` for none).

    Returns:
        A function with ``f``'s signature returning ``y``, whose backward calls ``grad_fn``.

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

    Note:
        For second derivatives through ``torch.autograd`` (``create_graph=True``), compute
        ``grad_fn`` from the arguments (``dy * torch.sigmoid(x)``) rather than from values
        computed in the forward: those are constants, as TensorFlow documents. Under nested
        ``torch.func`` transforms (``grad(grad(f))``), the custom gradient is always such a
        constant of the outer level.
    """
    name = getattr(f, "__name__", "f")

    class _CustomGradient(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*args: Any) -> Any:
            out = f(*args)
            if not isinstance(out, tuple) or len(out) != 2 or not callable(out[1]):
                raise TypeError(
                    message(
                        f"custom_gradient({name})",
                        "return value",
                        "(y, grad_fn)",
                        describe(out),
                        "return the output and a function of the output gradients",
                    )
                )
            _slots()[-1].append(out[1])
            return out[0]

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.grad_fn = _slots()[-1][-1]
            ctx.tensor_mask = [isinstance(a, torch.Tensor) for a in inputs]

        @staticmethod
        def backward(ctx: Any, *dys: Any) -> Any:
            grads = ctx.grad_fn(*dys)
            if not isinstance(grads, (tuple, list)):
                grads = (grads,)
            n_tensors = sum(ctx.tensor_mask)
            if len(grads) != n_tensors:
                raise ValueError(
                    message(
                        f"custom_gradient({name})",
                        "grad_fn(*dys)",
                        f"{n_tensors} gradient(s), one per tensor argument",
                        f"{len(grads)}",
                        "return one gradient per tensor argument (None for none)",
                    )
                )
            it = iter(grads)
            return tuple(next(it) if is_t else None for is_t in ctx.tensor_mask)

    _CustomGradient.__name__ = _CustomGradient.__qualname__ = f"CustomGradient_{name}"

    @functools.wraps(f)
    def wrapper(*args: Any) -> Any:
        _slots().append([])
        try:
            return _CustomGradient.apply(*args)
        finally:
            _slots().pop()

    return wrapper

"""Function transforms: grad, value_and_grad, jvp, vjp, hessian, stop_gradient (and the
Jacobians of :mod:`._jacobian`, re-exported here).

Index legend for shapes: ``O`` the output shape of ``f``, ``X`` the shape of a differentiated
argument.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch

from gradkit._autograd import first_grads
from gradkit._errors import GradkitError, describe, message
from gradkit._forward_ad import load_decompositions
from gradkit._validate import (
    check_bool,
    check_callable,
    check_optional_int,
    check_tensor,
    normalize_argnums,
)
from gradkit.func._common import (
    _as_tuple,
    _check_differentiable,
    _check_floating_output,
    _check_like,
    _check_scalar,
    _check_tensor_tree,
    _checked_outputs,
    _mutation_errors,
    _name,
    _substitute,
    _vjp,
    _without_overlap,
)
from gradkit.func._jacobian import batch_jacobian, jacobian

__all__ = [
    "batch_jacobian",
    "grad",
    "hessian",
    "jacobian",
    "jvp",
    "stop_gradient",
    "value_and_grad",
    "vjp",
]

logger = logging.getLogger(__name__)


def grad(
    f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False
) -> Callable[..., Any]:
    """The gradient of a scalar function, as a function (``torch.func.grad`` with checks).

    Args:
        f: function of tensors returning a scalar tensor (or ``(scalar, aux)`` with has_aux);
            a one-element tensor (``[1]``, ``[1, 1]``) is taken as the scalar it holds, as
            :func:`hvp` and :func:`hessian` do.
        argnums: which positional argument(s) to differentiate; a tuple gives a tuple.
        has_aux: ``f`` returns ``(value, aux)``; the transformed function returns
            ``(gradient, aux)``.

    Returns:
        A function with ``f``'s signature returning ``df/dx`` shaped like ``x``. Unused
        arguments get zeros (not ``None``), as in ``torch.func``.

    Examples:
        >>> import torch
        >>> from gradkit.func import grad
        >>> grad(lambda x: (x**2).sum())(torch.tensor([1.0, 2.0]))
        tensor([2., 4.])
    """
    return _grad_transform(f, argnums, has_aux, with_value=False)


def value_and_grad(
    f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False
) -> Callable[..., Any]:
    """Like :func:`grad` but returns ``(value, gradient)`` (``((value, aux), gradient)``
    with has_aux), computing both in one pass. The value is 0-d (a one-element output of
    ``f`` is taken as the scalar it holds).

    Examples:
        >>> import torch
        >>> from gradkit.func import value_and_grad
        >>> value_and_grad(lambda x, y: (x * y).sum(), argnums=(0, 1))(
        ...     torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
        (tensor(11.), (tensor([3., 4.]), tensor([1., 2.])))
    """
    return _grad_transform(f, argnums, has_aux, with_value=True)


def _grad_transform(
    f: Callable[..., Any], argnums: Any, has_aux: bool, with_value: bool
) -> Callable[..., Any]:
    kind = "value_and_grad" if with_value else "grad"
    if not callable(f):
        raise TypeError(
            message(
                f"{kind}(f)", "f", "a callable", describe(f), "pass the function to differentiate"
            )
        )
    check_bool(has_aux, f"{kind}({_name(f)})", "has_aux")

    @functools.wraps(f)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        call = f"{kind}({_name(f)})"
        nums = normalize_argnums(argnums, len(args), call)
        _check_differentiable(args, nums, call)

        def checked(*a: Any, **k: Any) -> Any:
            out = f(*a, **k)
            if has_aux:
                if not isinstance(out, tuple) or len(out) != 2:
                    raise TypeError(
                        message(
                            call,
                            "has_aux",
                            "f to return (value, aux)",
                            describe(out),
                            "return a pair, or drop has_aux",
                        )
                    )
                _check_scalar(out[0], call)
                _check_tensor_tree(out[1], call, "aux", "tensors (or lists, tuples, dicts of them)")
                return out[0].reshape(()), out[1]  # torch.func takes a 0-d value only
            _check_scalar(out, call)
            return out.reshape(())

        torch_argnums = nums[0] if isinstance(argnums, int) else nums
        gv = torch.func.grad_and_value(checked, argnums=torch_argnums, has_aux=has_aux)
        with _mutation_errors(call):
            g, value = gv(*args, **kwargs)
        if has_aux and not with_value:
            return g, value[1]
        return (value, g) if with_value else g

    return transformed


@overload
def jvp(f: Callable[..., torch.Tensor], args: Any, v: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def jvp(f: Callable[..., Any], args: Any, v: Any) -> tuple[Any, Any]: ...


def jvp(f: Callable[..., Any], args: Any, v: Any) -> tuple[Any, Any]:
    r"""Jacobian-vector product (forward mode): ``(f(*args), J v)``.

    .. math:: \text{out} = \sum_k \frac{\partial f}{\partial \text{args}_k} v_k

    Args:
        f: function of tensors.
        args: a tensor or a tuple of tensors (the point).
        v: tangents with the structure and shapes of ``args``.

    Returns:
        ``(value, jvp)``, the latter shaped like ``f``'s output.

    Examples:
        >>> import torch
        >>> from gradkit.func import jvp
        >>> jvp(torch.sin, torch.tensor([0.0]), torch.tensor([2.0]))
        (tensor([0.]), tensor([2.]))
    """
    call = f"jvp({_name(f)})"
    check_callable(f, call)
    primals, _ = _as_tuple(args, call, "args")
    _check_differentiable(primals, range(len(primals)), call, argnums=False)
    tangents, _ = _as_tuple(v, call, "v")
    _check_like(tangents, primals, call, "v", "argument")
    load_decompositions()
    dense = tuple(_without_overlap(p) for p in primals)
    with _mutation_errors(call):
        out, tangent_out = torch.func.jvp(_checked_outputs(f, call), dense, tangents)[:2]
    return out, tangent_out


@overload
def vjp(f: Callable[..., Any], args: torch.Tensor, v: Any) -> tuple[Any, torch.Tensor]: ...


@overload
def vjp(
    f: Callable[..., Any], args: Sequence[torch.Tensor], v: Any
) -> tuple[Any, tuple[torch.Tensor, ...]]: ...


def vjp(f: Callable[..., Any], args: Any, v: Any) -> tuple[Any, Any]:
    r"""Vector-Jacobian product (reverse mode): ``(f(*args), v^T J)``.

    Args:
        f: function of tensors returning a tensor (or a tuple of tensors).
        args: a tensor or a tuple of tensors (the point).
        v: cotangent(s) shaped like the output of ``f``.

    Returns:
        ``(value, vjp)`` where ``vjp`` mirrors ``args`` (a tensor if ``args`` is one).

    Examples:
        >>> import torch
        >>> from gradkit.func import vjp
        >>> vjp(lambda x: x**2, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))
        (tensor([1., 4.]), tensor([2., 0.]))
    """
    call = f"vjp({_name(f)})"
    check_callable(f, call)
    primals, was_seq = _as_tuple(args, call, "args")
    _check_differentiable(primals, range(len(primals)), call, argnums=False)
    with _mutation_errors(call):
        out, vjp_fn = _vjp(_checked_outputs(f, call, floating=True), *primals)
    outs, _ = _as_tuple(out, call, "f(*args)")
    cots, _ = _as_tuple(v, call, "v")
    _check_like(cots, outs, call, "v", "output")
    res = vjp_fn(v if isinstance(out, torch.Tensor) else tuple(cots))
    return out, (res if was_seq else res[0])


_DEFAULT_HESSIAN_CHUNK = 256


@overload
def hessian(
    f: Callable[..., Any], *args: Any, argnums: int = 0, chunk_size: int | None = None
) -> torch.Tensor: ...


@overload
def hessian(
    f: Callable[..., Any], *args: Any, argnums: tuple[int, ...], chunk_size: int | None = None
) -> tuple[tuple[torch.Tensor, ...], ...]: ...


def hessian(
    f: Callable[..., Any],
    *args: Any,
    argnums: int | tuple[int, ...] = 0,
    chunk_size: int | None = None,
) -> torch.Tensor | tuple[tuple[torch.Tensor, ...], ...]:
    r"""The Hessian of ``f`` at ``args`` (reverse over reverse, chunked).

    .. math:: H[o, x, x'] = \frac{\partial^2 f(\text{args})[o]}{\partial x \, \partial x'}

    Computed as ``jacrev(jacrev(f))`` on the flattened arguments with the outer Jacobian in
    chunks: on CPU this beats ``torch.func.hessian`` (forward over reverse) and the unchunked
    form (cache effects), and bounds memory. torch.func's second derivatives are wrong for some
    functions, symmetric or not (layer_norm with affine parameters, batch_norm in training
    mode, a :func:`custom_gradient`, which the outer transform takes as a constant), so the
    result is checked against one Hessian-vector product by double backward through
    ``torch.autograd`` (a random combination of the outputs and a random vector: about the cost
    of two gradients); where they differ, the Hessian is recomputed by double backward, with a
    warning in the ``gradkit.func`` log. Called inside another torch.func transform, where
    ``torch.autograd`` cannot run, only the symmetry of each output's Hessian is checked, and
    under ``vmap`` not even that: the call is refused (take :func:`hvp`, or
    ``torch.func.hessian`` unchecked).

    Args:
        f: function of tensors, usually scalar-valued (an output of shape ``O`` gives
            ``O + X + X``).
        *args: the point.
        argnums: which argument(s); a tuple gives a tuple of tuples of blocks
            ``H[i][j]`` of shape ``O + X_i + X_j`` (cross terms included).
        chunk_size: Hessian rows per vectorized pass (default: 256).

    Returns:
        The Hessian (``O + X + X``) or its blocks.

    Examples:
        For :math:`f(x) = \tfrac12 x^\top A x` the Hessian is :math:`(A + A^\top)/2`:

        >>> import torch
        >>> from gradkit.func import hessian
        >>> A = torch.tensor([[1.0, 2.0], [0.0, 3.0]])
        >>> hessian(lambda x: 0.5 * x @ A @ x, torch.zeros(2))
        tensor([[1., 1.],
                [1., 3.]])
    """
    call = f"hessian({_name(f)})"
    check_callable(f, call)
    check_optional_int(chunk_size, call, "chunk_size")
    nums = normalize_argnums(argnums, len(args), call)
    _check_differentiable(args, nums, call)
    primals = [args[i] for i in nums]
    dtypes = {p.dtype for p in primals}
    if len(dtypes) > 1:
        raise TypeError(
            message(
                call,
                "argnums",
                "arguments of one dtype",
                ", ".join(str(d) for d in dtypes),
                "convert them to one dtype or take one Hessian per argument",
            )
        )
    sizes = [p.numel() for p in primals]

    def flat_f(v: torch.Tensor) -> Any:
        parts = [t.view(p.shape) for t, p in zip(v.split(sizes), primals, strict=True)]
        out = _substitute(f, args, nums)(*parts)
        _check_floating_output(out, call)
        return out

    v0 = torch.cat([p.reshape(-1) for p in primals])
    chunk = chunk_size if chunk_size is not None else min(v0.numel(), _DEFAULT_HESSIAN_CHUNK)
    with _mutation_errors(call):
        h = torch.func.jacrev(torch.func.jacrev(flat_f), chunk_size=chunk)(v0)
    if torch._C._functorch.maybe_current_level() is None:
        h = _checked_product(h, flat_f, v0, chunk, call)
    else:  # inside another transform: torch.autograd cannot check it
        h = _checked_symmetric(h, flat_f, v0, chunk, call)
    o_shape = h.shape[:-2]
    if isinstance(argnums, int):
        return h.reshape((*o_shape, *primals[0].shape, *primals[0].shape))
    rows = h.split(sizes, dim=-2)
    return tuple(
        tuple(
            blk.reshape((*o_shape, *pi.shape, *pj.shape))
            for blk, pj in zip(r.split(sizes, dim=-1), primals, strict=True)
        )
        for r, pi in zip(rows, primals, strict=True)
    )


def _checked_product(
    h: torch.Tensor, flat_f: Callable[[torch.Tensor], Any], v0: torch.Tensor, chunk: int, call: str
) -> torch.Tensor:
    """``h`` (``O + [n, n]``: one Hessian per output entry), or, where torch.func's does not
    give the Hessian-vector product that double backward gives (for a random combination ``c``
    of the outputs and a random ``w``), every output's Hessian again by double backward.

    torch.func's second derivatives are wrong for some operations (layer_norm with affine
    parameters, batch_norm in training mode: torch 2.13; a :func:`custom_gradient`, a constant
    of the outer transform), and a wrong Hessian can be symmetric (always, of one variable): a
    scalar scaling a layer_norm's input and weight came out 9.4 off, symmetric. One product
    by ``torch.autograd`` costs about two gradients.

    Each entry of the product is compared within its own row's rounding (``sqrt(eps)`` of
    ``sum_kj |c_k H_kij w_j|``, plus ``n eps`` of the largest row's): a wrong entry that is
    small beside the largest (a ``1e-7`` regularizer's curvature beside a data term's ``108``)
    is seen. Columns holding an infinite or undefined entry (``sqrt`` at 0) are left out of the
    product (``w_j = 0``) so the finite entries are still checked; where double backward gives
    no finite value to compare a row with, every Hessian is computed by double backward."""
    if not h.is_floating_point():
        return h
    n = v0.numel()
    blocks = h.detach().reshape(-1, n, n)
    gen = torch.Generator(device=h.device).manual_seed(0)
    c = torch.randn(blocks.shape[0], generator=gen, dtype=h.dtype, device=h.device)
    w = torch.randn(n, generator=gen, dtype=h.dtype, device=h.device)
    finite = torch.isfinite(blocks)
    if not bool(finite.all()):  # leave out the columns of a non-finite entry
        w = torch.where(finite.all(0).all(0), w, torch.zeros_like(w))
        blocks = torch.where(finite, blocks, torch.zeros_like(blocks))
    want = _product_double_backward(flat_f, v0, c, w, call)
    if not bool(torch.isfinite(want).all()):
        logger.warning(
            "%s: double backward gives non-finite Hessian-vector products where torch.func's "
            "Hessian is finite, so it cannot be checked; computing it by double backward",
            call,
        )
        return _double_backward_all(h, flat_f, v0, chunk, call)
    got = torch.einsum("k,kij,j->i", c, blocks, w)
    # rounding of both products: sqrt(eps) of each row's sum_kj |c_k H_kij w_j|, and n eps of
    # the largest (the rounding of rows that cancel)
    bound = torch.einsum("k,kij,j->i", c.abs(), blocks.abs(), w.abs())
    eps = torch.finfo(h.dtype).eps
    tol = eps**0.5 * torch.maximum(bound, want.abs()) + n * eps * bound.max()
    off = (got - want).abs()
    if bool((off <= tol).all()):
        return h
    logger.warning(
        "%s: torch.func's Hessian disagrees with double backward (a Hessian-vector product "
        "%.3g off); recomputing it by double backward",
        call,
        float(off.max()),
    )
    return _double_backward_all(h, flat_f, v0, chunk, call)


def _product_double_backward(
    f: Callable[[torch.Tensor], Any],
    v0: torch.Tensor,
    c: torch.Tensor,
    w: torch.Tensor,
    call: str,
) -> torch.Tensor:
    """``sum_k c_k H_k w`` (``H_k``: the Hessian of output entry ``k`` of ``f`` at the flat
    ``v0``) by double backward through ``torch.autograd``."""
    with torch.enable_grad():
        x = v0.detach().requires_grad_(True)
        out = f(x).reshape(-1)
        (g,) = first_grads(out, [x], c.to(out.dtype), call=call)
        if g is None or not g.requires_grad:
            return torch.zeros_like(w)
        (hw,) = torch.autograd.grad(g, x, w.to(g.dtype), allow_unused=True)
    return torch.zeros_like(w) if hw is None else hw.detach().to(w.dtype)


def _double_backward_all(
    h: torch.Tensor, flat_f: Callable[[torch.Tensor], Any], v0: torch.Tensor, chunk: int, call: str
) -> torch.Tensor:
    """Every output entry's Hessian by double backward, shaped as ``h``; refused where it is
    asymmetric too (a wrong second derivative in torch's own backward)."""
    n = v0.numel()
    if h.dim() == 2:
        fixed = [_hessian_double_backward(flat_f, v0, chunk, call)]
    else:
        fixed = [
            _hessian_double_backward(functools.partial(_entry, flat_f, k), v0, chunk, call)
            for k in range(h.reshape(-1, n, n).shape[0])
        ]
    for b in fixed:
        if not _symmetric(b):  # torch's own double backward is wrong there too
            raise GradkitError(
                f"{call}: f's Hessian came out asymmetric by torch.func and by double backward "
                f"(max |H - H^T| = {float((b - b.T).abs().max()):.3g}), so one of its operations "
                "has a wrong second derivative in this torch; check it with "
                "torch.autograd.gradgradcheck and write it with other operations"
            )
    return torch.stack(fixed).reshape(h.shape).to(h.dtype)


def _checked_symmetric(
    h: torch.Tensor, flat_f: Callable[[torch.Tensor], Any], v0: torch.Tensor, chunk: int, call: str
) -> torch.Tensor:
    """:func:`_checked_product` inside another torch.func transform (``jacrev(hessian)``),
    where ``torch.autograd`` cannot run: each output entry's Hessian must be symmetric, or all
    are recomputed by double backward (the cross terms of a vector output's came out 0.36 off
    with the check on scalar outputs only). Under ``vmap`` no value can be read, so nothing
    can be checked: refused."""
    n = v0.numel()
    blocks = h.reshape(-1, n, n)
    try:
        gaps = [float((b - b.T).abs().max()) for b in blocks if not _symmetric(b)]
    except RuntimeError as error:  # vmap: no random draw, no value read
        raise GradkitError(
            message(
                call,
                "f",
                "a call outside torch.func.vmap, where its Hessian can be checked (torch.func's "
                "second derivatives are wrong for some operations, e.g. layer_norm with affine "
                "parameters)",
                "a call inside vmap",
                "take gradkit.func.hvp under vmap, or torch.func.hessian where f has none of "
                "those operations",
            )
        ) from error
    if not gaps:
        return h
    logger.warning(
        "%s: torch.func gave an asymmetric Hessian (max |H - H^T| = %.3g); "
        "recomputing it by double backward",
        call,
        max(gaps),
    )
    return _double_backward_all(h, flat_f, v0, chunk, call)


def _entry(f: Callable[[torch.Tensor], Any], k: int, v: torch.Tensor) -> torch.Tensor:
    """Entry ``k`` of ``f(v)``, flattened."""
    out: torch.Tensor = f(v).reshape(-1)[k]
    return out


def _symmetric(h: torch.Tensor) -> bool:
    """Whether ``h`` is symmetric up to rounding, by one pass over it: for random ``u, w``,
    ``u^T (H w) = w^T (H u)`` exactly when ``H = H^T``, and differs with probability 1
    otherwise."""
    h = h.detach()
    if not h.is_floating_point():
        return True
    gen = torch.Generator(device=h.device).manual_seed(0)
    uw = torch.randn(h.shape[0], 2, generator=gen, dtype=h.dtype, device=h.device)
    huw = h @ uw
    if not torch.isfinite(huw).all():
        return True
    u, w = uw.unbind(1)
    hu, hw = huw.unbind(1)
    gap = float((u @ hw - w @ hu).abs())
    scale = float(u.norm() * hw.norm() + w.norm() * hu.norm())
    return gap <= torch.finfo(h.dtype).eps ** 0.5 * scale


def _hessian_double_backward(
    f: Callable[[torch.Tensor], Any], v0: torch.Tensor, chunk: int, call: str
) -> torch.Tensor:
    """The Hessian of a scalar ``f`` at the flat ``v0`` by rows of double backward."""
    with torch.enable_grad():
        x = v0.detach().requires_grad_(True)
        (g,) = first_grads(f(x), [x], call=call)
        if g is None or not g.requires_grad:
            return torch.zeros(x.numel(), x.numel(), dtype=x.dtype, device=x.device)
        eye = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
        rows = [
            torch.autograd.grad(
                g,
                x,
                eye[i : i + chunk],
                retain_graph=True,
                is_grads_batched=True,
                allow_unused=True,
            )[0]
            for i in range(0, x.numel(), chunk)
        ]
    return torch.cat([torch.zeros_like(eye[:0]) if r is None else r for r in rows]).detach()


def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a constant: the same values, no gradient flows through it (``tf.stop_gradient``).

    Works in eager autograd and inside ``torch.func`` transforms.

    Examples:
        >>> import torch
        >>> from gradkit.func import grad, stop_gradient
        >>> grad(lambda x: (x * stop_gradient(x)).sum())(torch.tensor([3.0]))
        tensor([3.])
    """
    return check_tensor(x, "stop_gradient(x)", "x").detach()

"""Function transforms: grad, value_and_grad, jvp, vjp, jacobian (automatic mode), batch_jacobian,
hessian, stop_gradient.

Index legend for shapes: ``O`` the output shape of ``f``, ``X`` the shape of a differentiated
argument, ``b`` the batch size, ``m = prod(O)``, ``n = prod(X)`` (summed over ``argnums``).

Mode choice (:func:`jacobian` with ``mode="auto"``): a Jacobian costs ``m`` vector-Jacobian
products in reverse mode and ``n`` Jacobian-vector products in forward mode, so reverse is used
when ``m <= n`` and forward otherwise. :func:`batch_jacobian` applies the same rule to the
*per-example* sizes: it never pushes ``b * n`` tangents through a batch-summed output (the trap
that makes forward mode 333x slower than it should be).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import vmap

from gradkit._errors import describe, message
from gradkit._validate import check_choice, normalize_argnums

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

_MODES = ("auto", "forward", "reverse")
logger = logging.getLogger(__name__)


def _name(f: Callable[..., Any]) -> str:
    return getattr(f, "__name__", type(f).__name__)


def _check_differentiable(args: Sequence[Any], nums: Sequence[int], call: str) -> None:
    for i in nums:
        a = args[i]
        if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_complex()):
            raise TypeError(
                message(
                    call,
                    f"argument {i}",
                    "a floating-point tensor (it is in argnums)",
                    describe(a),
                    "convert it with .double()/.float() or leave it out of argnums",
                )
            )


def _substitute(
    f: Callable[..., Any], args: Sequence[Any], nums: Sequence[int]
) -> Callable[..., Any]:
    """``f`` as a function of the arguments at ``nums`` only (the others held fixed)."""

    def g(*diff: torch.Tensor) -> Any:
        full = list(args)
        for i, d in zip(nums, diff, strict=True):
            full[i] = d
        return f(*full)

    return g


def _vjp(f: Callable[..., Any], *primals: torch.Tensor) -> tuple[Any, Callable[..., Any]]:
    """``torch.func.vjp`` without auxiliary output: ``(f(*primals), vjp_fn)``."""
    res = torch.func.vjp(f, *primals)
    return res[0], res[1]


def _check_chunk(chunk_size: Any, call: str) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            message(
                call,
                "chunk_size",
                "None or a positive int",
                repr(chunk_size),
                "pass e.g. chunk_size=64",
            )
        )


def _check_tensor_output(out: Any, call: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            message(
                call,
                "f",
                "a function returning one tensor",
                describe(out),
                "return a single tensor (stack or concatenate several)",
            )
        )
    return out


def _check_scalar(out: Any, call: str) -> None:
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise ValueError(
            message(
                call,
                "f",
                "a function returning a scalar tensor",
                describe(out),
                "reduce the output (e.g. .sum() or .mean()), "
                "or use jacobian/vjp for non-scalar outputs",
            )
        )


def grad(
    f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False
) -> Callable[..., Any]:
    """The gradient of a scalar function, as a function (``torch.func.grad`` with checks).

    Args:
        f: function of tensors returning a scalar tensor (or ``(scalar, aux)`` with has_aux).
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
    with has_aux), computing both in one pass.

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
            else:
                _check_scalar(out, call)
            return out

        torch_argnums = nums[0] if isinstance(argnums, int) else nums
        gv = torch.func.grad_and_value(checked, argnums=torch_argnums, has_aux=has_aux)
        g, value = gv(*args, **kwargs)
        if has_aux and not with_value:
            return g, value[1]
        return (value, g) if with_value else g

    return transformed


def _as_tuple(value: Any, call: str, argument: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value), True
    raise TypeError(
        message(
            call,
            argument,
            "a tensor or a tuple of tensors",
            describe(value),
            f"pass {argument} as a tensor or a tuple of tensors",
        )
    )


def _check_like(
    vs: Sequence[torch.Tensor],
    refs: Sequence[torch.Tensor],
    call: str,
    argument: str,
    ref_name: str,
) -> None:
    if len(vs) != len(refs):
        raise ValueError(
            message(
                call,
                argument,
                f"{len(refs)} tensors (one per {ref_name})",
                f"{len(vs)}",
                f"pass one tensor per {ref_name}",
            )
        )
    for i, (v, r) in enumerate(zip(vs, refs, strict=True)):
        if v.shape != r.shape:
            raise ValueError(
                message(
                    call,
                    f"{argument}[{i}]",
                    f"shape {tuple(r.shape)}",
                    describe(v),
                    f"shape it like {ref_name} {i}",
                )
            )


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
    primals, _ = _as_tuple(args, call, "args")
    tangents, _ = _as_tuple(v, call, "v")
    _check_like(tangents, primals, call, "v", "argument")
    out, tangent_out = torch.func.jvp(f, primals, tangents)[:2]
    return out, tangent_out


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
    primals, was_seq = _as_tuple(args, call, "args")
    out, vjp_fn = _vjp(f, *primals)
    outs, _ = _as_tuple(out, call, "f(*args)")
    cots, _ = _as_tuple(v, call, "v")
    _check_like(cots, outs, call, "v", "output")
    res = vjp_fn(v if isinstance(out, torch.Tensor) else tuple(cots))
    return out, (res if was_seq else res[0])


def _reverse_rows(
    out: torch.Tensor,
    vjp_fn: Callable[..., Any],
    primals: Sequence[torch.Tensor],
    chunk_size: int | None,
    vectorize: bool,
) -> tuple[torch.Tensor, ...]:
    """Jacobian blocks from ``m`` VJPs: one [*O, *X] block per primal."""
    m = out.numel()
    basis = torch.eye(m, dtype=out.dtype, device=out.device).view(m, *out.shape)
    if vectorize:
        rows = vmap(vjp_fn, chunk_size=chunk_size)(basis)
    else:
        per_row = [vjp_fn(b) for b in basis]
        rows = tuple(torch.stack([r[k] for r in per_row]) for k in range(len(primals)))
    return tuple(r.reshape((*out.shape, *p.shape)) for r, p in zip(rows, primals, strict=True))


def _forward_cols(
    g: Callable[..., Any], primals: Sequence[torch.Tensor], chunk_size: int | None, vectorize: bool
) -> tuple[torch.Tensor, ...]:
    """Jacobian blocks from ``n`` JVPs: one [*O, *X] block per primal."""
    sizes = [p.numel() for p in primals]
    n = sum(sizes)
    tangents = []
    offset = 0
    for p, s in zip(primals, sizes, strict=True):
        t = torch.zeros(n, s, dtype=p.dtype, device=p.device)
        t[offset : offset + s].copy_(torch.eye(s, dtype=p.dtype, device=p.device))
        tangents.append(t.view(n, *p.shape))
        offset += s

    def push(*t: torch.Tensor) -> torch.Tensor:
        return _check_tensor_output(torch.func.jvp(g, tuple(primals), t)[1], "jacobian(f)")

    if vectorize:
        cols = vmap(push, chunk_size=chunk_size)(*tangents)
    else:
        cols = torch.stack([push(*(t[k] for t in tangents)) for k in range(n)])
    out_shape = cols.shape[1:]
    blocks = []
    offset = 0
    for p, s in zip(primals, sizes, strict=True):
        block = cols[offset : offset + s].movedim(0, -1)
        blocks.append(block.reshape((*out_shape, *p.shape)))
        offset += s
    return tuple(blocks)


# Output sizes seen per function and argument signature: a repeated ``jacobian(f, x)`` call in
# auto mode picks forward mode without first running the reverse-mode forward pass.
_OUT_SIZES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], int]] = weakref.WeakKeyDictionary()
_SCALARS = (int, float, bool, str, type(None))


def _shape_key(f: Any, args: Sequence[Any], nums: Sequence[int]) -> tuple[Any, ...] | None:
    parts: list[Any] = [tuple(nums)]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((tuple(a.shape), a.dtype, a.device))
        elif isinstance(a, _SCALARS):
            parts.append(a)
        else:
            return None
    return tuple(parts)


def _known_out_size(f: Any, key: tuple[Any, ...] | None, default: int) -> int:
    try:
        return _OUT_SIZES.get(f, {}).get(key, default) if key is not None else default
    except TypeError:  # f cannot be weakly referenced
        return default


def _remember_out_size(f: Any, key: tuple[Any, ...] | None, size: int) -> None:
    if key is None:
        return
    with contextlib.suppress(TypeError):  # f cannot be weakly referenced
        _OUT_SIZES.setdefault(f, {})[key] = size


def _try_forward(
    g: Callable[..., Any],
    primals: Sequence[torch.Tensor],
    chunk_size: int | None,
    vectorize: bool,
    call: str,
    required: bool,
) -> tuple[torch.Tensor, ...] | None:
    """Forward-mode blocks, or None when an operation has no forward rule and the mode was
    only preferred (auto), not required."""
    try:
        return _forward_cols(g, primals, chunk_size, vectorize)
    except NotImplementedError as err:  # e.g. an autograd.Function without jvp
        if required:
            raise
        logger.debug("%s: forward mode unavailable (%s); using reverse mode", call, err)
        return None


def jacobian(
    f: Callable[..., Any],
    *args: Any,
    argnums: int | tuple[int, ...] = 0,
    mode: str = "auto",
    chunk_size: int | None = None,
    vectorize: bool = True,
) -> Any:
    r"""The Jacobian of ``f`` at ``args``, picking forward or reverse mode by size.

    .. math:: J[o, x] = \frac{\partial f(\text{args})[o]}{\partial \text{args}[\text{argnums}][x]}

    Args:
        f: function of tensors returning one tensor of shape ``O``.
        *args: the point.
        argnums: which argument(s) to differentiate; a tuple gives a tuple of blocks.
        mode: ``"auto"`` (reverse when ``prod(O) <= n``, the number of differentiated
            elements, else forward; reverse also when an operation has no forward-mode rule,
            e.g. a :func:`custom_gradient`), ``"reverse"`` or ``"forward"``. Auto mode learns
            ``prod(O)`` from one reverse-mode forward pass the first time it sees ``f`` with
            arguments of given shapes, and remembers it for later calls.
        chunk_size: how many VJPs/JVPs to vectorize at once (memory knob; None = all).
        vectorize: False computes one product at a time in a Python loop, for functions with
            operations that ``torch.func.vmap`` cannot batch.

    Returns:
        A tensor of shape ``O + X`` (or a tuple of them for a tuple ``argnums``).

    Examples:
        TensorFlow's ``GradientTape.jacobian`` example:

        >>> import torch
        >>> from gradkit.func import jacobian
        >>> jacobian(lambda x: x * x, torch.tensor([1.0, 2.0]))
        tensor([[2., 0.],
                [0., 4.]])
    """
    call = f"jacobian({_name(f)})"
    check_choice(mode, _MODES, call, "mode")
    _check_chunk(chunk_size, call)
    nums = normalize_argnums(argnums, len(args), call)
    _check_differentiable(args, nums, call)
    g = _substitute(f, args, nums)
    primals = tuple(args[i] for i in nums)
    n_in = sum(p.numel() for p in primals)
    key = _shape_key(f, args, nums)
    blocks: tuple[torch.Tensor, ...] | None = None
    if mode == "forward" or (mode == "auto" and _known_out_size(f, key, default=0) > n_in):
        blocks = _try_forward(g, primals, chunk_size, vectorize, call, required=mode != "auto")
    if blocks is None:
        out, vjp_fn = _vjp(g, *primals)
        out = _check_tensor_output(out, call)
        _remember_out_size(f, key, out.numel())
        if mode == "auto" and out.numel() > n_in:
            blocks = _try_forward(g, primals, chunk_size, vectorize, call, required=False)
        if blocks is None:
            blocks = _reverse_rows(out, vjp_fn, primals, chunk_size, vectorize)
    assert blocks is not None
    return blocks[0] if isinstance(argnums, int) else blocks


def batch_jacobian(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    mode: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""Per-example Jacobians ``J[i] = d f(x)[i] / d x[i]`` of a function that maps rows to rows.

    ``f`` must compute row ``i`` of its output from row ``i`` of ``x`` only (no BatchNorm in
    training mode, no attention across the batch); the other blocks of the full Jacobian are
    then zero and are never computed. Reverse mode pushes one cotangent per per-example output
    element through the batch-summed output; forward mode pushes one tangent per per-example
    input element, the same for every row: both cost a handful of batched passes, never
    ``b`` times more.

    Args:
        f: function from ``x`` of shape ``[b, *X]`` to an output of shape ``[b, *O]``.
        x: the batch.
        mode: ``"auto"`` (reverse when ``prod(O) <= prod(X)``), ``"reverse"`` or ``"forward"``.
        chunk_size: how many products to vectorize at once.

    Returns:
        A tensor of shape ``[b, *O, *X]``.

    Examples:
        TensorFlow's ``GradientTape.batch_jacobian`` example:

        >>> import torch
        >>> from gradkit.func import batch_jacobian
        >>> batch_jacobian(lambda x: x * x, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        tensor([[[2., 0.],
                 [0., 4.]],
        <BLANKLINE>
                [[6., 0.],
                 [0., 8.]]])
    """
    call = f"batch_jacobian({_name(f)})"
    check_choice(mode, _MODES, call, "mode")
    _check_chunk(chunk_size, call)
    _check_differentiable((x,), (0,), call)
    if x.dim() == 0:
        raise ValueError(
            message(
                call,
                "x",
                "a tensor with a leading batch dimension",
                describe(x),
                "pass x of shape [batch, ...]",
            )
        )
    out, vjp_fn = _vjp(f, x)
    out = _check_tensor_output(out, call)
    if out.dim() == 0 or out.shape[0] != x.shape[0]:
        raise ValueError(
            message(
                call,
                "f(x)",
                f"leading dimension {x.shape[0]} (that of x)",
                describe(out),
                "f must map each row of x to a row of output",
            )
        )
    b, o_shape, x_shape = x.shape[0], out.shape[1:], x.shape[1:]
    m, n = out[0].numel(), x[0].numel()
    if mode == "reverse" or (mode == "auto" and m <= n):
        basis = torch.eye(m, dtype=out.dtype, device=out.device).view(m, 1, *o_shape)
        (rows,) = vmap(vjp_fn, chunk_size=chunk_size)(basis.expand(m, b, *o_shape))
        return rows.reshape(m, b, n).transpose(0, 1).reshape(b, *o_shape, *x_shape)
    basis = torch.eye(n, dtype=x.dtype, device=x.device).view(n, 1, *x_shape)

    def push(t: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(f, (x,), (t,))[1]

    try:
        cols = vmap(push, chunk_size=chunk_size)(basis.expand(n, b, *x_shape))
    except NotImplementedError as err:  # e.g. an autograd.Function without jvp
        if mode == "forward":
            raise
        logger.debug("%s: forward mode unavailable (%s); using reverse mode", call, err)
        return batch_jacobian(f, x, mode="reverse", chunk_size=chunk_size)
    return cols.reshape(n, b, m).permute(1, 2, 0).reshape(b, *o_shape, *x_shape)


_DEFAULT_HESSIAN_CHUNK = 256


def hessian(
    f: Callable[..., Any],
    *args: Any,
    argnums: int | tuple[int, ...] = 0,
    chunk_size: int | None = None,
) -> Any:
    r"""The Hessian of ``f`` at ``args`` (reverse over reverse, chunked).

    .. math:: H[o, x, x'] = \frac{\partial^2 f(\text{args})[o]}{\partial x \, \partial x'}

    Computed as ``jacrev(jacrev(f))`` on the flattened arguments with the outer Jacobian in
    chunks: on CPU this beats ``torch.func.hessian`` (forward over reverse) and the unchunked
    form (cache effects), and bounds memory.

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
    _check_chunk(chunk_size, call)
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
        return _substitute(f, args, nums)(*parts)

    v0 = torch.cat([p.reshape(-1) for p in primals])
    chunk = chunk_size if chunk_size is not None else min(v0.numel(), _DEFAULT_HESSIAN_CHUNK)
    h = torch.func.jacrev(torch.func.jacrev(flat_f), chunk_size=chunk)(v0)
    if h.dim() == 2 and not _symmetric(h):
        # torch.func's second derivatives are wrong for some operations (layer_norm with
        # affine parameters after a Linear, batch_norm in training mode: torch 2.13); a Hessian
        # must be symmetric, so recompute by double backward through torch.autograd
        logger.warning(
            "%s: torch.func gave an asymmetric Hessian (max |H - H^T| = %.3g); "
            "recomputing it by double backward",
            call,
            float((h - h.T).abs().max()),
        )
        h = _hessian_double_backward(flat_f, v0, chunk)
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
    f: Callable[[torch.Tensor], Any], v0: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The Hessian of a scalar ``f`` at the flat ``v0`` by rows of double backward."""
    with torch.enable_grad():
        x = v0.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
        if not g.requires_grad:
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
    return x.detach()

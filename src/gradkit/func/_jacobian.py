"""Jacobians with the mode picked by size: :func:`jacobian` and :func:`batch_jacobian`.

Index legend for shapes: ``O`` the output shape of ``f``, ``X`` the shape of a differentiated
argument, ``b`` the batch size, ``m = prod(O)``, ``n = prod(X)`` (summed over ``argnums``).

Mode choice (:func:`jacobian` with ``mode="auto"``): a Jacobian costs ``m`` vector-Jacobian
products in reverse mode and ``n`` Jacobian-vector products in forward mode, so reverse is used
when ``m <= n`` and forward otherwise. :func:`batch_jacobian` applies the same rule to the
*per-example* sizes: it never pushes ``b * n`` tangents through a batch-summed output (the trap
that makes forward mode 333x slower than it should be), and checks its precondition (output row
``i`` depends on input row ``i`` only) with one more product (:mod:`._independence`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch
from torch.func import vmap

from gradkit._errors import describe, message
from gradkit._forward_ad import load_decompositions
from gradkit._validate import (
    check_bool,
    check_callable,
    check_choice,
    check_optional_int,
    normalize_argnums,
)
from gradkit.func._common import (
    MODES,
    _check_differentiable,
    _check_tensor_output,
    _checked_output,
    _mutation_errors,
    _name,
    _substitute,
    _vjp,
    _without_overlap,
)
from gradkit.func._independence import check_rows_independent

__all__ = ["batch_jacobian", "jacobian"]

logger = logging.getLogger(__name__)


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
    # in the wider of the argument's and the output's dtypes, as forward mode gives it
    return tuple(
        r.reshape((*out.shape, *p.shape)).to(torch.promote_types(r.dtype, out.dtype))
        for r, p in zip(rows, primals, strict=True)
    )


def _forward_cols(
    g: Callable[..., Any], primals: Sequence[torch.Tensor], chunk_size: int | None, vectorize: bool
) -> tuple[torch.Tensor, ...]:
    """Jacobian blocks from ``n`` JVPs: one [*O, *X] block per primal."""
    primals = tuple(_without_overlap(p) for p in primals)
    sizes = [p.numel() for p in primals]
    n = sum(sizes)
    tangents = []
    offset = 0
    for p, s in zip(primals, sizes, strict=True):
        t = torch.zeros(n, s, dtype=p.dtype, device=p.device)
        t[offset : offset + s].copy_(torch.eye(s, dtype=p.dtype, device=p.device))
        tangents.append(t.view(n, *p.shape))
        offset += s

    load_decompositions()

    def push(*t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.jvp(g, tuple(primals), t)[1]
        return out

    if vectorize:
        cols = vmap(push, chunk_size=chunk_size)(*tangents)
    else:
        cols = torch.stack([push(*(t[k] for t in tangents)) for k in range(n)])
    out_shape = cols.shape[1:]
    blocks = []
    offset = 0
    for p, s in zip(primals, sizes, strict=True):
        block = cols[offset : offset + s].movedim(0, -1).reshape((*out_shape, *p.shape))
        # in the wider of the argument's and the output's dtypes, as reverse mode gives it
        blocks.append(block.to(torch.promote_types(block.dtype, p.dtype)))
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


@overload
def jacobian(
    f: Callable[..., Any],
    *args: Any,
    argnums: int = 0,
    mode: str = "auto",
    chunk_size: int | None = None,
    vectorize: bool = True,
) -> torch.Tensor: ...


@overload
def jacobian(
    f: Callable[..., Any],
    *args: Any,
    argnums: tuple[int, ...],
    mode: str = "auto",
    chunk_size: int | None = None,
    vectorize: bool = True,
) -> tuple[torch.Tensor, ...]: ...


def jacobian(
    f: Callable[..., Any],
    *args: Any,
    argnums: int | tuple[int, ...] = 0,
    mode: str = "auto",
    chunk_size: int | None = None,
    vectorize: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
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
        A tensor of shape ``O + X`` (or a tuple of them for a tuple ``argnums``), in the wider
        of the argument's and the output's dtypes. Every mode gives the same Jacobian (but
        where torch's rules differ at an undefined branch: ``where(v > 0, sqrt(v), 0)`` at
        ``v < 0`` gives NaN in reverse mode, 0 in forward mode); an
        argument whose elements share memory (``expand``) is differentiated element by
        element, forward mode working on a dense copy of it.

    Raises:
        TypeError: ``f`` returns an integer or boolean tensor (no derivative to propagate), or
            an argument in ``argnums`` or the output is complex: reverse mode gives the
            conjugate of forward mode's derivative (differentiate ``torch.view_as_real``
            parts instead).
        GradkitError: ``f`` draws random numbers (dropout in training mode) in forward mode,
            which runs it once per tangent under ``vmap``; ``mode="reverse"`` runs it once.

    Examples:
        TensorFlow's ``GradientTape.jacobian`` example:

        >>> import torch
        >>> from gradkit.func import jacobian
        >>> jacobian(lambda x: x * x, torch.tensor([1.0, 2.0]))
        tensor([[2., 0.],
                [0., 4.]])
    """
    call = f"jacobian({_name(f)})"
    check_callable(f, call)
    check_choice(mode, MODES, call, "mode")
    check_optional_int(chunk_size, call, "chunk_size")
    check_bool(vectorize, call, "vectorize")
    nums = normalize_argnums(argnums, len(args), call)
    _check_differentiable(args, nums, call)
    for i in nums:
        _refuse_complex(args[i], call, f"argument {i}")
    g = _real_output(_checked_output(_substitute(f, args, nums), call), call)
    primals = tuple(args[i] for i in nums)
    key = _shape_key(f, args, nums)
    with _mutation_errors(call):
        blocks = _jacobian_blocks(g, f, key, primals, mode, chunk_size, vectorize, call)
    return blocks[0] if isinstance(argnums, int) else blocks


def _refuse_complex(t: torch.Tensor, call: str, what: str) -> None:
    """Refuse a complex argument or output: reverse mode gives the conjugate of forward
    mode's derivative of a holomorphic function (a Jacobian whose sign of the imaginary part
    followed the mode ``auto`` picked by size), and a function that is not holomorphic has
    two Wirtinger derivatives, no one Jacobian. torch.func refuses them too."""
    if t.is_complex():
        raise TypeError(
            message(
                call,
                what,
                "a real floating-point tensor",
                describe(t),
                "differentiate the real and imaginary parts as real tensors "
                "(torch.view_as_real(z), and torch.view_as_complex inside f), or take vector "
                "products with gradkit.func.gradients, which follows TensorFlow's convention "
                "for complex values",
            )
        )


def _real_output(f: Callable[..., torch.Tensor], call: str) -> Callable[..., torch.Tensor]:
    def g(*args: Any) -> torch.Tensor:
        out = f(*args)
        _refuse_complex(out, call, "f's output")
        return out

    return g


def _jacobian_blocks(
    g: Callable[..., Any],
    f: Callable[..., Any],
    key: tuple[Any, ...] | None,
    primals: tuple[torch.Tensor, ...],
    mode: str,
    chunk_size: int | None,
    vectorize: bool,
    call: str,
) -> tuple[torch.Tensor, ...]:
    n_in = sum(p.numel() for p in primals)
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
    return blocks


def batch_jacobian(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    mode: str = "auto",
    chunk_size: int | None = None,
    check_independence: bool = True,
) -> torch.Tensor:
    r"""Per-example Jacobians ``J[i] = d f(x)[i] / d x[i]`` of a function that maps rows to rows.

    ``f`` must compute row ``i`` of its output from row ``i`` of ``x`` only (no BatchNorm in
    training mode, no attention across the batch); the other blocks of the full Jacobian are
    then zero and are never computed. Reverse mode pushes one cotangent per per-example output
    element through the batch-summed output; forward mode pushes one tangent per per-example
    input element, the same for every row: both cost a handful of batched passes, never
    ``b`` times more.

    The precondition is checked by default with one more vector-Jacobian product (a random
    cotangent on every row, about one backward through ``f``, plus ``b * prod(O) * prod(X)``
    multiply-adds): its result must equal the one assembled from the per-example Jacobians.
    That holds for a row-wise function and fails, whatever rows are coupled, for one that mixes
    rows (couplings below ``sqrt(eps)`` of the largest entry are not seen). Skipped inside
    ``torch.func`` transforms. Complex ``x`` or outputs are refused, as by :func:`jacobian`.

    Args:
        f: function from ``x`` of shape ``[b, *X]`` to an output of shape ``[b, *O]``.
        x: the batch (at least one row).
        mode: ``"auto"`` (reverse when ``prod(O) <= prod(X)``), ``"reverse"`` or ``"forward"``.
        chunk_size: how many products to vectorize at once.
        check_independence: check that output row ``i`` depends on input row ``i`` only
            (``False`` skips the extra product; the blocks of a function that mixes rows are
            then not those of its full Jacobian).

    Returns:
        A tensor of shape ``[b, *O, *X]``.

    Raises:
        GradkitError: ``f`` mixes rows (``x - x.mean(0)``, batch norm in training mode,
            softmax over dimension 0); the message names the rows.

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
    check_callable(f, call)
    check_choice(mode, MODES, call, "mode")
    check_optional_int(chunk_size, call, "chunk_size")
    check_bool(check_independence, call, "check_independence")
    _check_differentiable((x,), (0,), call, argnums=False)
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(
            message(
                call,
                "x",
                "a tensor with a leading batch dimension of at least one row",
                describe(x),
                "pass x of shape [batch, ...] with batch >= 1",
            )
        )
    _refuse_complex(x, call, "x")
    with _mutation_errors(call):
        out, vjp_fn = _vjp(_real_output(_checked_output(f, call), call), x)
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
        blocks = rows.reshape(m, b, n).transpose(0, 1).reshape(b, *o_shape, *x_shape)
    else:
        basis = torch.eye(n, dtype=x.dtype, device=x.device).view(n, 1, *x_shape)
        load_decompositions()
        x_dense = _without_overlap(x)

        def push(t: torch.Tensor) -> torch.Tensor:
            return torch.func.jvp(f, (x_dense,), (t,))[1]

        try:
            with _mutation_errors(call):
                cols = vmap(push, chunk_size=chunk_size)(basis.expand(n, b, *x_shape))
        except NotImplementedError as err:  # e.g. an autograd.Function without jvp
            if mode == "forward":
                raise
            logger.debug("%s: forward mode unavailable (%s); using reverse mode", call, err)
            return batch_jacobian(
                f, x, mode="reverse", chunk_size=chunk_size, check_independence=check_independence
            )
        blocks = cols.reshape(n, b, m).permute(1, 2, 0).reshape(b, *o_shape, *x_shape)
    if check_independence:  # in the products' own precision
        check_rows_independent(vjp_fn, x, out, blocks, call)
    # in the wider of x's and the output's dtypes, whichever mode computed it
    return blocks.to(torch.promote_types(x.dtype, out.dtype))

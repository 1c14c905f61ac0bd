"""Argument checks and small helpers shared by the function transforms of :mod:`gradkit.func`
(:mod:`._transforms`, :mod:`._jacobian`, :mod:`._hvp`, :mod:`._module`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeGuard, TypeVar

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_leaves

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import is_batching_error

__all__ = [
    "MODES",
    "_as_tuple",
    "_check_differentiable",
    "_check_floating_output",
    "_check_like",
    "_check_scalar",
    "_check_tensor_output",
    "_check_tensor_tree",
    "_checked_output",
    "_checked_outputs",
    "_mutation_errors",
    "_name",
    "_substitute",
    "_vjp",
    "_without_overlap",
    "computes_as",
    "is_transformed",
    "unbatched_retry",
]

MODES = ("auto", "forward", "reverse")

_M = TypeVar("_M", bound=nn.Module)
_T = TypeVar("_T")


def _name(f: Callable[..., Any]) -> str:
    return getattr(f, "__name__", type(f).__name__)


def _check_differentiable(
    args: Sequence[Any], nums: Sequence[int], call: str, *, argnums: bool = True
) -> None:
    for i in nums:
        a = args[i]
        if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_complex()):
            raise TypeError(
                message(
                    call,
                    f"argument {i}" if argnums else f"args[{i}]",
                    "a floating-point tensor" + (" (it is in argnums)" if argnums else ""),
                    describe(a),
                    "convert it with .double()/.float()"
                    + (" or leave it out of argnums" if argnums else ""),
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


@contextlib.contextmanager
def _mutation_errors(call: str) -> Iterator[None]:
    """Word torch's errors about what ``f`` does that no transform can differentiate, which
    name neither the call nor a remedy: mutating a tensor it captures or its argument in
    place, drawing random numbers under ``vmap``. Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        if "mutate a captured Tensor" in text:
            raise GradkitError(
                f"{call}: f: expected a function that changes no tensor it captures, got one "
                "that modifies a captured tensor in place (e.g. BatchNorm updating its running "
                "statistics in training mode), which torch.func transforms cannot "
                "differentiate; put such modules in eval mode (model.eval()), or call the "
                "model with torch.func.functional_call and copies of its buffers"
            ) from err
        if "leaf Variable that requires grad is being used in an in-place operation" in text or (
            "is a view and is being modified inplace" in text and "returns multiple views" in text
        ):
            raise GradkitError(
                f"{call}: f: expected a function that leaves its arguments unchanged, got one "
                "that modifies an argument (or a captured tensor that requires grad) in place "
                "(e.g. x.mul_(2)), which autograd refuses to differentiate; compute out of "
                "place (x * 2) or on a copy (x.clone().mul_(2))"
            ) from err
        if "called random operation while in randomness error mode" in text:
            raise GradkitError(
                f"{call}: f: expected a deterministic function, got one that draws random "
                "numbers (e.g. dropout in training mode) while forward mode pushes its "
                "tangents through it in one vmap, each with its own draw; make f deterministic "
                "(model.eval()), or pass mode='reverse', which runs f once (one draw)"
            ) from err
        if "must override the setup_context staticmethod" in text:
            raise GradkitError(
                f"{call}: f: expected operations torch.func transforms can differentiate, got "
                "a custom autograd.Function whose forward takes ctx (no setup_context), which "
                "they cannot run; give it a forward without ctx and a setup_context(ctx, "
                "inputs, output) (torch.autograd.Function's docs), or differentiate by double "
                "backward: gradkit.func.hessians(ys, xs) or module_hvp(...)"
            ) from err
        raise


def _vjp(f: Callable[..., Any], *primals: torch.Tensor) -> tuple[Any, Callable[..., Any]]:
    """``torch.func.vjp`` without auxiliary output: ``(f(*primals), vjp_fn)``."""
    res = torch.func.vjp(f, *primals)
    return res[0], res[1]


def _without_overlap(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a dense copy of it when several of its elements share memory (an ``expand``ed
    tensor, stride 0), for forward mode: ``torch.func.jvp`` lays a tangent out like its primal
    and writes it there, which raises for such a tensor (or, for overlapping ``as_strided``
    views, silently writes one element over another). The copy makes each element its own
    variable, as reverse mode treats them; a contiguous tensor is returned as it is."""
    if t.is_contiguous():
        return t
    if not is_transformed(t) and torch._debug_has_internal_overlap(t) == 0:
        return t  # non-overlapping (a transposed or sliced view): nothing to copy
    return t.clone(memory_format=torch.contiguous_format)


def _describe_tree(value: Any) -> str:
    """:func:`describe`, with the tensors inside dicts (and lists and tuples of them) by shape
    and dtype too: the repr of a dict of tensors inside a transform shows torch.func's
    internal wrappers (``GradTrackingTensor(lvl=1, value=...)``)."""
    if isinstance(value, Mapping):
        items = list(value.items())
        inner = ", ".join(f"{k!r}: {_describe_tree(v)}" for k, v in items[:4])
        more = ", ..." if len(items) > 4 else ""
        return f"{type(value).__name__}{{{inner}{more}}} (length {len(items)})"
    if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
        inner = ", ".join(_describe_tree(v) for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        kind = "list" if isinstance(value, list) else "tuple"
        return f"{kind}[{inner}{more}] (length {len(value)})"
    return describe(value)


def _check_tensor_output(out: Any, call: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            message(
                call,
                "f",
                "a function returning one tensor",
                _describe_tree(out),
                "return a single tensor (stack or concatenate several)",
            )
        )
    return out


def _check_tensor_tree(value: Any, call: str, argument: str, expected: str) -> None:
    """Raise a TypeError unless every leaf of ``value`` is a tensor (torch.func's rule for
    outputs and auxiliary values)."""
    bad = [leaf for leaf in tree_leaves(value) if not isinstance(leaf, torch.Tensor)]
    if bad:
        raise TypeError(
            message(
                call,
                argument,
                expected,
                f"{_describe_tree(value)}, with a {type(bad[0]).__name__} leaf",
                "return tensors (convert numbers with torch.as_tensor)",
            )
        )


def _check_floating_output(out: Any, call: str) -> None:
    """Raise a TypeError for an integer or boolean output of ``f``, before reverse mode does
    with an error that names ``torch.func.vjp`` instead of the call: such an output is
    piecewise constant and carries no gradient to propagate."""
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                message(
                    call,
                    "f",
                    "a function returning floating-point or complex tensors",
                    f"an output of dtype {leaf.dtype}",
                    "return the floating-point value it is computed from, or convert it with "
                    ".double()/.float() (its derivative is then zero wherever it exists)",
                )
            )


def _checked_outputs(
    f: Callable[..., Any], call: str, *, floating: bool = False
) -> Callable[..., Any]:
    """``f`` with its outputs checked to be tensors (or tuples of them), and with
    ``floating``, floating-point or complex ones."""

    def g(*args: Any) -> Any:
        out = f(*args)
        _check_tensor_tree(out, call, "f", "a function returning a tensor or a tuple of tensors")
        if floating:
            _check_floating_output(out, call)
        return out

    return g


def _checked_output(f: Callable[..., Any], call: str) -> Callable[..., torch.Tensor]:
    """``f`` with its output checked to be one floating-point or complex tensor."""

    def g(*args: Any) -> torch.Tensor:
        out = _check_tensor_output(f(*args), call)
        _check_floating_output(out, call)
        return out

    return g


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
    *,
    dtype: bool = True,
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
        if dtype and v.dtype != r.dtype:
            raise TypeError(
                message(
                    call,
                    f"{argument}[{i}]",
                    f"dtype {r.dtype} (that of {ref_name} {i})",
                    describe(v),
                    f"convert it with .to({r.dtype})",
                )
            )


def is_transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (inside ``vmap``/``grad``), whose values cannot
    be read."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False


def computes_as(module: nn.Module, base: type[_M]) -> TypeGuard[_M]:
    """Whether ``module`` computes exactly what ``base.forward`` computes, so that a closed form
    written for ``base`` holds for it: an instance of ``base`` whose class keeps
    ``base.forward``, with no forward hooks or forward pre-hooks (its own or torch's global
    module hooks) and no parametrized tensors. A subclass overriding ``forward``, a hook that
    changes the input or output, or ``weight_norm`` fails the test."""
    return (
        isinstance(module, base)
        and type(module).forward is base.forward
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not torch_module._global_forward_hooks
        and not torch_module._global_forward_pre_hooks
        and not parametrize.is_parametrized(module)
    )


def unbatched_retry(err: RuntimeError, first: Callable[[], _T]) -> _T:
    """After a batched backward (``is_grads_batched=True``) failed with ``err``: ``first()``,
    the product with the first vector alone, when the failure is the batching's, else ``err``
    again.

    A failure is the batching's when its message says so (:func:`is_batching_error`), or when
    the product with one vector succeeds where the batched one failed: some batched backward
    formulas mis-broadcast the batch dimension (group_norm's: "The size of tensor a (4) must
    match the size of tensor b (2)") without naming vmap. An error the one-vector product hits
    too is the caller's (a bad shape, a missing derivative) and is raised as it was, as is
    running out of memory (a smaller ``chunk_size`` is the remedy there).
    """
    if is_batching_error(err):
        return first()
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
        raise err
    try:
        return first()
    except RuntimeError:
        raise err from None

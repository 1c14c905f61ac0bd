"""Autograd building blocks shared by the packages (a neutral home: ``func`` and ``curvature``
both use them, neither owns them)."""

from __future__ import annotations

import functools
import re
from collections.abc import Container, Iterable, Iterator, Sequence
from typing import Any

import torch

from gradkit._errors import GradkitError

__all__ = [
    "edges_into",
    "find_error_nodes",
    "first_grads",
    "graph_nodes",
    "refuse_second_order",
    "second_grads",
    "second_order_message",
    "second_order_suspect",
    "signed",
]


def signed(value: Any) -> int:
    """An integer a graph node saved (a dimension, a slice bound): a negative one comes back
    as its unsigned 64-bit form."""
    value = int(value)
    return value - 2**64 if value >= 2**63 else value


def graph_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every node of the autograd graphs of ``roots`` (nodes, None skipped), each once."""
    seen: set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


def edges_into(
    roots: Iterable[Any],
    ids: Container[int],
    leaves: dict[int, Any] | None = None,
    *,
    stop: Container[Any] = (),
) -> dict[int, list[Any]]:
    """``id(leaf) -> [node]``: for each leaf tensor of ``ids`` (parameters) that the graphs of
    ``roots`` reach, the nodes with an edge into its gradient accumulator, one entry per edge.
    A layer's call takes each of its parameters through one such edge, so the counts tell the
    uses of a parameter apart from its layer's calls. ``leaves``, if given, receives
    ``id(leaf) ->`` its accumulator node; the walk does not go past the nodes in ``stop``."""
    found: dict[int, list[Any]] = {}
    seen: set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:  # graph_nodes, inlined: this walk runs at every tracked backward pass
        node = stack.pop()
        if node in seen or (stop and node in stop):
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is None:
                stack.append(nxt)
            elif id(variable) in ids:
                found.setdefault(id(variable), []).append(node)
                if leaves is not None:
                    leaves[id(variable)] = nxt
    return found


def find_error_nodes(
    forward: torch.Tensor | Sequence[torch.Tensor],
    grads: Iterable[torch.Tensor | None],
    *,
    weight_norm: bool = True,
) -> list[str]:
    """Names of the nodes through which a second backward of the graph of ``forward`` (its
    first gradients ``grads``) is silently wrong, or fails with torch's bare error:

    - the nodes of custom ``autograd.Function`` classes whose backward is marked
      ``@once_differentiable``, and the ``Error`` nodes such a backward leaves in the gradients'
      graph. Its result is computed without a graph: where the gradient reaching it does not
      require grad (the function's output enters the loss linearly), the result is a constant,
      and where it does, it is wrapped in an ``Error`` node that a second backward prunes when
      it leads to no input. Either way the second derivative through the function comes out 0,
      without an error;
    - with ``weight_norm``, ``_weight_norm``'s node (``weight_norm``, both forms), where this
      torch's second derivative of it fails ``gradgradcheck`` (torch 2.13: 40 % off for a
      Linear in an MLP). Its derivative in the incoming gradient is exact: a GGN's ``J v`` by
      the double-backward trick passes ``weight_norm=False``;
    - the nodes of torch's fused attention kernels (``scaled_dot_product_attention`` by flash,
      memory-efficient or cuDNN attention), whose backward has no derivative: a second backward
      raises torch's "derivative for ... is not implemented", naming no remedy.
    """
    roots = [forward] if isinstance(forward, torch.Tensor) else list(forward)
    custom = torch.autograd.function.BackwardCFunction
    found: set[str] = set()
    suspects = False
    for node in graph_nodes([t.grad_fn for t in roots]):
        if isinstance(node, custom):
            suspects = True
            if _once_differentiable(node):
                found.add(type(node).__name__)
        elif _FUSED_ATTENTION.fullmatch(type(node).__name__) or (
            weight_norm
            and type(node).__name__ == "WeightNormInterfaceBackward0"
            and _weight_norm_is_wrong()
        ):
            found.add(node.name())
    if suspects:
        tops = [t.grad_fn for t in grads if t is not None and t.grad_fn is not None]
        found |= {n.name() for n in graph_nodes(tops) if "Error" in type(n).__name__}
    return sorted(found)


def second_order_suspect(node: Any) -> bool:
    """Whether a forward node may be one of :func:`find_error_nodes`' (``weight_norm`` aside):
    a custom function's or a fused attention kernel's."""
    custom = torch.autograd.function.BackwardCFunction
    return isinstance(node, custom) or bool(_FUSED_ATTENTION.fullmatch(type(node).__name__))


_FUSED_ATTENTION = re.compile(r"ScaledDotProduct\w*Attention\w*Backward\d*")
"""The nodes of ``scaled_dot_product_attention``'s fused kernels (its math path is made of
ordinary operations)."""

_ONCE = torch.autograd.function.once_differentiable(lambda ctx: None).__code__
"""The code of the wrapper ``@once_differentiable`` puts around a backward (one for all)."""


def _once_differentiable(node: Any) -> bool:
    """Whether a custom function's node has a backward marked ``@once_differentiable``."""
    backward = getattr(getattr(node, "_forward_cls", None), "backward", None)
    return getattr(backward, "__code__", None) is _ONCE


@functools.cache
def _weight_norm_is_wrong() -> bool:
    """Whether this torch's second derivative of ``torch._weight_norm`` fails
    ``gradgradcheck`` (checked once, on a 3 x 4 float64 CPU weight)."""
    with torch.enable_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        v = torch.randn(3, 4, dtype=torch.float64, generator=gen, device="cpu")
        g = torch.rand(3, 1, dtype=torch.float64, generator=gen, device="cpu") + 0.5
        inputs = (v.requires_grad_(True), g.requires_grad_(True))
        return not torch.autograd.gradgradcheck(
            lambda a, b: torch._weight_norm(a, b, 0), inputs, raise_exception=False
        )


def first_grads(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    call: str,
    weight_norm: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, create_graph=True,
    allow_unused=True)``, to be differentiated again: refused (naming ``call``) where the
    graph holds a backward that cannot be (see :func:`find_error_nodes`, also for
    ``weight_norm``)."""
    gs = torch.autograd.grad(
        outputs, list(inputs), grad_outputs, create_graph=True, allow_unused=True
    )
    refuse_second_order(outputs, gs, call=call, weight_norm=weight_norm)
    return gs


def refuse_second_order(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    grads: Iterable[torch.Tensor | None],
    *,
    call: str,
    weight_norm: bool = True,
) -> None:
    """Raise, naming ``call``, where the first gradients ``grads`` of ``outputs`` cannot be
    differentiated again exactly (see :func:`find_error_nodes`)."""
    errors = find_error_nodes(outputs, grads, weight_norm=weight_norm)
    if errors:
        raise GradkitError(second_order_message(call, errors))


def second_order_message(call: str, errors: Sequence[str]) -> str:
    """The refusal of a graph with :func:`find_error_nodes`' ``errors``."""
    if any("ScaledDotProduct" in e for e in errors):
        return (
            f"{call}: the backward pass cannot be differentiated again (graph nodes "
            f"{list(errors)}): torch's fused attention kernels have no second derivative; run "
            "the model with the math kernel, with torch.nn.attention.sdpa_kernel("
            "torch.nn.attention.SDPBackend.MATH) around this call (and around the products "
            "of an operator), or load a Hugging Face model with attn_implementation='eager'"
        )
    if any("WeightNorm" in e for e in errors):
        return (
            f"{call}: the backward pass cannot be differentiated again exactly (graph nodes "
            f"{list(errors)}): this torch's second derivative of weight_norm is wrong (it fails "
            "torch.autograd.gradgradcheck); write the norm with torch operations, e.g. a "
            "parametrization returning g * v / v.norm(dim=1, keepdim=True), or remove it "
            "(torch.nn.utils.parametrize.remove_parametrizations) for curvature"
        )
    return (
        f"{call}: the backward pass cannot be differentiated again (graph nodes {list(errors)}, "
        "of or left by an autograd.Function whose backward is marked @once_differentiable): the "
        "second derivative through it would come out 0; write that backward with "
        "differentiable torch operations"
    )


def second_grads(
    gs: Sequence[torch.Tensor | None],
    xs: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    batched: bool = False,
    create_graph: bool = False,
    retain_graph: bool = True,
) -> list[torch.Tensor]:
    """``d/dx sum_k <g_k, v_k>`` by one backward through the first-gradient graph ``gs``
    (kept for further products unless ``retain_graph=False``).

    With ``batched=True`` each ``v_k`` carries a leading dimension of vectors (vectorized
    backward). Gradients that do not depend on ``xs`` (a linear function) contribute zeros.
    """
    live = [k for k, g in enumerate(gs) if g is not None and g.requires_grad]
    lead = (vs[0].shape[0],) if batched else ()
    if not live:
        return [x.new_zeros((*lead, *x.shape)) for x in xs]
    outputs: list[torch.Tensor] = [g for g in gs if g is not None and g.requires_grad]
    res = torch.autograd.grad(
        outputs,
        list(xs),
        grad_outputs=[vs[k] for k in live],
        retain_graph=retain_graph or create_graph,
        create_graph=create_graph,
        allow_unused=True,
        is_grads_batched=batched,
    )
    return [
        x.new_zeros((*lead, *x.shape)) if r is None else r for r, x in zip(res, xs, strict=True)
    ]

"""TensorFlow's ``tf.gradients`` and ``tf.hessians`` contracts on an already-built PyTorch graph.

``gradients(ys, xs)`` returns, for every ``x`` in ``xs``, the derivative of
``sum_j sum(ys[j] * grad_ys[j])`` with respect to ``x``: a vector-Jacobian product summed over
``ys``, not a Jacobian (use :func:`gradkit.func.jacobian` for that).

What PyTorch's ``torch.autograd.grad`` lacks and this module adds:

* ``grad_ys`` default to ones for non-scalar ``ys`` (PyTorch only fills them in for scalars);
* ``stop_gradients``: tensors treated as constants *after* the graph was built (partial
  derivatives), by hooks that are removed before returning: the stopped ``grad_fn`` receives
  no gradient (undefined, not zeros), and every node that only a stop leads to passes none on,
  so nothing behind a stop is added into the ``xs`` (zeros would be: ``0 * inf`` is NaN at a
  ``sqrt`` or ``log`` at 0);
* ``unconnected_gradients``: ``None`` (TF's default) or zeros for ``xs`` that ``ys`` do not reach,
  decided by a reachability walk of the graph, so a path cut by a stop gives ``None``, not 0;
* integer-valued paths are constant (no exception), as in TF;
* the graph is kept (``retain_graph=True``), so the same graph can be differentiated again,
  like a TF graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch.autograd.graph import Node

from gradkit._autograd import refuse_second_order
from gradkit._errors import GradkitError, describe, message
from gradkit._validate import (
    as_tensor_list,
    check_bool,
    check_choice,
    check_optional_int,
)
from gradkit.func._common import unbatched_retry

__all__ = ["AggregationMethod", "UnconnectedGradients", "gradients", "hessians"]


class UnconnectedGradients:
    """What :func:`gradients` returns for an ``x`` that no ``y`` depends on (TF's enum)."""

    NONE = "none"
    ZERO = "zero"


class AggregationMethod:
    """TensorFlow's aggregation methods, accepted for compatibility.

    PyTorch's engine sums gradient contributions in place as they arrive, so every method gives
    the same values; only the names are checked.
    """

    ADD_N = 0
    DEFAULT = ADD_N
    EXPERIMENTAL_TREE = 1
    EXPERIMENTAL_ACCUMULATE_N = 2


_AGGREGATION_NAMES = {
    "add_n": 0,
    "default": 0,
    "experimental_tree": 1,
    "experimental_accumulate_n": 2,
}
_Edge = tuple[Node, int]


def _check_aggregation(method: Any, call: str) -> None:
    if method is None:
        return
    if isinstance(method, bool) or not (
        (isinstance(method, int) and method in (0, 1, 2))
        or (isinstance(method, str) and method.lower() in _AGGREGATION_NAMES)
    ):
        raise ValueError(
            message(
                call,
                "aggregation_method",
                "None, an AggregationMethod constant (ADD_N, DEFAULT, EXPERIMENTAL_TREE, "
                "EXPERIMENTAL_ACCUMULATE_N) or its name",
                repr(method),
                "pass e.g. gradkit.func.AggregationMethod.ADD_N (all give the same values)",
            )
        )


def _edge(t: torch.Tensor) -> _Edge | None:
    """The graph edge that receives the gradient of ``t`` (None if ``t`` needs no gradient)."""
    if not t.requires_grad:
        return None
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


def _reached_edges(roots: Sequence[torch.Tensor], stops: set[Node]) -> tuple[set[_Edge], set[Node]]:
    """Every edge a gradient from ``roots`` can flow into, not propagating past ``stops``, and
    the nodes it flows through.

    A stopped tensor's own edge is reached (TF reports the gradient *at* a stopped ``x``); only
    what lies behind it is cut.
    """
    reached: set[_Edge] = set()
    seen: set[Node] = set()
    stack: list[Node] = []
    for y in roots:
        e = _edge(y)
        if e is not None:
            reached.add(e)
            stack.append(e[0])
    while stack:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        for nxt, nr in node.next_functions:
            if nxt is not None:
                reached.add((nxt, nr))
                stack.append(nxt)
    return reached, seen


def _behind_stops(stops: set[Node], seen: set[Node]) -> set[Node]:
    """The nodes that gradients reach only through ``stops`` (``seen``: those reached without
    passing one)."""
    behind: set[Node] = set()
    stack = [nxt for node in stops for nxt, _ in node.next_functions if nxt is not None]
    while stack:
        node = stack.pop()
        if node in behind or node in seen or node in stops:
            continue
        behind.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return behind


def _no_grad_in(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[None, ...]:
    """Pre-hook of a stopped node: it receives no gradient, so a generated backward computes
    nothing (zeros would be multiplied by its local derivative, and ``0 * inf`` is NaN)."""
    return (None,) * len(grad_outputs)


def _no_grad_out(
    grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: tuple[torch.Tensor | None, ...]
) -> tuple[None, ...]:
    """Post-hook of a node at or behind a stop: it passes no gradient on, even a custom
    ``autograd.Function``, which runs its backward on zeros for an undefined gradient."""
    return (None,) * len(grad_inputs)


@contextlib.contextmanager
def _stopped(stops: set[Node], seen: set[Node]) -> Iterator[None]:
    """Cut every path through ``stops`` while the block runs (hooks removed on exit)."""
    handles = [n.register_prehook(_no_grad_in) for n in stops]
    try:
        handles += [n.register_hook(_no_grad_out) for n in stops | _behind_stops(stops, seen)]
        yield
    finally:
        for h in handles:
            h.remove()


def _default_grad_ys(ys: list[torch.Tensor], grad_ys: Any, call: str) -> list[torch.Tensor]:
    if grad_ys is None:
        given: list[Any] = [None] * len(ys)
    else:
        given, _ = as_tensor_list(grad_ys, call, "grad_ys", allow_none=True)
        if len(given) != len(ys):
            raise ValueError(
                message(
                    call,
                    "grad_ys",
                    f"one entry per y ({len(ys)})",
                    f"{len(given)} entries",
                    "pass one grad_y per y (None entries mean ones)",
                )
            )
    out = []
    for i, (y, g) in enumerate(zip(ys, given, strict=True)):
        if g is None:
            if y.is_complex():
                raise TypeError(
                    message(
                        call,
                        f"grad_ys[{i}]",
                        "a tensor for a complex y",
                        "None",
                        "gradients of complex tensors must set grad_ys (there is no default)",
                    )
                )
            g = torch.ones_like(y)
        elif g.shape != y.shape:
            raise ValueError(
                message(
                    call,
                    f"grad_ys[{i}]",
                    f"shape {tuple(y.shape)} (that of ys[{i}])",
                    describe(g),
                    "pass a grad_y shaped like its y",
                )
            )
        elif g.dtype != y.dtype:
            raise TypeError(
                message(
                    call,
                    f"grad_ys[{i}]",
                    f"dtype {y.dtype} (that of ys[{i}], as TensorFlow requires)",
                    describe(g),
                    f"convert it with grad_ys[{i}].to(ys[{i}].dtype)",
                )
            )
        elif g.device != y.device:
            raise ValueError(
                message(
                    call,
                    f"grad_ys[{i}]",
                    f"a tensor on {y.device} (that of ys[{i}])",
                    f"a tensor on {g.device}",
                    f"move it with grad_ys[{i}].to(ys[{i}].device)",
                )
            )
        out.append(g)
    return out


def _check_xs(x_list: list[torch.Tensor], call: str) -> None:
    """Floating-point xs must require grad: a gradient w.r.t. a tensor autograd does not track
    cannot be computed (it is not 'unconnected': the graph never recorded it)."""
    for i, x in enumerate(x_list):
        if (x.is_floating_point() or x.is_complex()) and not x.requires_grad:
            raise ValueError(
                message(
                    call,
                    f"xs[{i}]",
                    "a tensor that requires grad (autograd records nothing about the others)",
                    f"{describe(x)} with requires_grad=False",
                    "call x.requires_grad_() before computing ys from x, or leave it out of xs",
                )
            )


@contextlib.contextmanager
def _freed_graph(call: str) -> Iterator[None]:
    """Word autograd's error about a graph freed by an earlier backward."""
    try:
        yield
    except RuntimeError as err:
        if "backward through the graph a second time" not in str(err):
            raise
        raise GradkitError(
            f"{call}: the graph of ys was freed by an earlier backward (.backward() or a call "
            "with retain_graph=False); recompute ys, or keep the graph with retain_graph=True "
            "(the default of gradients) in the earlier call"
        ) from err


def gradients(
    ys: torch.Tensor | Sequence[torch.Tensor],
    xs: torch.Tensor | Sequence[torch.Tensor],
    grad_ys: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    *,
    stop_gradients: torch.Tensor | Sequence[torch.Tensor] | None = None,
    unconnected_gradients: str = "none",
    aggregation_method: Any = None,
    create_graph: bool = False,
    retain_graph: bool = True,
) -> list[torch.Tensor]:
    r"""Derivatives of the sum of ``ys`` with respect to ``xs``, with TensorFlow's contract.

    .. math:: \text{out}_i = \frac{\partial}{\partial x_i} \sum_j \langle y_j, g_j \rangle,
              \quad g_j = \text{grad\_ys}[j] \text{ (ones by default)}

    Args:
        ys: a tensor or a list of tensors of an already-built graph.
        xs: a tensor or a list of tensors to differentiate with respect to (leaves or
            intermediate results).
        grad_ys: one weight per ``y`` (same shape); ``None`` entries mean ``ones_like(y)``.
            Complex ``ys`` need one.
        stop_gradients: tensors treated as constants: gradient reaches them (and is reported if
            they are in ``xs``) but does not flow to what they were computed from. Stopping one
            output of a multi-output operation stops all of its outputs, as in TensorFlow.
        unconnected_gradients: ``"none"`` returns ``None`` for an ``x`` no ``y`` depends on,
            ``"zero"`` returns ``zeros_like(x)``. Integer-valued paths carry no gradient.
        aggregation_method: accepted for compatibility (:class:`AggregationMethod`); values are
            the same for every method.
        create_graph: build the graph of the result, for higher derivatives.
        retain_graph: keep the graph of ``ys`` (default True, like a TensorFlow graph).

    Returns:
        A list with one entry per ``x`` (same shape as ``x``), ``None`` or zeros where
        unconnected. A sparse gradient (``nn.Embedding(sparse=True)``) comes back as a coalesced
        sparse COO tensor (duplicate rows summed). Annotated ``list[Tensor]``, as
        ``torch.autograd.grad`` annotates its result, so that ``(g,) = gradients(y, x)``
        type-checks: the ``None`` of an unconnected ``x`` is not in the annotation (pass
        ``unconnected_gradients="zero"`` to never get one).

    Raises:
        ValueError: a floating-point ``x`` that does not require grad (autograd recorded
            nothing about it), or ``grad_ys`` of the wrong shape, count or device.
        TypeError: ``grad_ys`` of another dtype than their ``ys`` (as TensorFlow).
        GradkitError: the graph of ``ys`` was freed by an earlier backward.

    Examples:
        TensorFlow's documented example: partial vs total derivatives.

        >>> import torch
        >>> from gradkit.func import gradients
        >>> a = torch.tensor(0.0, requires_grad=True)
        >>> b = 2 * a
        >>> gradients(a + b, [a, b], stop_gradients=[a, b])
        [tensor(1.), tensor(1.)]
        >>> gradients(a + b, [a, b])
        [tensor(3.), tensor(1.)]
        >>> c = torch.tensor(1.0, requires_grad=True)
        >>> gradients(a + b, [c]), gradients(a + b, [c], unconnected_gradients="zero")
        ([None], [tensor(0.)])

    Warning:
        The stop hooks live on the shared graph while the call runs: a concurrent backward
        through the same graph (another thread) would see them.
    """
    call = "gradients(ys, xs)"
    check_choice(unconnected_gradients, ("none", "zero"), call, "unconnected_gradients")
    _check_aggregation(aggregation_method, call)
    check_bool(create_graph, call, "create_graph")
    check_bool(retain_graph, call, "retain_graph")
    return _gradients(
        ys,
        xs,
        grad_ys,
        stop_gradients=stop_gradients,
        unconnected_gradients=unconnected_gradients,
        create_graph=create_graph,
        retain_graph=retain_graph,
        call=call,
    )


def _gradients(
    ys: torch.Tensor | Sequence[torch.Tensor],
    xs: torch.Tensor | Sequence[torch.Tensor],
    grad_ys: torch.Tensor | Sequence[torch.Tensor | None] | None,
    *,
    stop_gradients: torch.Tensor | Sequence[torch.Tensor] | None,
    unconnected_gradients: str,
    create_graph: bool,
    retain_graph: bool,
    call: str,
) -> list[torch.Tensor]:
    """:func:`gradients` with its options checked, its errors naming ``call``."""
    y_list, _ = as_tensor_list(ys, call, "ys")
    x_list, _ = as_tensor_list(xs, call, "xs")
    _check_xs(x_list, call)
    g_list = _default_grad_ys(y_list, grad_ys, call)
    stop_list: list[torch.Tensor] = []
    if stop_gradients is not None:
        stop_list, _ = as_tensor_list(stop_gradients, call, "stop_gradients")

    # Integer-valued ys and ys outside the graph contribute nothing (TF: integers are constant).
    pairs = [
        (y, g)
        for y, g in zip(y_list, g_list, strict=True)
        if y.requires_grad and (y.is_floating_point() or y.is_complex())
    ]
    stop_nodes = {s.grad_fn for s in stop_list if s.grad_fn is not None}
    reached, seen = _reached_edges([y for y, _ in pairs], stop_nodes)
    x_edges = [_edge(x) if (x.is_floating_point() or x.is_complex()) else None for x in x_list]
    wanted = [i for i, e in enumerate(x_edges) if e is not None and e in reached]

    results: list[torch.Tensor | None] = [None] * len(x_list)
    if wanted:
        with _stopped(stop_nodes, seen), _freed_graph(call):
            grads = torch.autograd.grad(
                [y for y, _ in pairs],
                [x_list[i] for i in wanted],
                grad_outputs=[g for _, g in pairs],
                retain_graph=retain_graph or create_graph,
                create_graph=create_graph,
                allow_unused=True,
            )
        for i, g in zip(wanted, grads, strict=True):
            results[i] = g.coalesce() if g is not None and g.is_sparse else g
    if unconnected_gradients == "zero":
        results = [
            torch.zeros_like(x) if r is None else r for x, r in zip(x_list, results, strict=True)
        ]
    # None entries (unconnected xs) are not in the annotation, as in torch.autograd.grad's
    return cast(list[torch.Tensor], results)


def _flat_hessian_rows(
    g: torch.Tensor, x: torch.Tensor, chunk_size: int | None, create_graph: bool
) -> torch.Tensor:
    """Rows ``d g[k] / d x`` for every element k of ``g`` (a gradient of x), as [n, *x.shape]."""
    n = g.numel()
    eye = torch.eye(n, dtype=g.dtype, device=g.device).view(n, *g.shape)
    step = n if chunk_size is None else max(1, chunk_size)
    rows = []

    def row(b: torch.Tensor) -> torch.Tensor:  # None where x is unused, as above
        (res,) = torch.autograd.grad(
            g, x, b, retain_graph=True, create_graph=create_graph, allow_unused=True
        )
        return res

    for start in range(0, n, step):
        basis = eye[start : start + step]
        try:
            (r,) = torch.autograd.grad(
                g,
                x,
                basis,
                retain_graph=True,
                create_graph=create_graph,
                allow_unused=True,
                is_grads_batched=True,
            )
        except RuntimeError as err:  # no batching rule: loop, like TF without pfor
            parts = [unbatched_retry(err, functools.partial(row, basis[0]))]
            parts += [row(b) for b in basis[1:]]
            r = None if parts[0] is None else torch.stack(parts)
        rows.append(torch.zeros_like(basis) if r is None else r)
    return torch.cat(rows)


def hessians(
    ys: torch.Tensor | Sequence[torch.Tensor],
    xs: torch.Tensor | Sequence[torch.Tensor],
    *,
    unconnected_gradients: str = "none",
    aggregation_method: Any = None,
    chunk_size: int | None = None,
    create_graph: bool = False,
) -> list[torch.Tensor]:
    r"""Hessian of ``sum(ys)`` with respect to each ``x``, TensorFlow's ``tf.hessians``.

    .. math:: H_i = \frac{\partial^2 \sum_j \text{sum}(y_j)}{\partial x_i \, \partial x_i}

    Only the diagonal block of each ``x`` with itself is returned (no cross terms), as in
    TensorFlow. Any rank is accepted: the block of an ``x`` of shape ``S`` has shape ``S + S``.

    Args:
        ys: a tensor or list of tensors of an already-built graph (summed).
        xs: tensors to differentiate with respect to.
        unconnected_gradients: ``"none"`` or ``"zero"``, as in :func:`gradients`.
        aggregation_method: accepted for compatibility.
        chunk_size: how many Hessian rows to compute per vectorized backward (memory knob).
        create_graph: build the graph of the result.

    Returns:
        One tensor of shape ``x.shape + x.shape`` per ``x`` (``None`` or zeros if unconnected;
        annotated ``list[Tensor]`` as :func:`gradients`). A function whose second derivative is
        identically zero gives zeros.

    Examples:
        >>> import torch
        >>> from gradkit.func import hessians
        >>> x = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
        >>> (h,) = hessians((x**3).sum(), x)
        >>> h.shape
        torch.Size([1, 3, 1, 3])
        >>> h.reshape(3, 3)
        tensor([[ 6.,  0.,  0.],
                [ 0., 12.,  0.],
                [ 0.,  0., 18.]])
    """
    call = "hessians(ys, xs)"
    check_choice(unconnected_gradients, ("none", "zero"), call, "unconnected_gradients")
    _check_aggregation(aggregation_method, call)
    chunk_size = check_optional_int(chunk_size, call, "chunk_size")
    check_bool(create_graph, call, "create_graph")
    x_list, _ = as_tensor_list(xs, call, "xs")
    _check_xs(x_list, call)
    firsts: list[torch.Tensor | None] = list(
        _gradients(
            ys,
            x_list,
            None,
            stop_gradients=None,
            unconnected_gradients="none",
            create_graph=True,
            retain_graph=True,
            call=call,
        )
    )
    roots = [ys] if isinstance(ys, torch.Tensor) else [y for y in ys if isinstance(y, torch.Tensor)]
    refuse_second_order(roots, firsts, call=call)
    out: list[torch.Tensor | None] = []
    for x, g in zip(x_list, firsts, strict=True):
        if g is None:
            out.append(
                torch.zeros((*x.shape, *x.shape), dtype=x.dtype, device=x.device)
                if unconnected_gradients == "zero"
                else None
            )
        elif not g.requires_grad:  # second derivative identically zero
            out.append(torch.zeros((*x.shape, *x.shape), dtype=x.dtype, device=x.device))
        else:
            with _freed_graph(call):
                rows = _flat_hessian_rows(g, x, chunk_size, create_graph)
            out.append(rows.reshape((*x.shape, *x.shape)))
    # None entries (unconnected xs) are not in the annotation, as in torch.autograd.grad's
    return cast(list[torch.Tensor], out)

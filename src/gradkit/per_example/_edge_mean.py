"""The mean gradient read at the edges into a parameter: one use's state machine.

The sum of a module's individual gradients w.r.t. a parameter (what the statistics call the
mean) is exactly what autograd sends along the graph edges into that parameter. Reading it
there costs nothing and leaves out every term the loss adds outside the module (a weight-decay
term, say). It can be read there only if this backward executes those edges and the
parameter's gradient accumulator; otherwise (``torch.autograd.grad`` on part of the graph, a
retained graph whose references were dropped) the rule's per-example gradients give the sum.

Each use of a tracked module (one forward call) holds one :class:`EdgeMean`. Per parameter it
is in one of three states, and the edge hook and the tracker move it:

============  ==========================================  ==============================
state          edge sum arriving (:meth:`on_edge`)          set by
============  ==========================================  ==============================
undecided      kept in a buffer (the rule has not run)      construction
edges          added to the statistics at once              :meth:`settle` with ``True``
rule           dropped (the rule's output gives the sum)    :meth:`settle` with ``False``,
                                                            :meth:`release`
============  ==========================================  ==============================

:meth:`settle` is called once per parameter when the module's uses are processed, with the
same answer for all uses of the module (all read at the edges, or none) and returns the
buffered sum to add. Edge hooks fire in the engine's order, so a sum may arrive before the
module is processed (a module used several times, waiting for all its uses) or after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from gradkit.per_example._flat import leaves as flat_leaves

__all__ = ["EdgeMean", "param_edges", "will_execute"]


def will_execute(node: Node) -> bool:
    """Whether the running backward pass will execute ``node`` (True outside one, or on a
    torch without the query). Raises ``RuntimeError`` inside ``torch.autograd.grad`` for a
    leaf's accumulator."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    return True if check is None else bool(check(node))


class EdgeMean:
    """The edges into the tracked parameters of one module call, and per parameter whether
    the sum of its individual gradients is read there (see the module docstring).

    Args:
        edges: ``id(parameter) -> [(node, k)]``: the nodes whose k-th input is the parameter.
        leaves: ``id(parameter) ->`` its gradient accumulator node. Without edges (the mean
            is not asked), every sum comes from the rule.
    """

    def __init__(
        self,
        edges: dict[int, list[tuple[Node, int]]] | None = None,
        leaves: dict[int, Node] | None = None,
    ) -> None:
        self.edges = edges or {}
        self.leaves = leaves or {}
        self._buffered: dict[int, torch.Tensor] = {}
        self._from_edges: dict[int, bool] = {}  # absent: undecided

    @classmethod
    def find(
        cls,
        params: Mapping[int, torch.Tensor],
        inputs: Any,
        outputs: Sequence[torch.Tensor],
    ) -> EdgeMean:
        """The edges into ``params`` (``id -> parameter``) of the graph a module call just
        built from ``inputs`` to ``outputs`` (not below the inputs' own graph)."""
        stops = {
            a.grad_fn
            for a in flat_leaves(inputs)
            if isinstance(a, torch.Tensor) and a.grad_fn is not None
        }
        edges, leaves = param_edges([t.grad_fn for t in outputs], stops, params)
        return cls(edges, leaves)

    def casts(self) -> bool:
        """Whether an edge into a parameter is a cast (``weight.float()``, ``weight.to(x)``):
        autograd's sum there is computed in the cast's dtype and device."""
        return any(type(node).__name__ == "ToCopyBackward0" for es in self.edges.values()
                   for node, _ in es)  # fmt: skip

    def by_node(self) -> dict[Node, list[tuple[int, int]]]:
        """``node -> [(k, id(parameter))]``: where to hook, and which inputs to read."""
        out: dict[Node, list[tuple[int, int]]] = {}
        for pid, es in self.edges.items():
            for node, k in es:
                out.setdefault(node, []).append((k, pid))
        return out

    def on_edge(self, pid: int, grad: torch.Tensor, scale: float) -> torch.Tensor | None:
        """An edge's gradient into ``pid`` arrived: the sum to add to the statistics now,
        with weight ``scale``, or ``None`` (kept, scaled, until :meth:`settle`, or dropped)."""
        decided = self._from_edges.get(pid)
        if decided is False:
            return None
        if grad.requires_grad:  # create_graph
            grad = grad.detach()
        if grad.is_sparse:  # Embedding(sparse=True)
            grad = grad.to_dense()
        if decided:
            return grad
        grad = grad * scale
        prev = self._buffered.get(pid)
        self._buffered[pid] = grad if prev is None else prev + grad
        return None

    def readable(self, pid: int) -> bool:
        """Whether this backward executes every edge into ``pid`` and its accumulator, so
        the sum can be read there."""
        if pid not in self.edges or pid not in self.leaves:
            return False
        try:
            return will_execute(self.leaves[pid]) and all(
                will_execute(node) for node, _ in self.edges[pid]
            )
        except RuntimeError:  # inside torch.autograd.grad: leaves cannot be asked
            return False

    def settle(self, pid: int, from_edges: bool) -> torch.Tensor | None:
        """Decide for ``pid``; returns the sum buffered so far when it is read at the edges."""
        self._from_edges[pid] = from_edges
        buffered = self._buffered.pop(pid, None)
        return buffered if from_edges else None

    def undecide(self) -> None:
        """Start a new pass through the same graph (one kept for a later pass, see the tracker):
        every parameter undecided again, nothing buffered."""
        self._buffered, self._from_edges = {}, {}

    def release(self) -> None:
        """Forget the graph (its backward is over): later sums come from the rule."""
        self.edges, self.leaves, self._buffered = {}, {}, {}
        self._from_edges = dict.fromkeys(self._from_edges, False)


def param_edges(
    roots: Sequence[Node | None], stops: set[Node], params: Mapping[int, torch.Tensor]
) -> tuple[dict[int, list[tuple[Node, int]]], dict[int, Node]]:
    """Edges ``(node, k)`` of the graph below ``roots`` whose k-th input is the gradient
    accumulator of one of ``params`` (``id -> parameter``, leaves), not descending past
    ``stops`` (the graph that existed before the module's forward); and those accumulators.
    An accumulator is recognized by its ``variable`` (no ``get_gradient_edge`` per parameter,
    which builds a view each time)."""
    found: dict[int, list[tuple[Node, int]]] = {}
    leaves: dict[int, Node] = {}
    seen: set[Node] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is not None and params.get(id(variable)) is variable:
                pid = id(variable)
                found.setdefault(pid, []).append((node, k))
                leaves[pid] = nxt
            else:
                stack.append(nxt)
    return found, leaves

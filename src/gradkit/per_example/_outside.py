"""Refuse a tracked parameter that the examples' computation also uses outside its layer's
calls (``F.linear(h, self.fc.weight)``, ``h @ self.embed.weight.T`` with ``fc``/``embed``
tracked): the statistics are built from the layer's calls, so that use would be silently left
out of every example's gradient.

A call of the layers checked here (:data:`CHECKED`) takes each of its parameters through
exactly one graph edge into the parameter's accumulator. At the start of a backward pass one
walk of its graph counts those edges; a parameter with more edges than its layer has calls in
the pass is used elsewhere too. Such a use is harmless when it does not involve the examples,
as weight decay added to the loss: the statistics are those of the per-example losses through
the layers, by definition. So each edge is followed up through the nodes that do not depend on
any tracked layer's output (the parameter-only part of the graph) to the first nodes that do;
the edge is a use on the examples when one of those has an output with a dimension (a scalar
loss that a regularizer is added to has none). More such edges than calls raise.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn
from torch.autograd.graph import Node

from gradkit._autograd import edges_into
from gradkit._errors import GradkitError, message

__all__ = [
    "CHECKED",
    "check_outside_uses",
    "check_uncalled",
    "check_uses_outside_calls",
    "checked_module",
]

CHECKED: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Embedding,
    nn.LayerNorm,
    nn.GroupNorm,
)
"""Layers whose calls take each of their parameters through one graph edge."""


def checked_module(module: nn.Module) -> bool:
    """Whether ``module``'s calls take each own parameter through one graph edge (the layers
    of :data:`CHECKED`, and Hugging Face's ``Conv1D``), its parameters being its own tensors
    (no parametrization)."""
    if not isinstance(module, CHECKED) and type(module).__name__ != "Conv1D":
        return False
    return all(
        getattr(module, name, None) is p for name, p in module._parameters.items() if p is not None
    )


def _maps(roots: Sequence[Node], calls: set[Node]) -> tuple[dict[Node, list[Node]], set[Node]]:
    """Each node's parents, and the nodes that depend on a tracked call's output (``calls``)."""
    parents: dict[Node, list[Node]] = {}
    depends: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:  # depth first, each node settled after its children (the graph is acyclic)
        node, children_done = stack.pop()
        if node in depends:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        if children_done:
            depends[node] = node in calls or any(depends[n] for n in nexts)
            continue
        stack.append((node, True))
        for n in nexts:
            parents.setdefault(n, []).append(node)
            if n not in depends:
                stack.append((n, False))
    return parents, {node for node, d in depends.items() if d}


def _reached_uses(
    parents: Mapping[Node, list[Node]], depends: set[Node], sources: list[Node]
) -> set[Node]:
    """The nodes that depend on a tracked call's output, with an output with a dimension, that
    the edges from ``sources`` reach through nodes that depend on none."""
    uses: set[Node] = set()
    todo, seen = list(sources), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in depends:
            if _has_dimension(node):
                uses.add(node)
        else:
            todo.extend(parents.get(node, []))
    return uses


def _on_examples(
    parents: Mapping[Node, list[Node]], depends: set[Node], sources: list[Node]
) -> int:
    """How many of the edges from ``sources`` reach a node that depends on a tracked call's
    output and has an output with a dimension, through nodes that depend on none."""
    return sum(1 for source in sources if _reached_uses(parents, depends, [source]))


def _uses_on_examples(
    parents: Mapping[Node, list[Node]], depends: set[Node], sources: list[Node]
) -> int:
    """How many distinct such nodes the edges from ``sources`` reach together: the uses of the
    parameter, where one of its parameter-only nodes (a layer's ``weight.t()``) feeds several
    of them. The graph of a gradient built with ``create_graph`` does that: a Linear's input
    gradient ``G W`` reuses the forward's own ``W.t()``."""
    return len(_reached_uses(parents, depends, sources))


def _has_dimension(node: Node) -> bool:
    """Whether an output of ``node`` (in the forward) has at least one dimension."""
    metadata: Any = getattr(node, "_input_metadata", ())
    try:
        return any(len(m.shape) > 0 for m in metadata)
    except (AttributeError, RuntimeError, TypeError):
        return True  # unknown: count it as a use on the examples


def _listed(names: list[str]) -> str:
    """The first three of ``names``, sorted and quoted, and how many more."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(repr(n) for n in sorted(names)[:3]) + more


def check_uncalled(
    roots: Sequence[Any],
    uncalled: Mapping[int, int],
    names: Mapping[int, str],
    calls: set[Node],
    found: Mapping[int, list[Node]],
) -> None:
    """Raise when a parameter whose module has no call in this pass (``uncalled``: ids, any
    layer: a ``ParameterList``'s entries, a module whose forward is bypassed) is used on the
    examples: its per-example gradients, made from its module's calls, would all be 0. A use
    apart from the examples (weight decay added to the loss) is not one, as for the checked
    layers (see the module docstring). ``roots``, ``calls`` and ``found``: as for
    :func:`check_outside_uses`."""
    if not uncalled or not roots:
        return
    parents, depends = _maps(roots, calls)
    used = [names[pid] for pid in uncalled if _on_examples(parents, depends, found[pid])]
    if used:
        listed = _listed(used)
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                "model",
                "tracked parameters used on the examples through calls of their own module "
                "(per-example gradients are made from those calls)",
                f"{listed} used on the examples while their module was not called in this "
                "pass (a module that holds parameters for another to read, as ParameterList "
                "and ParameterDict do, or one whose forward is run as module.forward(x), "
                "which skips its hooks): every example's gradient would be 0",
                "call the module itself (module(x)), keep such parameters as attributes of "
                "the module that uses them (its calls are then tracked with its forward), or "
                "freeze them (requires_grad_(False)) to track the rest",
            )
        )


def check_uses_outside_calls(
    roots: Sequence[Any],
    records: Sequence[Any],
    names: Mapping[int, str],
    left_out: Collection[int],
    calls: set[Node],
    found: Mapping[int, list[Node]],
) -> None:
    """Raise when a parameter of ``names`` (ids: the vmap fallback's, a user's rule's, whose
    calls may take it through several edges) is used on the examples outside the calls of its
    module in this pass (``records``): the edges into its accumulator that no call's own graph
    holds (from its outputs back to its inputs). Its per-example gradients, made from the
    calls, would leave that use out (a PReLU's weight also read as ``h * act.weight``: the mean
    0.88 off). A use apart from the examples (weight decay) is not one, as in
    :func:`check_outside_uses`."""
    inside: dict[int, set[Node]] = {}
    for record in records:
        pids = {pid for pid in record.pids if pid in names and pid in found}
        if not pids or not record.nodes:
            continue
        pids -= set(left_out)
        for pid in pids:
            inside.setdefault(pid, set())
        # the call's own edges: from its outputs back to its inputs
        for pid, edges in edges_into(record.nodes, pids, stop=set(record.inputs)).items():
            inside[pid].update(edges)
    outside = {
        pid: [node for node in found[pid] if node not in edges] for pid, edges in inside.items()
    }
    outside = {pid: nodes for pid, nodes in outside.items() if nodes}
    if not outside:
        return
    parents, depends = _maps(roots, calls)
    used = [names[pid] for pid, nodes in outside.items() if _on_examples(parents, depends, nodes)]
    if used:
        listed = _listed(used)
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                "model",
                "tracked parameters used on the examples only inside their module's calls",
                f"{listed} used on the examples outside their module's calls too (read "
                "directly by another module, as h * layer.weight): their per-example "
                "gradients, made from the calls, would leave that use out",
                "call the module for that use too, move the use into the module's forward, or "
                "freeze them (requires_grad_(False)) to track the rest",
            )
        )


def check_outside_uses(
    roots: Sequence[Any],
    expected: Mapping[int, int],
    names: Mapping[int, str],
    calls: set[Node],
    found: Mapping[int, list[Node]],
    *,
    shared: bool = False,
) -> None:
    """Raise when a checked parameter (``expected``: ``id -> calls of its layers in this
    pass``) has more graph edges on the examples than calls (see the module docstring);
    ``roots``: the pass's root nodes, ``calls``: the tracked calls' output nodes, ``found``:
    :func:`gradkit._autograd.edges_into` of the roots (any superset of ``names``' ids).
    ``shared``: the graph may hold a gradient's graph (an earlier pass ran with
    ``create_graph``), which uses a parameter through its layer's own nodes, not through an
    edge of its own: every parameter's uses are counted past its parameter-only nodes."""
    if not expected or not roots:
        return
    if shared:
        over = [pid for pid in expected if pid in found]
    else:
        over = [pid for pid, calls_of in expected.items() if len(found.get(pid, ())) > calls_of]
    if not over:
        return
    parents, depends = _maps(roots, calls)
    count = _uses_on_examples if shared else _on_examples
    outside = [names[pid] for pid in over if count(parents, depends, found[pid]) > expected[pid]]
    if outside:
        listed = ", ".join(repr(n) for n in sorted(outside))
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                "model",
                "tracked layers' parameters used on the examples only through the layers' own "
                "calls",
                f"{listed} used on the examples outside their layer's calls too (e.g. read "
                "directly, as F.linear(h, layer.weight), or in the graph of a gradient taken "
                "with create_graph=True, as a gradient penalty differentiates it): their "
                "per-example gradients would leave that use out",
                "call the layer instead, tie the weight to a second module (tracked as a "
                "shared parameter), or freeze them (requires_grad_(False)) to track the rest; "
                "the per-example gradients of a loss with a gradient penalty are not "
                "computed: track steps without the penalty",
            )
        )

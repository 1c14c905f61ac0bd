"""The generic rule for modules without one: ``vmap`` over examples of a vector-Jacobian
product of the module's forward w.r.t. its own parameters (``torch.func.functional_call``).

Exact for any module that treats examples independently and whose forward is deterministic
(the forward is recomputed per example; dropout inside such a module is refused by ``vmap``).
Modules with several outputs (an RNN's output and state) get the gradients of all of them;
where an operation has no batching rule (torch's RNN kernels), examples are looped over. A
module without a rule is differentiated with its whole subtree (MultiheadAttention uses its
``out_proj`` parameters without calling ``out_proj``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from gradkit._errors import GradkitError
from gradkit.per_example._grads import Materialized, PerExampleGrad
from gradkit.per_example._registry import RuleContext, Use

logger = logging.getLogger(__name__)


def _batch_dim(t: Any, n: int) -> int | None:
    """The dimension of ``t`` that runs over the ``n`` examples: 0 if it fits, else the first
    that does (an RNN's state ``[layers, N, H]``); None for non-tensors."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    if t.shape[0] == n:
        return 0
    return next((d for d in range(1, t.dim()) if t.shape[d] == n), None)


def _loop(
    one: Any,
    inputs: tuple[Any, ...],
    grad_output: Any,
    in_dims: tuple[Any, ...],
    g_dims: Any,
    n: int,
) -> tuple[torch.Tensor, ...]:
    """``one`` applied to each example in turn (what ``vmap`` would do), stacked."""
    rows = []
    for i in range(n):
        args = tuple(
            a.select(d, i) if d is not None else a for a, d in zip(inputs, in_dims, strict=True)
        )
        g = tree_map(lambda leaf, d, i=i: leaf.select(d, i), grad_output, g_dims)
        rows.append(one(args, g))
    return tuple(torch.stack(parts) for parts in zip(*rows, strict=True))


def vmap_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of any example-independent module, by vmap (see module doc)."""
    names = list(ctx.params)
    params = tuple(ctx.params[k].detach() for k in names)
    first = tree_flatten(uses[0].grad_output)[0]
    n = next(t for t in first if isinstance(t, torch.Tensor)).shape[0]
    totals: list[torch.Tensor] | None = None
    for u in uses:
        in_dims = tuple(_batch_dim(a, n) for a in u.inputs)
        g_dims = tree_map(lambda leaf: _batch_dim(leaf, n), u.grad_output)
        if any(d is None for d in tree_flatten(g_dims)[0]):
            raise GradkitError(
                f"per_example.track: an output of {type(module).__name__} has no dimension of "
                f"the batch size {n}, so its gradient cannot be split by example"
            )

        def one(
            args: tuple[Any, ...],
            g: Any,
            kwargs: dict[str, Any] = u.kwargs,
            dims: tuple[Any, ...] = in_dims,
            gd: Any = g_dims,
        ) -> tuple[torch.Tensor, ...]:
            batched = tuple(
                a.unsqueeze(d) if d is not None else a for a, d in zip(args, dims, strict=True)
            )

            def forward(*ps: torch.Tensor) -> Any:
                return torch.func.functional_call(
                    module, dict(zip(names, ps, strict=True)), batched, kwargs
                )

            _, vjp_fn = torch.func.vjp(forward, *params)[:2]
            cotangent = tree_map(lambda leaf, d: leaf.unsqueeze(d), g, gd)
            return tuple(vjp_fn(cotangent))

        try:
            grads = torch.func.vmap(one, in_dims=(in_dims, g_dims))(u.inputs, u.grad_output)
        except RuntimeError as err:
            if "random" in str(err).lower():
                raise GradkitError(
                    f"per_example.track: the vmap fallback cannot re-run {type(module).__name__}"
                    f" example by example: its forward is random ({err}); put it in eval mode "
                    "or register a rule with @gradkit.per_example.register_rule"
                ) from err
            # some operations have no batching rule (torch's RNN kernels): one example at a time
            logger.debug(
                "vmap fallback on %s failed (%s); looping over examples", type(module).__name__, err
            )
            grads = _loop(one, u.inputs, u.grad_output, in_dims, g_dims, n)
        totals = (
            list(grads) if totals is None else [t + g for t, g in zip(totals, grads, strict=True)]
        )
    assert totals is not None
    return {k: Materialized(t) for k, t in zip(names, totals, strict=True)}

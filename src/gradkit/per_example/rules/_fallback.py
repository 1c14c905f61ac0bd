"""The generic rule for modules without one: ``vmap`` over examples of a vector-Jacobian
product of the module's forward w.r.t. its own parameters (``torch.func.functional_call``).

Exact for any module that treats examples independently and whose forward is deterministic
(the forward is recomputed per example; dropout inside such a module is refused by ``vmap``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradkit._errors import GradkitError
from gradkit.per_example._grads import Materialized, PerExampleGrad
from gradkit.per_example._registry import RuleContext, Use


def vmap_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of any example-independent module, by vmap (see module doc)."""
    names = list(ctx.params)
    params = tuple(ctx.params[k].detach() for k in names)
    n = uses[0].grad_output.shape[0]
    totals: list[torch.Tensor] | None = None
    for u in uses:
        in_dims = tuple(
            0 if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n else None
            for a in u.inputs
        )

        def one(
            args: tuple[Any, ...],
            g: torch.Tensor,
            kwargs: dict[str, Any] = u.kwargs,
            dims: tuple[Any, ...] = in_dims,
        ) -> tuple[torch.Tensor, ...]:
            batched = tuple(
                a.unsqueeze(0) if d == 0 else a for a, d in zip(args, dims, strict=True)
            )

            def forward(*ps: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = torch.func.functional_call(
                    module, dict(zip(names, ps, strict=True)), batched, kwargs
                )
                return out

            _, vjp_fn = torch.func.vjp(forward, *params)[:2]
            return tuple(vjp_fn(g.unsqueeze(0)))

        try:
            grads = torch.func.vmap(one, in_dims=(in_dims, 0))(u.inputs, u.grad_output)
        except RuntimeError as err:
            raise GradkitError(
                f"per_example.track: the vmap fallback failed on {type(module).__name__} "
                f"({err}); it needs a module that treats examples independently with a "
                "deterministic forward: register a rule with "
                "@gradkit.per_example.register_rule"
            ) from err
        totals = (
            list(grads) if totals is None else [t + g for t, g in zip(totals, grads, strict=True)]
        )
    assert totals is not None
    return {k: Materialized(t) for k, t in zip(names, totals, strict=True)}

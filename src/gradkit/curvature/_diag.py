r"""Exact diagonals.

* GGN and Fisher: ``J^T M J`` with ``M_n = sum_c s_nc s_nc^T`` per example, so

  .. math:: \operatorname{diag}\Big(\sum_n J_n^\top M_n J_n\Big)
            = \sum_c \sum_n (J_n^\top s_{nc})^2,

  a sum of squared *per-example* gradients: backpropagating each column ``s_c`` as the output
  gradient under ``gradkit.per_example.track(model, "second_moment", loss_reduction="sum")``
  gives ``sum_n (J_n^T s_nc)^2`` exactly, in one backward per column (``C - 1`` for cross
  entropy with ``C`` classes). Negative columns (losses not convex in the output) go through a
  second tracker and are subtracted. Sequential MLPs take all columns in one sweep through
  their layers instead (:func:`~gradkit.curvature._mlp_diag.mlp_factor_diagonal`).
* Any operator (the Hessian): ``e_j^T C e_j`` from products with unit vectors, ``chunk``
  columns at a time, for up to ``max_size`` parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradkit._errors import GradkitError, message
from gradkit.curvature._data import Data
from gradkit.curvature._layout import Layout

__all__ = ["factor_diagonal", "unit_diagonal"]

Factors = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def unit_diagonal(
    product: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_size: int,
    call: str,
    chunk: int = 256,
) -> torch.Tensor:
    """``diag(C)`` from ``product(E)`` for ``chunk`` unit vectors ``E`` ``[n, chunk]`` at a
    time."""
    if n > max_size:
        raise GradkitError(
            message(
                call,
                "max_size",
                f"at least the number of parameters ({n}) for an exact diagonal by unit vectors",
                str(max_size),
                "raise max_size (it costs n products), or use method='hutch++' / 'hutchinson'",
            )
        )
    out = torch.empty(n, dtype=dtype, device=device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        E = torch.zeros(n, stop - start, dtype=dtype, device=device)
        rows = torch.arange(start, stop, device=device)
        E[rows, rows - start] = 1
        out[start:stop] = product(E)[start:stop].diagonal().to(dtype)
    return out


def _push(layout: Layout, out: torch.Tensor, cols: torch.Tensor) -> None:
    if not out.requires_grad:
        return
    for c in cols:
        torch.autograd.grad(out, layout.params, c, retain_graph=True, allow_unused=True)


def _read(layout: Layout, stats: Any) -> torch.Tensor:
    parts = []
    for name, p in zip(layout.names, layout.params, strict=True):
        if name in stats and stats[name].num_examples > 0:
            st = stats[name]
            parts.append((st.second_moment * st.num_examples).reshape(-1).to(torch.float64))
        else:
            parts.append(torch.zeros(p.numel(), dtype=torch.float64, device=p.device))
    return torch.cat(parts)


def check_rows(
    out: torch.Tensor,
    n: int,
    call: str,
    *,
    purpose: str = "for the exact diagonal from per-example gradients",
    other: str = ", or use method='hutchinson' or 'hutch++'",
) -> None:
    """Per-example gradients need each example's outputs in its own rows: a model output whose
    dimension 0 is not the batch's ``n`` examples (``[N * T, C]`` logits of ``[N, T]`` ids)
    would have the squares taken of sums over an example's tokens, cross terms included.
    ``purpose`` and ``other`` (another way out) word the refusal for the caller."""
    if out.dim() == 0 or out.shape[0] != n:
        rows = "no dimension 0" if out.dim() == 0 else f"{out.shape[0]} rows along dimension 0"
        raise GradkitError(
            message(
                call,
                "model",
                f"an output with the batch's {n} examples along dimension 0 (the inputs' "
                f"dimension 0), {purpose}",
                f"an output of shape {tuple(out.shape)}, {rows}",
                "return the outputs with the examples first ([N, T, C] logits, not flattened to "
                f"[N * T, C]) and flatten them in loss_fn{other}",
            )
        )


def factor_diagonal(data: Data, layout: Layout, factors: Factors, *, call: str) -> torch.Tensor:
    """The exact diagonal of ``sum_b w_b J_b^T M_b J_b`` over the parameters of ``layout``
    given ``factors(out, targets, index) -> (pos [C+, *out], neg [C-, *out])`` per batch (see
    the module docstring)."""
    from gradkit.curvature._mlp_diag import mlp_factor_diagonal, mlp_layers
    from gradkit.per_example import track

    layers = mlp_layers(data.model)
    if layers is not None:  # all columns in one sweep through the layers
        swept = mlp_factor_diagonal(data, layout, layers, factors)
        if swept is not None:
            return swept
    first = layout.params[0]
    total = torch.zeros(layout.n, dtype=torch.float64, device=first.device)
    for index, (inputs, targets, n) in enumerate(data):
        weight = data.weight(index, n, targets)
        if weight == 0:  # nothing of it counts (its own mean loss is nan)
            continue
        try:
            with torch.enable_grad():
                with track(data.model, "second_moment", loss_reduction="sum") as stats:
                    stats.repeat_passes = True  # one pass per column of the factor, summed
                    out = data.forward(inputs)
                    check_rows(out, n, call)
                    pos, neg = factors(out.detach(), targets, index)
                    _push(layout, out, pos)
                total += weight * _read(layout, stats)
                if neg.shape[0]:
                    with track(data.model, "second_moment", loss_reduction="sum") as stats:
                        stats.repeat_passes = True
                        _push(layout, data.forward(inputs), neg)
                    total -= weight * _read(layout, stats)
        except GradkitError as err:
            if str(err).startswith(call):
                raise
            raise GradkitError(
                f"{call}: per-example gradients are not available for this model ({err}); "
                "use method='hutchinson' or 'hutch++'"
            ) from err
    return total.to(first.dtype)

r"""The precondition of :func:`gradkit.func.batch_jacobian`: output row ``i`` depends on input
row ``i`` only.

Index legend: ``b`` example (row), ``o`` output element of one row (flat), ``n`` input element
of one row (flat).

``batch_jacobian`` computes ``B_i`` from products with the batch summed (reverse mode:
``B_i = sum_j J_ji`` for the cotangent ``e_o`` on every row; forward mode likewise), which equals
the diagonal block ``J_ii`` exactly when the cross blocks ``J_ji`` (``j != i``) vanish. With one
more vector-Jacobian product of a random cotangent ``c`` (all rows at once) the precondition is
checked in full:

.. math:: (c^\top J)_i = \sum_j c_j^\top J_{ji} \quad\text{vs}\quad c_i^\top B_i,

equal (up to rounding) for a row-wise function, different with probability 1 otherwise, whatever
rows are coupled. The difference, scaled by the largest entry, is compared with
``sqrt(eps)`` of the dtype: couplings smaller than that are not seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradkit._errors import GradkitError
from gradkit.func._common import is_transformed

__all__ = ["check_rows_independent"]


def check_rows_independent(
    vjp_fn: Callable[[torch.Tensor], Any],
    x: torch.Tensor,
    out: torch.Tensor,
    blocks: torch.Tensor,
    call: str,
) -> None:
    """Raise a :class:`GradkitError` naming ``call`` and the coupled rows of ``x`` unless the
    per-example Jacobians ``blocks`` ``[b, *O, *X]`` reproduce one full vector-Jacobian product.

    Skipped (nothing to check or nothing readable) for one row, complex or non-finite values,
    meta tensors, and inside ``torch.func`` transforms.
    """
    b = x.shape[0]
    if b < 2 or out.is_complex() or x.is_complex() or is_transformed(x) or is_transformed(out):
        return
    if x.device.type == "meta" or out.device.type == "meta":  # shapes only, no values to compare
        return
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(out.shape, generator=gen, dtype=out.dtype, device="cpu").to(out.device)
    (actual,) = vjp_fn(c)
    # f may change the dtype (x float32, out float64): compared in the wider one, within the
    # narrower one's precision
    wide = torch.promote_types(torch.promote_types(out.dtype, x.dtype), blocks.dtype)
    J = blocks.detach().reshape(b, out[0].numel(), x[0].numel()).to(wide)
    cf = c.reshape(b, -1).to(wide)
    predicted = torch.einsum("bo,bon->bn", cf, J)
    actual = actual.detach().reshape(b, -1).to(wide)
    bound = torch.einsum("bo,bon->bn", cf.abs(), J.abs())
    diff = (actual - predicted).abs().amax(1)
    parts = torch.stack([bound.max(), actual.abs().max(), predicted.abs().max(), diff.max()])
    values = parts.tolist()  # one synchronization
    *scales, worst = values
    scale = max(scales)
    if not all(map(math.isfinite, values)) or scale == 0.0:
        return
    tol = max(torch.finfo(out.dtype).eps, torch.finfo(x.dtype).eps) ** 0.5 * scale
    if worst <= tol:
        return
    rows = (diff > tol).nonzero().flatten().tolist()
    shown = ", ".join(str(r) for r in rows[:8]) + (", ..." if len(rows) > 8 else "")
    raise GradkitError(
        f"{call}: f: expected a function whose output row i depends on input row i only "
        "(batch_jacobian computes the blocks d f(x)[i] / d x[i] from products summed over the "
        "batch, exact only then), got outputs that depend on other rows: the gradient of a "
        f"random output weighting w.r.t. rows [{shown}] of x differs from the one the "
        f"per-example Jacobians give by up to {worst:.3g} (scale {scale:.3g}); "
        "functions that mix rows (x - x.mean(0), batch norm in training mode, softmax over "
        "dim 0, attention across the batch) need the full jacobian(f, x) (its diagonal blocks "
        "are J[i, :, i]); put batch norm in eval mode (model.eval()) if its batch statistics "
        "are not meant to be differentiated; check_independence=False skips this check (the "
        "blocks are then not those of the full Jacobian)"
    )

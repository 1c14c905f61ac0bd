"""What :class:`~gradkit.monitor.GradientMonitor` logs for one tracked step: the statistics of
the step's individual gradients reduced to a few numbers, for the whole model and per layer.

Definitions (``g_i`` the gradient of example ``i``, ``G`` their mean, ``Sigma`` their unbiased
covariance, over the ``N`` examples of the step, all ranks merged):

* ``grad_norm``: ``|G|``;
* ``noise_scale``: ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018);
* ``snr_median``: the median over the parameters' entries of ``G_j^2 / Sigma_jj`` (entries of
  zero variance left out);
* ``example_norm_q10`` / ``q50`` / ``q90``: quantiles of the per-example norms ``|g_i|``;
* ``cabs_batch_size``: ``lr tr(Sigma) / loss`` (Balles et al. 2017), when the learning rate
  and the step's loss are known.

Per layer (parameters grouped by their module's name): ``grad_norm``, ``noise_scale`` and
``snr_median`` over that layer's parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradkit.per_example import ParamStats, cabs_batch_size
from gradkit.per_example._derived import _ratio as ratio

__all__ = ["QUANTILES", "summarize"]

QUANTILES = (0.1, 0.5, 0.9)


def _layer(name: str) -> str:
    return name.rpartition(".")[0] or "(model)"


def _finite(x: float) -> float | None:
    """JSON has no inf/NaN: those become None (an undefined ratio, e.g. a zero mean)."""
    return x if math.isfinite(x) else None


def _reduce(params: Sequence[ParamStats]) -> dict[str, float | None]:
    """``grad_norm``, ``noise_scale`` and ``snr_median`` over ``params``."""
    trace = norm2 = 0.0
    ratios = []
    for s in params:
        var = s.var(unbiased=True).double()
        mean = s.mean.double()
        trace += float(var.sum())
        norm2 += float(mean.square().sum())
        ok = var > 0
        ratios.append((mean[ok].square() / var[ok]).reshape(-1))
    joined = torch.cat(ratios) if ratios else torch.zeros(0)
    return {
        "grad_norm": math.sqrt(norm2),
        "noise_scale": _finite(ratio(trace, norm2)),
        "snr_median": _finite(float(joined.median())) if joined.numel() else None,
    }


def summarize(
    stats: Mapping[str, ParamStats],
    step: int,
    *,
    norms: torch.Tensor | None,
    lr: float | None,
    loss: float | None,
    layers: bool,
) -> dict[str, Any]:
    """One step's record (plain numbers: ready for JSON, TensorBoard or a callable)."""
    params = list(stats.values())
    n = params[0].num_examples if params else 0
    record: dict[str, Any] = {"step": step, "examples": n}
    record.update(_reduce(params))
    if norms is not None and norms.numel():
        levels = torch.tensor(QUANTILES, dtype=torch.float64, device=norms.device)
        q = torch.quantile(norms.double().clamp_min(0).sqrt(), levels)
        for level, value in zip(QUANTILES, q.tolist(), strict=True):
            record[f"example_norm_q{round(level * 100)}"] = value
    if lr is not None and loss is not None and math.isfinite(loss) and loss > 0:
        record["cabs_batch_size"] = cabs_batch_size(stats, lr, loss)
    if loss is not None:
        record["loss"] = loss
    if layers:
        groups: dict[str, list[ParamStats]] = {}
        for name, s in stats.items():
            groups.setdefault(_layer(name), []).append(s)
        record["layers"] = {layer: _reduce(ps) for layer, ps in groups.items()}
    return record

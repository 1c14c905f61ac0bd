"""What :class:`~gradkit.monitor.GradientMonitor` logs for one tracked step: the statistics of
the step's individual gradients reduced to a few numbers, for the whole model and per layer.

Definitions (``g_i`` the gradient of example ``i``, ``G`` their mean, ``Sigma`` their unbiased
covariance, over the ``N`` examples of the step, all ranks merged):

* ``grad_norm``: ``|G|``;
* ``noise_scale``: ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018);
* ``snr_median``: the median over the parameters' entries of ``G_j^2 / Sigma_jj``, leaving
  out the entries whose ratio would be rounding noise: a variance below ``c E[g_j^2]`` (within
  the rounding of ``E[g^2] - G^2``) or gradients with ``E[g_j^2] < c^2 max_k E[g_k^2]`` over
  the parameter (at the rounding level of its largest entries), ``c = 256 eps`` of the dtype;
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

from gradkit.per_example import ParamStats
from gradkit.per_example._derived import _ratio as ratio

__all__ = ["QUANTILES", "summarize"]

QUANTILES = (0.1, 0.5, 0.9)
_ROUNDING = 256


def _layer(name: str) -> str:
    return name.rpartition(".")[0] or "(model)"


def _finite(x: float) -> float | None:
    """JSON has no inf/NaN: those become None (an undefined ratio, e.g. a zero mean)."""
    return x if math.isfinite(x) else None


def _trace(params: Sequence[ParamStats], scale: float) -> float:
    return sum(float(s.var(unbiased=True).double().sum()) for s in params) * scale**2


def _reduce(params: Sequence[ParamStats], scale: float) -> dict[str, float | None]:
    """``grad_norm``, ``noise_scale`` and ``snr_median`` over ``params`` (the individual
    gradients multiplied by ``scale``)."""
    trace = norm2 = 0.0
    ratios = []
    for s in params:
        var = s.var(unbiased=True).double() * scale**2
        mean = s.mean.double() * scale
        trace += float(var.sum())
        norm2 += float(mean.square().sum())
        # entries whose ratio would be rounding noise over rounding noise (off by orders of
        # magnitude between two exact computations): a variance within the rounding of
        # E[g^2] - E[g]^2, or gradients at the rounding level of the parameter's largest
        eps = _ROUNDING * torch.finfo(s.mean.dtype).eps
        second = s.second_moment.double()
        ok = (var > eps * second * scale**2) & (second > eps**2 * second.max())
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
    scale: float = 1.0,
) -> dict[str, Any]:
    """One step's record (plain numbers: ready for JSON, TensorBoard or a callable), the
    individual gradients taken times ``scale``."""
    params = list(stats.values())
    n = params[0].num_examples if params else 0
    record: dict[str, Any] = {"step": step, "examples": n}
    record.update(_reduce(params, scale))
    if norms is not None and norms.numel():
        levels = torch.tensor(QUANTILES, dtype=torch.float64, device=norms.device)
        q = torch.quantile(norms.double().clamp_min(0).sqrt() * scale, levels)
        for level, value in zip(QUANTILES, q.tolist(), strict=True):
            record[f"example_norm_q{round(level * 100)}"] = value
    if lr is not None and loss is not None and math.isfinite(loss) and loss > 0:
        # cabs_batch_size's rule (Balles et al.): lr tr(Sigma) / loss, rounded, at least 1
        record["cabs_batch_size"] = max(1, round(lr * _trace(params, scale) / loss))
    if loss is not None:
        record["loss"] = loss
    if layers:
        groups: dict[str, list[ParamStats]] = {}
        for name, s in stats.items():
            groups.setdefault(_layer(name), []).append(s)
        record["layers"] = {layer: _reduce(ps, scale) for layer, ps in groups.items()}
    return record

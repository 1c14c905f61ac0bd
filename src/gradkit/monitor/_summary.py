"""What :class:`~gradkit.monitor.GradientMonitor` logs for one tracked step: the statistics of
the step's individual gradients reduced to a few numbers, for the whole model and per layer.

Definitions (``g_i`` the gradient of example ``i``, ``G`` their mean, ``Sigma`` their unbiased
covariance, over the ``N`` examples of the step, all ranks merged):

* ``grad_norm``: ``|G|``;
* ``grad_variance``: ``tr(Sigma)``, the summed variance of the individual gradients;
* ``noise_scale``: ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018), ``|G|^2``
  estimated without bias as ``|mean|^2 - tr(Sigma) / N`` (``None`` when that is not positive:
  the step does not resolve the mean gradient from the noise);
* ``snr_median``: the median over the parameters' entries of ``G_j^2 / Sigma_jj``, leaving
  out the entries whose ratio would be rounding noise: a variance below ``c E[g_j^2]`` (within
  the rounding of ``E[g^2] - G^2``) or gradients with ``E[g_j^2] < c^2 max_k E[g_k^2]`` over
  the parameter (at the rounding level of its largest entries), ``c = 256 eps`` of the dtype;
* ``example_norm_q10`` / ``q50`` / ``q90``: quantiles of the per-example norms ``|g_i|``;
* ``cabs_batch_size``: ``lr tr(Sigma) / loss`` (Balles et al. 2017), when the learning rate
  and the step's loss are known.

Per layer (parameters grouped by their module's name): ``grad_norm``, ``grad_variance``,
``noise_scale`` and ``snr_median`` over that layer's parameters.

A step of one example (a last partial batch of 1) has no variance: ``grad_variance``,
``noise_scale``, ``snr_median`` and ``cabs_batch_size`` are then None (null), not an error that
would stop the training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradkit.per_example import ParamStats
from gradkit.per_example._derived import _ratio as ratio
from gradkit.per_example._derived import largest_second_moment, median, signal, snr_ratios

__all__ = ["QUANTILES", "summarize"]

QUANTILES = (0.1, 0.5, 0.9)


def _layer(name: str) -> str:
    return name.rpartition(".")[0] or "(model)"


def _finite(x: float) -> float | None:
    """JSON has no inf/NaN: those become None (an undefined ratio, e.g. a zero mean)."""
    return x if math.isfinite(x) else None


@dataclass
class _Parts:
    """One parameter's share of the sums: ``tr(Sigma)``, ``|mean|^2``, the unbiased estimate
    of ``|G|^2`` (see :func:`~gradkit.per_example._derived.signal`), all of the unscaled
    individual gradients, and the SNR ratios of its entries that are not rounding noise."""

    trace: float
    norm2: float
    signal: float
    ratios: torch.Tensor


def _parts(s: ParamStats, largest: torch.Tensor | float) -> _Parts:
    mean = s.mean
    norm2 = float(mean.square().sum(dtype=torch.float64))
    if s.num_examples < 2:  # one example: no variance (NaN, logged as null), no ratios
        return _Parts(math.nan, norm2, math.nan, mean.new_empty(0, dtype=torch.float64))
    var = float(s.var(unbiased=True).sum(dtype=torch.float64))
    return _Parts(var, norm2, signal(norm2, var, s.num_examples), snr_ratios(s, largest))


def _reduce(parts: Sequence[_Parts], scale: float) -> dict[str, float | None]:
    """``grad_norm``, ``noise_scale`` and ``snr_median`` over the parameters of ``parts``, the
    individual gradients multiplied by ``scale`` (the ratios do not depend on it)."""
    trace = sum(p.trace for p in parts) * scale**2
    norm2 = sum(p.norm2 for p in parts) * scale**2
    g2 = sum(p.signal for p in parts) * scale**2
    ratios = [p.ratios for p in parts if p.ratios.numel()]
    joined = torch.cat(ratios) if len(ratios) > 1 else (ratios[0] if ratios else None)
    return {
        "grad_norm": math.sqrt(norm2),
        "grad_variance": _finite(trace),
        "noise_scale": _finite(ratio(trace, g2)),
        "snr_median": None if joined is None else _finite(median(joined)),
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
    n = max((s.num_examples for s in params), default=0)  # as stats.num_examples
    largest = largest_second_moment(params)
    parts = {name: _parts(s, largest) for name, s in stats.items()}
    record: dict[str, Any] = {"step": step, "examples": n}
    record.update(_reduce(list(parts.values()), scale))
    if norms is not None and norms.numel():
        levels = torch.tensor(QUANTILES, dtype=torch.float64, device=norms.device)
        q = torch.quantile(norms.double().clamp_min(0).sqrt() * scale, levels)
        for level, value in zip(QUANTILES, q.tolist(), strict=True):
            record[f"example_norm_q{round(level * 100)}"] = value
    trace = sum(p.trace for p in parts.values()) * scale**2
    if lr is not None and loss is not None and math.isfinite(loss * trace) and loss > 0:
        # cabs_batch_size's rule (Balles et al.): lr tr(Sigma) / loss, rounded, at least 1
        record["cabs_batch_size"] = max(1, round(lr * trace / loss))
    if loss is not None:
        record["loss"] = loss
    if layers:
        groups: dict[str, list[_Parts]] = {}
        for name, part in parts.items():
            groups.setdefault(_layer(name), []).append(part)
        record["layers"] = {layer: _reduce(ps, scale) for layer, ps in groups.items()}
    return record

"""What users derive from the statistics: gradient noise scale, signal-to-noise ratio, the CABS
batch size, and the per-parameter summary table.

* Simple noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
  ``B_simple = tr(Sigma) / |G|^2`` with ``Sigma`` the covariance of the individual gradients
  (unbiased estimate) and ``G`` their mean. The batch size where the gradient noise and signal
  balance.
* Gradient signal-to-noise ratio (Liu et al. 2020): per entry ``mean^2 / variance``, averaged
  over the entries of a parameter.
* CABS (Balles et al. 2017, "Coupling Adaptive Batch Sizes with Learning Rates"):
  ``B = lr * tr(Sigma) / loss``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from gradkit._errors import message
from gradkit._validate import check_choice
from gradkit.per_example._stats import ParamStats

__all__ = ["cabs_batch_size", "gradient_snr", "noise_scale", "summary_table"]


def _select(stats: Mapping[str, ParamStats], names: Iterable[str] | None) -> list[ParamStats]:
    keys = list(stats) if names is None else list(names)
    return [stats[k] for k in keys]


def _trace_and_norm(
    stats: Mapping[str, ParamStats], names: Iterable[str] | None
) -> tuple[float, float]:
    tr = norm2 = 0.0
    for s in _select(stats, names):
        tr += float(s.var(unbiased=True).sum())
        norm2 += float(s.mean.double().square().sum())
    return tr, norm2


def noise_scale(stats: Mapping[str, ParamStats], names: Iterable[str] | None = None) -> float:
    """``B_simple = tr(Sigma) / |G|^2`` over the parameters ``names`` (default: all tracked).

    Needs ``"variance"`` tracked and at least two examples.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> model = nn.Linear(4, 1)
        >>> with gradkit.per_example.track(model, "variance") as stats:
        ...     nn.functional.mse_loss(model(torch.randn(64, 4)), torch.randn(64, 1)).backward()
        >>> gradkit.per_example.noise_scale(stats) > 0
        True
    """
    tr, norm2 = _trace_and_norm(stats, names)
    return tr / norm2 if norm2 > 0 else float("inf")


def gradient_snr(
    stats: Mapping[str, ParamStats], names: Iterable[str] | None = None, *, reduction: str = "mean"
) -> dict[str, float]:
    """Per parameter: ``mean^2 / variance`` per entry (unbiased variance; entries with zero
    variance are left out), reduced over entries by ``"mean"`` (Liu et al. 2020) or
    ``"median"`` (robust to a few entries of tiny variance)."""
    check_choice(reduction, ("mean", "median"), "gradient_snr(stats)", "reduction")
    out = {}
    for s in _select(stats, names):
        var = s.var(unbiased=True).double()
        ok = var > 0
        ratio = s.mean.double()[ok].square() / var[ok]
        if not ratio.numel():
            out[s.name] = float("inf")
        else:
            out[s.name] = float(ratio.mean() if reduction == "mean" else ratio.median())
    return out


def cabs_batch_size(
    stats: Mapping[str, ParamStats],
    lr: float,
    loss: float | torch.Tensor,
    *,
    min_size: int = 1,
    max_size: int | None = None,
    names: Iterable[str] | None = None,
) -> int:
    """The CABS batch size ``lr * tr(Sigma) / loss``, rounded and clipped to
    ``[min_size, max_size]`` (Balles et al. 2017)."""
    loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    if not loss_value > 0:
        raise ValueError(
            message(
                "cabs_batch_size(stats, lr, loss)",
                "loss",
                "a positive loss value",
                repr(loss_value),
                "CABS assumes a non-negative loss with minimum 0; pass the "
                "current (positive) training loss",
            )
        )
    tr, _ = _trace_and_norm(stats, names)
    size = round(lr * tr / loss_value)
    size = max(min_size, size)
    return size if max_size is None else min(size, max_size)


def summary_table(stats: Mapping[str, ParamStats]) -> str:
    """A plain-text per-parameter table: |mean|, tr(var), SNR, noise scale."""
    rows = [("parameter", "N", "|mean|", "tr(var)", "SNR", "noise scale")]
    for name in stats:
        s = stats[name]
        try:
            mean_norm = float(s.mean.double().norm())
            tr = float(s.var(unbiased=True).double().sum())
            snr = gradient_snr(stats, [name])[name]
            ns = tr / mean_norm**2 if mean_norm > 0 else float("inf")
            rows.append(
                (
                    name,
                    str(s.num_examples),
                    f"{mean_norm:.4g}",
                    f"{tr:.4g}",
                    f"{snr:.4g}",
                    f"{ns:.4g}",
                )
            )
        except Exception as err:  # quantity not tracked: show what is missing
            rows.append((name, str(s.num_examples), "-", "-", "-", type(err).__name__))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

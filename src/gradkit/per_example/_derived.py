"""What users derive from the statistics: gradient noise scale, signal-to-noise ratio, the CABS
batch size, and the per-parameter summary table.

* Simple noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
  ``B_simple = tr(Sigma) / |G|^2`` with ``Sigma`` the covariance of the individual gradients
  and ``G`` the expected gradient: the batch size where the gradient noise and signal balance.
  Both are estimated without bias from the ``N`` examples of one window (the paper's Appendix
  A with per-example gradients): ``tr(Sigma)`` by the unbiased variance, ``|G|^2`` by
  ``|mean|^2 - tr(Sigma) / N``. The plain ``|mean|^2`` overstates ``|G|^2`` by
  ``tr(Sigma) / N``, so its ratio reads back about ``N`` wherever ``B_simple`` is larger
  (measured: 16, 65 and 258 at N = 16, 64 and 256 for a true 4019).
* Gradient signal-to-noise ratio (Liu et al. 2020): per entry ``mean^2 / variance``, averaged
  over the entries of a parameter.
* CABS (Balles et al. 2017, "Coupling Adaptive Batch Sizes with Learning Rates"):
  ``B = lr * tr(Sigma) / loss``.

A parameter the loss never reached has a zero gradient for every example: it adds 0 to
``tr(Sigma)`` and to ``|G|^2``, and its own ratios are ``0 / 0``: ``nan`` (the summary table
marks it ``zero gradient``), as is the noise scale over parameters whose gradients are all 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import check_choice, check_int, check_number, check_optional_int, one_number
from gradkit.per_example._stats import ParamStats

__all__ = [
    "ROUNDING",
    "cabs_batch_size",
    "cabs_estimate",
    "ema",
    "gradient_snr",
    "median",
    "noise_parts",
    "noise_scale",
    "signal",
    "snr_ratios",
    "summary_table",
]


def _select(stats: Any, names: Any, call: str) -> list[ParamStats]:
    """The statistics of ``names`` (default: all), after checking both arguments."""
    if not isinstance(stats, Mapping) or not all(
        isinstance(stats[k], ParamStats) for k in list(stats)[:1]
    ):
        raise TypeError(
            message(
                call,
                "stats",
                "the tracker of a track block (a mapping of name -> ParamStats)",
                describe(stats),
                "pass what `with gradkit.per_example.track(model, ...) as stats` gave",
            )
        )
    if names is None:
        keys = list(stats)
    elif isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            message(
                call,
                "names",
                "an iterable of parameter names",
                describe(names),
                f"pass a list, e.g. names=[{names!r}]",
            )
        )
    else:
        keys = list(names)
    if not keys:
        argument, fix = (
            ("names", "pass names=None for all")
            if names is not None
            else (
                "stats",
                "track at least one parameter",
            )
        )
        raise ValueError(message(call, argument, "at least one parameter", "none", fix))
    repeated = sorted({k for k in keys if keys.count(k) > 1}, key=str)
    if repeated:  # a sum over parameters would count them twice
        raise ValueError(
            message(
                call,
                "names",
                "distinct parameter names",
                f"{repeated} given more than once",
                "pass each name once",
            )
        )
    missing = [k for k in keys if k not in stats]
    if missing:
        raise ValueError(
            message(
                call,
                "names",
                f"names of tracked parameters: {list(stats)}",
                repr(missing),
                "use names from list(stats)",
            )
        )
    return [stats[k] for k in keys]


def signal(norm2: float, trace: float, n: int) -> float:
    """``|G|^2`` estimated without bias from ``n`` examples whose mean has squared norm
    ``norm2`` and whose unbiased variances sum to ``trace``: ``E|mean|^2 = |G|^2 +
    tr(Sigma) / n``. Negative when the window does not resolve ``G`` from the noise."""
    return norm2 - trace / n


def noise_parts(stats: Any, names: Any, call: str) -> tuple[float, float]:
    """``(tr(Sigma), |G|^2)`` over the parameters ``names``, both estimated without bias (see
    :func:`signal`; each parameter with its own number of examples); their ratio is the noise
    scale. Smoothed separately over windows they give a steadier ratio than the windows'
    ratios (what :class:`~gradkit.accumulate.AdaptiveBatchSize` does)."""
    tr = g2 = 0.0
    for s, t in _traces(stats, names, call):
        tr += t
        if s.num_examples:
            g2 += signal(float(s.mean.double().square().sum()), t, s.num_examples)
    return tr, g2


def _traces(stats: Any, names: Any, call: str) -> list[tuple[ParamStats, float]]:
    """Each parameter of ``names`` with ``tr(Sigma)`` of its individual gradients (the
    unbiased variance, summed in float64)."""
    out = []
    for s in _select(stats, names, call):
        _check_two(s, call)
        out.append((s, float(s.var(unbiased=True).double().sum())))
    return out


def ema(old: float | None, new: float, smoothing: float) -> float:
    """One step of an exponential moving average (``new`` where there is none yet): how the
    noise scale's parts and CABS estimates are smoothed over windows."""
    return new if old is None else smoothing * old + (1 - smoothing) * new


def _check_two(s: ParamStats, call: str) -> None:
    if 0 < s.num_examples < 2:
        raise GradkitError(
            message(
                call,
                "stats",
                "statistics of at least 2 examples (the unbiased variance, N/(N-1))",
                f"{s.num_examples} example for {s.name!r}",
                "backpropagate more examples in the track block (a last batch of one "
                "example has no variance)",
            )
        )


def _ratio(tr: float, norm2: float) -> float:
    """``tr / norm2``: ``inf`` for noise without a (resolved, positive) signal, ``nan`` for
    ``0 / 0`` (every gradient 0: undefined, and non-finite so that no caller takes it for a
    batch size)."""
    if norm2 > 0:
        return tr / norm2
    return float("inf") if tr > 0 else float("nan")


def noise_scale(stats: Mapping[str, ParamStats], names: Iterable[str] | None = None) -> float:
    """``B_simple = tr(Sigma) / |G|^2`` over the parameters ``names`` (default: all tracked),
    both estimated without bias from the window's examples: ``tr(Sigma)`` by the unbiased
    variance, ``|G|^2`` by ``|mean|^2 - tr(Sigma) / N`` (McCandlish et al. 2018, Appendix A;
    the plain ``|mean|^2`` would make the ratio read back about ``N`` wherever ``B_simple`` is
    larger).

    Needs ``"variance"`` tracked and at least two examples. ``inf`` when the window does not
    resolve the mean gradient from the noise (``|mean|^2 <= tr(Sigma) / N``: ``B_simple`` is
    beyond what it can measure; average more windows, as ``AdaptiveBatchSize`` does); ``nan``
    when every individual gradient is 0. One window's estimate is noisy where ``B_simple`` is
    well above ``N``: its ``|G|^2`` is a small difference of large numbers.

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
    return _ratio(*noise_parts(stats, names, "noise_scale(stats, names)"))


ROUNDING = 256
"""``c = ROUNDING * eps`` of the statistics' dtype: the rounding floors of :func:`snr_ratios`."""


def snr_ratios(s: ParamStats, largest: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``mean^2 / variance`` (unbiased) of the entries of one parameter whose ratio is not
    rounding noise, flat. Left out: a variance below ``c E[g^2]`` (within the rounding of
    ``E[g^2] - mean^2``), gradients with ``E[g^2] < c^2 max E[g^2]`` over the parameter (at
    the rounding level of its largest entries), ``c = 256 eps``, and the whole parameter where
    its largest ``E[g^2]`` is below ``(16 eps)^2 largest``, ``largest`` the largest ``E[g^2]``
    over the parameters reduced together (see :func:`largest_second_moment`): a parameter whose
    exact gradient is 0 (an attention's key bias: softmax ignores a shift) has entries that are
    all rounding noise, alike among themselves. Those ratios are noise over noise and change by
    orders of magnitude between two exact computations (1-2 % of a BERT's median SNR moved with
    the examples' order).
    """
    var = s.var(unbiased=True)
    mean = s.mean
    second = s.second_moment
    eps = torch.finfo(mean.dtype).eps
    c = ROUNDING * eps
    top = second.max()
    signal = top > (_MODEL_NOISE * eps) ** 2 * largest  # 0-dim: no host sync
    ok = (var > c * second) & (second > c * c * top) & signal
    return (mean[ok].square() / var[ok]).reshape(-1)


_MODEL_NOISE = 16
"""A parameter whose gradients all stay below ``_MODEL_NOISE * eps`` of the largest one of the
parameters reduced with it is rounding noise (:func:`snr_ratios`)."""


def largest_second_moment(stats: Iterable[ParamStats]) -> torch.Tensor | float:
    """The largest ``E[g^2]`` entry over ``stats`` (a 0-dim tensor on their device; no host
    sync), the scale below which :func:`snr_ratios` takes a gradient for rounding noise."""
    tops = [s.second_moment.max().double() for s in stats if s.second_moment.numel()]
    return torch.stack(tops).max() if tops else 0.0


def _zero_gradient(s: ParamStats, largest: torch.Tensor | float) -> bool:
    """Whether every entry of ``s``'s mean is 0 up to rounding at the scale ``largest``."""
    mean = s.mean
    if not mean.numel():
        return True
    eps = torch.finfo(mean.dtype).eps
    return bool(mean.double().square().max() <= (_MODEL_NOISE * eps) ** 2 * largest)


def median(values: torch.Tensor) -> float:
    """The median of the entries of ``values``: the middle one, or the mean of the two middle
    ones for an even count (``torch.median`` gives the lower of those two)."""
    flat = values.reshape(-1).double()
    n = flat.numel()
    lower = flat.kthvalue((n + 1) // 2).values
    if n % 2:
        return float(lower)
    return float((lower + flat.kthvalue(n // 2 + 1).values) / 2)


def gradient_snr(
    stats: Mapping[str, ParamStats], names: Iterable[str] | None = None, *, reduction: str = "mean"
) -> dict[str, float]:
    """Per parameter: ``mean^2 / variance`` per entry (unbiased variance), reduced over entries
    by ``"mean"`` (Liu et al. 2020) or ``"median"`` (robust to a few entries of tiny
    variance). Entries whose ratio is rounding noise are left out (:func:`snr_ratios`: zero
    variance, a variance within the rounding of ``E[g^2] - mean^2``, gradients at the rounding
    level of the parameter's largest). A parameter with no entry left gives ``inf``, or ``nan``
    if its mean is 0 too (a zero gradient for every example).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> model = nn.Linear(4, 1)
        >>> with gradkit.per_example.track(model, "variance") as stats:
        ...     model(torch.randn(16, 4)).pow(2).mean().backward()
        >>> sorted(gradkit.per_example.gradient_snr(stats))
        ['bias', 'weight']
    """
    check_choice(reduction, ("mean", "median"), "gradient_snr(stats)", "reduction")
    out = {}
    selected = list(_select(stats, names, "gradient_snr(stats, names)"))
    largest = largest_second_moment(selected)
    for s in selected:
        ratio = snr_ratios(s, largest).double()
        if not ratio.numel():
            out[s.name] = float("nan") if _zero_gradient(s, largest) else float("inf")
        else:
            out[s.name] = float(ratio.mean()) if reduction == "mean" else median(ratio)
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
    ``[min_size, max_size]`` (Balles et al. 2017).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> model = nn.Linear(4, 1)
        >>> with gradkit.per_example.track(model, "variance") as stats:
        ...     loss = model(torch.randn(16, 4)).pow(2).mean()
        ...     loss.backward()
        >>> gradkit.per_example.cabs_batch_size(stats, 0.1, loss, max_size=1024) >= 1
        True
    """
    call = "cabs_batch_size(stats, lr, loss)"
    min_size = check_int(min_size, call, "min_size", low=1)
    max_size = check_optional_int(
        max_size,
        call,
        "max_size",
        low=min_size,
        fix=f"pass max_size >= min_size ({min_size}), or None",
    )
    size = max(min_size, round(cabs_estimate(stats, lr, loss, names, call)))
    return size if max_size is None else min(size, max_size)


def cabs_estimate(
    stats: Mapping[str, ParamStats],
    lr: float,
    loss: float | torch.Tensor,
    names: Iterable[str] | None,
    call: str,
) -> float:
    """``lr * tr(Sigma) / loss``, neither rounded nor clipped (``call`` names the caller in
    errors)."""
    lr = check_number(
        one_number(lr), call, "lr", low=0, low_open=True, fix="pass the optimizer's learning rate"
    )
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        raise ValueError(
            message(
                call,
                "loss",
                "a scalar (the current training loss)",
                describe(loss),
                "pass the reduced loss, e.g. loss.mean()",
            )
        )
    if not isinstance(loss, (torch.Tensor, int, float)) or isinstance(loss, bool):
        raise TypeError(
            message(call, "loss", "a number or a scalar tensor", describe(loss), "pass loss.item()")
        )
    loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    if not loss_value > 0:
        raise ValueError(
            message(
                call,
                "loss",
                "a positive loss value",
                repr(loss_value),
                "CABS assumes a non-negative loss with minimum 0; pass the "
                "current (positive) training loss",
            )
        )
    tr = sum(t for _, t in _traces(stats, names, call))
    return lr * tr / loss_value


def summary_table(stats: Mapping[str, ParamStats]) -> str:
    """A plain-text per-parameter table: |mean|, tr(var), SNR, noise scale. A parameter whose
    gradient is 0 for every example (the loss did not reach it) shows 0, 0 and ``zero
    gradient``; without ``"variance"`` tracked, or with fewer than 2 examples (the unbiased
    variance), the last column says so."""
    rows = [("parameter", "N", "|mean|", "tr(var)", "SNR", "noise scale")]
    readable = [
        name
        for name in stats
        if {1, 2} <= set(stats[name].powers()) and stats[name].num_examples >= 2
    ]
    # read together, as gradient_snr(stats) does: a parameter whose gradients are all rounding
    # noise at the scale of the others (an attention's key bias) has SNR nan
    snrs = gradient_snr(stats, readable) if readable else {}
    for name in stats:
        s = stats[name]
        n = s.num_examples
        if not {1, 2} <= set(s.powers()):
            rows.append((name, str(n), "-", "-", "-", "track 'variance'"))
            continue
        if n < 2:
            rows.append((name, str(n), "-", "-", "-", "needs N >= 2"))
            continue
        mean_norm = float(s.mean.double().norm())
        tr = float(s.var(unbiased=True).double().sum())
        if mean_norm == 0 and tr == 0:
            rows.append((name, str(n), "0", "0", "-", "zero gradient"))
            continue
        snr = snrs[name]
        ns = _ratio(tr, signal(mean_norm**2, tr, n))
        rows.append((name, str(n), f"{mean_norm:.4g}", f"{tr:.4g}", f"{snr:.4g}", f"{ns:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

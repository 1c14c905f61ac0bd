"""The demo's "Statistics of individual gradients" section: per-layer gradient SNR and noise
scale over training, from ``gradkit.per_example.track`` around some training steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from gradkit.per_example import track
from gradkit.per_example._derived import (
    _ratio,
    ema,
    largest_second_moment,
    median,
    noise_parts,
    snr_ratios,
)

__all__ = ["GradStatsRecorder", "gradient_stats_markdown"]


SMOOTHING = 0.5
"""The demo's moving averages of ``tr(Sigma)`` and ``|G|^2`` over tracked steps (as
``AdaptiveBatchSize``'s default): one step of 32 examples does not resolve a noise scale much
above 32."""


def _parts(stats: Any, names: list[str] | None) -> dict[str, float]:
    trace, signal = noise_parts(stats, names, "demo")
    return {"noise_scale": _ratio(trace, signal), "trace": trace, "signal": signal}


class GradStatsRecorder:
    """A ``step_context`` for the training loop: every ``every`` steps, the step's forward and
    backward run inside ``track(model, "variance", "batch_l2")`` and the per-layer statistics
    are recorded. Steps in between are timed too, for the cost ratio."""

    def __init__(self, model: nn.Module, every: int) -> None:
        self.model = model
        self.every = max(1, every)
        self.records: list[dict[str, Any]] = []
        self.tracked_seconds: list[float] = []
        self.plain_seconds: list[float] = []
        self.snapshots: list[tuple[int, dict[str, torch.Tensor]]] = []  # (step, weights)

    def __call__(self, step: int) -> AbstractContextManager[Any]:
        if step % self.every == 0 or step == 1:
            return self._tracked(step)
        return self._timed()

    @contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        with nullcontext():
            yield
        self.plain_seconds.append(time.perf_counter() - start)

    @contextmanager
    def _tracked(self, step: int) -> Iterator[None]:
        start = time.perf_counter()
        with track(self.model, "variance", "batch_l2") as stats:
            yield
        self.tracked_seconds.append(time.perf_counter() - start)
        self.snapshots.append(
            (step, {k: v.detach().clone() for k, v in self.model.state_dict().items()})
        )
        layers = {name.rsplit(".", 1)[0] for name in stats}
        largest = largest_second_moment(stats.values())
        per_layer = {}
        for layer in sorted(layers):
            names = [n for n in stats if n.rsplit(".", 1)[0] == layer]
            ratios = [snr_ratios(stats[n], largest) for n in names]
            joined = torch.cat(ratios) if ratios else torch.empty(0)
            per_layer[layer] = {
                **_parts(stats, names),
                # the median over the entries of the layer's parameters (the text says so)
                "snr": median(joined) if joined.numel() else float("nan"),
            }
        norms = stats.batch_l2().sqrt()
        self.records.append(
            {
                "step": step,
                "batch": stats.num_examples,
                **_parts(stats, None),
                "layers": per_layer,
                "norm_median": float(norms.median()),
                "norm_max": float(norms.max()),
            }
        )


def smoothed(parts: list[dict[str, float]]) -> list[float]:
    """The noise scale after each step from moving averages of its two parts (``trace`` and
    ``signal``, see :func:`gradkit.per_example._derived.noise_parts`); ``inf`` while the
    averaged signal is not positive."""
    out: list[float] = []
    trace: float | None = None
    signal: float | None = None
    for part in parts:
        trace = ema(trace, part["trace"], SMOOTHING)
        signal = ema(signal, part["signal"], SMOOTHING)
        out.append(_ratio(trace, signal))
    return out


def _figure(records: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.4))
    ax_snr, ax_ns = fig.subplots(1, 2)
    steps = [r["step"] for r in records]
    for layer in records[0]["layers"]:
        ax_snr.plot(steps, [r["layers"][layer]["snr"] for r in records], label=f"layer {layer}")
        ax_ns.plot(steps, smoothed([r["layers"][layer] for r in records]), label=f"layer {layer}")
    ax_ns.plot(steps, smoothed(records), "k--", label="whole model")
    ax_snr.set(
        xlabel="training step",
        ylabel="median gradient SNR",
        yscale="log",
        title="gradient signal-to-noise ratio",
    )
    ax_ns.set(
        xlabel="training step",
        ylabel="B_simple (examples)",
        yscale="log",
        title="gradient noise scale (smoothed)",
    )
    ax_ns.legend(fontsize=7)
    fig.tight_layout()
    return fig


def gradient_stats_markdown(recorder: GradStatsRecorder) -> tuple[str, Any, dict[str, Any]]:
    """Markdown, figure and metrics for the section (from the recorder's records)."""
    records = recorder.records
    last = records[-1]
    layer_scales = {
        layer: smoothed([r["layers"][layer] for r in records])[-1] for layer in last["layers"]
    }
    rows = "\n".join(
        f"| {layer} | {v['snr']:.3g} | {layer_scales[layer]:.3g} |"
        for layer, v in last["layers"].items()
    )
    model_scale = smoothed(records)[-1]
    tracked = float(torch.tensor(recorder.tracked_seconds).median())
    plain = float(torch.tensor(recorder.plain_seconds).median()) if recorder.plain_seconds else 0
    ratio = f"{tracked / plain:.2f}x" if plain > 0 else "n/a"
    markdown = f"""Every {recorder.every} steps the training step ran inside
`gradkit.per_example.track(model, "variance", "batch_l2")`: the variance of the individual
gradients of every parameter and each example's gradient norm came out of the step's own
backward pass ({len(records)} tracked steps; a tracked step took {ratio} the time of a plain
one, medians over this run, forward and backward only).

The gradient noise scale `B_simple = tr(Σ) / |G|²` (McCandlish et al. 2018) is the batch size
at which the noise of the mini-batch gradient matches its signal: above it, larger batches
buy little. Each tracked step estimates `tr(Σ)` and `|G|²` without bias (`|G|²` as
`|mean|² - tr(Σ) / N`: the plain `|mean|²` would pull every estimate to about the batch size);
one step of {last["batch"]} examples resolves little above {last["batch"]}, so the table and plot
show the ratio of their moving averages over the tracked steps (factor {SMOOTHING}, as
`AdaptiveBatchSize` smooths them). The SNR of an entry is `mean² / variance` (Liu et al.
2020); the table and plot show its median over the entries of each layer at the last tracked
step.

| layer (tracked steps up to {last["step"]}) | median SNR | noise scale |
|---|---|---|
{rows}

Whole model: noise scale **{model_scale:.3g}** examples (batch {last["batch"]});
per-example gradient norms: median {last["norm_median"]:.3g}, max {last["norm_max"]:.3g}.

{{{{figure:gradient_stats}}}}
"""
    metrics = {"records": records, "tracked_step_seconds": tracked, "plain_step_seconds": plain}
    return markdown, _figure(records), metrics

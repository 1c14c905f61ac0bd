"""``gradkit monitor-report LOG``: the plots of a :class:`~gradkit.monitor.GradientMonitor`
JSON-lines log, as a run report (``<out>/<timestamp>/report.md`` with PNG figures and
``metrics.json``): the gradient norm and noise scale of the whole model over the steps, the
median SNR and noise scale per layer, the per-example norm quantiles, the CABS batch size."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gradkit.cli._report import Plot, Report
from gradkit.monitor import read_records

__all__ = ["LogError", "monitor_report"]


class LogError(ValueError):
    """A log that cannot be read (missing, empty, or not a monitor's records)."""


def _log_file(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        logs = sorted(p.glob("*.jsonl"))
        if len(logs) != 1:
            raise LogError(
                f"{p} holds {len(logs)} .jsonl files; pass the log file itself"
                if logs
                else f"{p} holds no .jsonl log; pass the file a GradientMonitor wrote"
            )
        return logs[0]
    if not p.exists():
        raise LogError(f"{p} does not exist; pass the JSON-lines file a GradientMonitor wrote")
    return p


def _series(records: list[dict[str, Any]], key: str, layer: str | None = None) -> tuple[list, list]:
    steps, values = [], []
    for r in records:
        source = r.get("layers", {}).get(layer, {}) if layer is not None else r
        value = source.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(r["step"])
            values.append(value)
    return steps, values


def _figure(title: str, ylabel: str, log: bool = True) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    return fig, ax


def _whole_model(records: list[dict[str, Any]]) -> list[Plot]:
    plots = []
    for key, label in (("noise_scale", "noise scale B_simple"), ("grad_norm", "|mean gradient|")):
        steps, values = _series(records, key)
        if values and all(v > 0 for v in values):
            fig, ax = _figure(label, key)
            ax.plot(steps, values, marker="o", markersize=3)
            plots.append(Plot(key, fig, f"{label} of the whole model"))
    steps, q50 = _series(records, "example_norm_q50")
    if q50:
        fig, ax = _figure("per-example gradient norms", "|g_i|")
        _, q10 = _series(records, "example_norm_q10")
        _, q90 = _series(records, "example_norm_q90")
        if len(q10) == len(q90) == len(q50):
            ax.fill_between(steps, q10, q90, alpha=0.25, label="10-90 %")
        ax.plot(steps, q50, label="median")
        ax.legend()
        plots.append(Plot("example_norms", fig, "quantiles of the per-example gradient norms"))
    steps, cabs = _series(records, "cabs_batch_size")
    if cabs:
        fig, ax = _figure("CABS batch size", "examples")
        ax.plot(steps, cabs, marker="o", markersize=3)
        plots.append(Plot("cabs", fig, "the CABS batch-size suggestion"))
    return plots


def _per_layer(records: list[dict[str, Any]]) -> list[Plot]:
    layers = list(records[-1].get("layers", {}))
    plots = []
    for key, label in (("snr_median", "median SNR"), ("noise_scale", "noise scale")):
        fig, ax = _figure(f"{label} per layer", key)
        drawn = False
        for layer in layers:
            steps, values = _series(records, key, layer)
            if values and all(v > 0 for v in values):
                ax.plot(steps, values, label=layer)
                drawn = True
        if drawn:
            ax.legend(fontsize="small", ncol=2)
            plots.append(Plot(f"layers_{key}", fig, f"{label} of each layer"))
    return plots


def _table(records: list[dict[str, Any]]) -> str:
    first, last = records[0], records[-1]
    rows = ["| quantity | first record | last record |", "|---|---:|---:|"]
    for key in (
        "examples",
        "grad_norm",
        "grad_variance",
        "noise_scale",
        "snr_median",
        "example_norm_q50",
        "cabs_batch_size",
        "loss",
    ):
        if key in first or key in last:
            rows.append(f"| {key} | {_fmt(first.get(key))} | {_fmt(last.get(key))} |")
    return "\n".join(rows)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def monitor_report(log: str, out: str) -> Path:
    """Write the report of the log ``log`` (a file, or a folder holding one ``.jsonl``) under
    ``out``; returns the path of ``report.md``.

    Raises:
        LogError: a log that cannot be read.
    """
    path = _log_file(log)
    try:
        records = read_records(path)
    except (ValueError, OSError) as err:
        raise LogError(str(err)) from None
    if not records:
        raise LogError(f"{path} holds no records; a GradientMonitor writes one per tracked step")
    # a writer appends: a run written to an existing log follows the last one, its steps
    # starting again (the two were read as one run, plotted as one series)
    starts = [0] + [
        i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]
    ]
    runs = len(starts)
    records = records[starts[-1] :]
    report = Report.open(
        out, "gradkit monitor report", {"log": str(path), "records": len(records), "runs": runs}
    )
    steps = [r["step"] for r in records]
    body = f"{len(records)} tracked steps, {steps[0]} to {steps[-1]}, from `{path}`.\n\n"
    if runs > 1:
        body += (
            f"The log holds {runs} runs (its steps start again at record"
            f"{'s' if len(starts) > 2 else ''} "
            f"{', '.join(str(i + 1) for i in starts[1:])}: a monitor appends to an existing "
            "log); this report reads the last.\n\n"
        )
    body += _table(records)
    report.add_section(
        "Whole model",
        body,
        _whole_model(records),
        metrics={"first": records[0], "last": records[-1]},
    )
    if records[-1].get("layers"):
        report.add_section(
            "Per layer",
            "The median SNR (mean^2 / variance over a layer's entries) and the noise scale of "
            "each layer.",
            _per_layer(records),
            metrics={"first": records[0]["layers"], "last": records[-1]["layers"]},
        )
    return report.save()

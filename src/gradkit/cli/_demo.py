"""``gradkit demo``: train a small CNN on the bundled digits and write a report about it.

The run is a list of section functions (:data:`SECTIONS`), each ``(ctx, report) -> None``
(the protocol is in :mod:`._sections`): it reads the trained model and data from the
:class:`DemoContext` and adds one section to the :class:`~gradkit.cli._report.Report`. A new
feature shows itself in the demo by appending its own section function; nothing else changes.

Output: ``<out>/<timestamp>/report.md`` with PNG figures and ``metrics.json``, written only
inside that folder. Progress (rich: the training steps, then the section running and what it is
doing, which sections report through :attr:`DemoContext.note`) goes to stderr and only to a
terminal; the summary table goes to stdout.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gradkit import __version__
from gradkit._digits import load_digits, make_model
from gradkit._scope import torch_scope
from gradkit.cli._accumulation import accumulation_markdown
from gradkit.cli._gradstats import GradStatsRecorder, gradient_stats_markdown
from gradkit.cli._hyperclean_demo import hyperparameter_section
from gradkit.cli._report import Plot, Report
from gradkit.cli._sections import DemoConfig, DemoContext, Section, section_title
from gradkit.cli._sharpness import sharpness_markdown
from gradkit.cli._showcase import hessian_spectrum, hvp_cost, input_jacobian
from gradkit.cli._train import TrainResult, train

__all__ = ["SECTIONS", "run_demo"]


def setup_section(ctx: DemoContext, report: Report) -> None:
    """Data, model and optimizer settings."""
    n_train, n_test = ctx.data.sizes
    n_params = sum(p.numel() for p in ctx.model.parameters())
    cfg = ctx.config
    layers = " → ".join(type(m).__name__ for m in ctx.model.children())
    subsets = " (quick-mode subsets)" if cfg.quick else ""
    markdown = f"""scikit-learn's bundled digits: 8x8 grey images of ten classes, no download.

| setting | value |
|---|---|
| data | {n_train} training / {n_test} test examples{subsets}, stratified split, seed {cfg.seed} |
| model | {layers}, {n_params:,} parameters |
| optimizer | Adam, learning rate {cfg.lr} (cosine decay), batch {cfg.batch_size} |
| epochs | {cfg.epochs} |
| torch threads | {torch.get_num_threads()} |
"""
    report.add_section(
        "Setup",
        markdown,
        metrics={
            "train_examples": n_train,
            "test_examples": n_test,
            "parameters": n_params,
            "config": asdict(cfg),
            "threads": torch.get_num_threads(),
        },
    )


def _curves_figure(result: TrainResult) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9.0, 3.4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    steps = [(i + 1) / result.steps_per_epoch for i in range(len(result.step_losses))]
    epochs = [e.epoch for e in result.epochs]
    ax_loss.plot(steps, result.step_losses, lw=0.8, alpha=0.6, label="train (per step)")
    ax_loss.plot(epochs, [e.train_loss for e in result.epochs], "o-", label="train (epoch)")
    ax_loss.plot(epochs, [e.test_loss for e in result.epochs], "s-", label="test")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_yscale("log")
    ax_acc.plot(epochs, [e.train_accuracy for e in result.epochs], "o-", label="train")
    ax_acc.plot(epochs, [e.test_accuracy for e in result.epochs], "s-", label="test")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0.0, 1.02)
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def training_section(ctx: DemoContext, report: Report) -> None:
    """Per-epoch table and loss/accuracy curves."""
    rows = "\n".join(
        f"| {e.epoch} | {e.train_loss:.4f} | {e.train_accuracy:.3f} | "
        f"{e.test_loss:.4f} | {e.test_accuracy:.3f} | {e.seconds:.2f} |"
        for e in ctx.result.epochs
    )
    final = ctx.result.final
    steps = len(ctx.result.step_losses)
    markdown = f"""Final test accuracy **{final.test_accuracy:.3f}** (chance: 0.1) after {steps}
steps in {ctx.train_seconds:.1f} s.

| epoch | train loss | train acc | test loss | test acc | seconds |
|---|---|---|---|---|---|
{rows}
"""
    plot = Plot(
        "training_curves", _curves_figure(ctx.result), "Loss (log scale) and accuracy by epoch"
    )
    report.add_section(
        "Training",
        markdown,
        [plot],
        metrics={
            "epochs": [asdict(e) for e in ctx.result.epochs],
            "final": asdict(final),
            "steps": steps,
            "seconds": ctx.train_seconds,
        },
    )


def showcase_section(ctx: DemoContext, report: Report) -> None:
    """``gradkit.func`` on the trained model: input Jacobian, Hessian, HVP cost."""
    cfg, data = ctx.config, ctx.data
    batch = (data.x_train[: cfg.hessian_batch], data.y_train[: cfg.hessian_batch])
    parts = {
        "jacobian": input_jacobian(
            ctx.model, data.x_test[0], int(data.y_test[0]), index=0, repeats=cfg.timing_repeats
        ),
        "hessian": hessian_spectrum(
            ctx.model, batch, steps=cfg.power_steps, generator=ctx.generator
        ),
        "hvp_cost": hvp_cost(ctx.model, batch, repeats=cfg.timing_repeats, generator=ctx.generator),
    }
    intro = (
        "Derivatives of the trained model computed with `gradkit.func`; every number "
        "below was measured in this run.\n\n"
    )
    report.add_section(
        "Differentiation showcase",
        intro + "\n".join(md for md, _, _ in parts.values()),
        [plot for _, plots, _ in parts.values() for plot in plots],
        metrics={name: metrics for name, (_, _, metrics) in parts.items()},
    )


def gradient_stats_section(ctx: DemoContext, report: Report) -> None:
    """``gradkit.per_example``: per-layer gradient SNR and noise scale over training."""
    recorder = ctx.extras.get("gradstats")
    if recorder is None or not recorder.records:
        return
    markdown, figure, metrics = gradient_stats_markdown(recorder)
    plot = Plot("gradient_stats", figure, "Per-layer gradient SNR and noise scale over training")
    report.add_section("Statistics of individual gradients", markdown, [plot], metrics=metrics)


def accumulation_section(ctx: DemoContext, report: Report) -> None:
    """``gradkit.accumulate``: exact micro-batches, batch 32 vs 256, adaptive batch size."""
    markdown, figure, metrics = accumulation_markdown(
        make_model,
        ctx.model,
        ctx.data,
        epochs=ctx.config.epochs,
        lr=ctx.config.lr,
        seed=ctx.config.seed,
    )
    plot = Plot("accumulation", figure, "Batch 32 vs exact batch 256, and the adaptive batch size")
    report.add_section("Exact accumulation", markdown, [plot], metrics=metrics)


def sharpness_section(ctx: DemoContext, report: Report) -> None:
    """``gradkit.curvature``: the top Hessian eigenvalue at weights saved during training."""
    recorder = ctx.extras.get("gradstats")
    if recorder is None or not recorder.snapshots:
        return
    n = min(256, len(ctx.data.y_train))
    markdown, figure, metrics = sharpness_markdown(
        ctx.model,
        recorder.snapshots,
        (ctx.data.x_train[:n], ctx.data.y_train[:n]),
        points=6 if ctx.config.quick else 10,
        max_iter=20,
        seed=ctx.config.seed,
    )
    plot = Plot("sharpness", figure, "Top Hessian eigenvalue over training")
    report.add_section("Sharpness over training", markdown, [plot], metrics=metrics)


#: The demo's sections, in report order; append a function to add a section.
SECTIONS: list[Section] = [
    setup_section,
    training_section,
    gradient_stats_section,
    sharpness_section,
    accumulation_section,
    showcase_section,
    hyperparameter_section,
]


def run_demo(
    config: DemoConfig, *, sections: list[Section] | None = None, console: Any = None
) -> Report:
    """Train, build the report from ``sections`` (default :data:`SECTIONS`), save it.

    Args:
        config: the settings.
        sections: section functions, in order.
        console: a ``rich.console.Console`` for the progress bar (default: stderr).

    Returns:
        The saved report (``report.directory`` holds its files).
    """
    from gradkit.cli._console import section_progress, step_progress

    run_start = time.perf_counter()
    report = Report.open(
        Path(config.out),
        "gradkit demo",
        header={
            "gradkit": __version__,
            "torch": torch.__version__,
            "seed": config.seed,
            "mode": "quick" if config.quick else "full",
        },
    )
    report.header["run"] = report.directory.name
    with torch_scope(config.threads):
        torch.manual_seed(config.seed)
        generator = torch.Generator().manual_seed(config.seed)
        data = load_digits(config.seed, max_train=config.max_train, max_test=config.max_test)
        model = make_model()
        steps = config.epochs * math.ceil(data.sizes[0] / config.batch_size)
        start = time.perf_counter()
        recorder = GradStatsRecorder(model, config.stats_every)
        with step_progress(
            "training",
            steps,
            fields={"loss": "loss {:.4f}"},
            enabled=config.progress,
            console=console,
        ) as on_step:
            result = train(
                model,
                data,
                epochs=config.epochs,
                batch_size=config.batch_size,
                lr=config.lr,
                generator=generator,
                on_step=on_step,
                step_context=recorder,
            )
        ctx = DemoContext(config, data, model, result, generator, time.perf_counter() - start)
        ctx.extras["gradstats"] = recorder
        chosen = SECTIONS if sections is None else sections
        titles = [section_title(section) for section in chosen]
        with section_progress(titles, enabled=config.progress, console=console) as progress:
            ctx.note = progress.note
            for index, section in enumerate(chosen):
                progress.start(index)
                section(ctx, report)
            progress.start(len(chosen))
        report.header["seconds"] = round(time.perf_counter() - run_start, 2)
        report.save()
    return report

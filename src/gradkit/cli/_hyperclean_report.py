"""``gradkit hyperclean``: run the experiment, write its run folder, print the summary.

The run folder ``<out>/<timestamp>/`` holds ``report.md`` (settings, the result table and
three figures: the learned weights of clean and corrupted examples, the outer loss over the
hyper-steps, the accuracy and flagging quality over the hyper-steps) and ``results.json``
(the headline numbers first: ``baseline_accuracy``, ``oracle_accuracy``, ``cleaned_accuracy``,
``f1``, ...; then settings, history and the learned weights). Nothing is written elsewhere.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch

from gradkit import __version__
from gradkit.cli._console import interactive
from gradkit.cli._hyperclean import CleaningResult, HypercleanConfig, StepCallback, hyperclean
from gradkit.cli._hyperclean_data import HypercleanData, load_source, make_split
from gradkit.cli._report import Plot, Report, figure_token

__all__ = [
    "hyperclean_figures",
    "markdown_table",
    "print_hyperclean_summary",
    "result_table",
    "run_hyperclean",
]


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def result_table(result: CleaningResult) -> str:
    """The markdown table of accuracies and flagging quality."""
    d = result.detection
    flags = f"{d['precision']:.3f} / {d['recall']:.3f} / **{d['f1']:.3f}**"
    return markdown_table(
        ("", "test accuracy", "flagged as corrupted: precision / recall / F1"),
        [
            ("baseline (all weights 1)", f"{result.baseline_accuracy:.4f}", ""),
            ("oracle (corrupted examples removed)", f"{result.oracle_accuracy:.4f}", ""),
            ("hyper-cleaned (learned weights)", f"**{result.cleaned_accuracy:.4f}**", flags),
            (
                "hyper-cleaned, last inner model (training set only)",
                f"{result.cleaned_train_only_accuracy:.4f}",
                "",
            ),
        ],
    )


def _weights_figure(result: CleaningResult, corrupted: torch.Tensor) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.4))
    ax = fig.subplots()
    bins = [i / 20 for i in range(21)]
    w = result.weights
    ax.hist(w[~corrupted].tolist(), bins=bins, alpha=0.7, label="clean examples", color="C0")
    ax.hist(w[corrupted].tolist(), bins=bins, alpha=0.7, label="corrupted examples", color="C3")
    ax.set_xlabel("learned weight")
    ax.set_ylabel("examples")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _loss_figure(result: CleaningResult) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.subplots()
    losses = result.history["outer_loss"]
    ax.plot(range(1, len(losses) + 1), losses, color="C0")
    ax.set_xlabel("hyper-step")
    ax.set_ylabel("validation cross-entropy")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _accuracy_figure(result: CleaningResult) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.4))
    ax_acc, ax_f1 = fig.subplots(1, 2)
    h = result.history
    steps = range(1, len(h["test_accuracy"]) + 1)
    ax_acc.plot(steps, h["test_accuracy"], color="C0", label="inner model (training set)")
    for value, label, color in (
        (result.baseline_accuracy, "baseline", "C3"),
        (result.oracle_accuracy, "oracle", "C2"),
        (result.cleaned_accuracy, "hyper-cleaned (final round)", "C1"),
    ):
        ax_acc.axhline(value, ls="--", lw=1, color=color, label=label)
    ax_acc.set_xlabel("hyper-step")
    ax_acc.set_ylabel("test accuracy")
    for key, color in (("precision", "C0"), ("recall", "C1"), ("f1", "C2")):
        ax_f1.plot(steps, h[key], color=color, label=key if key != "f1" else "F1")
    ax_f1.set_xlabel("hyper-step")
    ax_f1.set_ylabel("flagging corrupted examples")
    ax_f1.set_ylim(-0.02, 1.02)
    for ax in (ax_acc, ax_f1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def hyperclean_figures(
    result: CleaningResult, data: HypercleanData, *, prefix: str = ""
) -> list[Plot]:
    """The three figures: weights histogram, outer loss, accuracy and flagging."""
    return [
        Plot(
            f"{prefix}weights_histogram",
            _weights_figure(result, data.corrupted),
            "Learned weights of clean and corrupted training examples (log count)",
        ),
        Plot(f"{prefix}outer_loss", _loss_figure(result), "Validation loss over the hyper-steps"),
        Plot(
            f"{prefix}accuracy",
            _accuracy_figure(result),
            "Test accuracy and flagging quality over the hyper-steps",
        ),
    ]


def _markdown(config: HypercleanConfig, data: HypercleanData, result: CleaningResult) -> str:
    n_train, n_val, n_test = data.sizes
    sec = result.seconds
    settings = markdown_table(
        ("setting", "value"),
        [
            ("data", data.description),
            (
                "sizes",
                f"{n_train} training / {n_val} validation / {n_test} test, "
                f"{data.num_classes} classes, {data.x_train.shape[1]} features",
            ),
            (
                "inner problem",
                f"softmax regression, gradient descent, learning rate {config.lr}, "
                f"T = {config.inner_steps} steps, loss (1/R) sum of weight x cross-entropy",
            ),
            (
                "hyperparameters",
                f"{n_train} per-example weights in [0, 1] with sum <= R = {int(result.radius)} "
                "(capped-simplex projection after each hyper-step), starting at R/n",
            ),
            ("hypergradient", "exact reverse mode through the T steps (stored states, replayed)"),
            (
                "outer optimizer",
                f"Adam, learning rate {config.hyper_lr}, {config.hyper_steps} hyper-steps",
            ),
            ("flagged as corrupted", f"weight < {config.threshold:g}"),
            (
                "baseline / oracle / final round",
                "T steps on training + validation data, weighted mean cross-entropy: all "
                "weights 1 / corrupted weights 0 / the learned weights (validation weights 1)",
            ),
            (
                "seconds",
                f"baseline and oracle {sec['baseline_and_oracle']:.1f}, hyper-cleaning "
                f"{sec['hyper_cleaning']:.1f}, final round {sec['final_round']:.1f}",
            ),
        ],
    )
    d = result.detection
    return f"""Data hyper-cleaning (Franceschi et al. 2017, section 5.1): softmax regression
trained by gradient descent on per-example weighted cross-entropy; the weights are
hyperparameters, tuned by reverse-mode hypergradients (`gradkit.hyper.HyperOptimizer`) so that
the model trained with them does well on a clean validation set. Corrupted examples should end
up with weight 0.

{settings}
{result_table(result)}
{d["flagged"]} examples flagged, {d["true_positives"]} of them among the {result.corrupted}
corrupted ones.

{figure_token("weights_histogram")}

{figure_token("outer_loss")}

{figure_token("accuracy")}
"""


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _progress(total: int, *, enabled: bool, console: Any = None) -> Iterator[StepCallback]:
    stream = console.file if console is not None else sys.stderr
    if not (enabled and interactive(stream)):
        yield lambda step, metrics: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]hyper-cleaning"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("validation loss {task.fields[loss]}  F1 {task.fields[f1]}"),
        TimeElapsedColumn(),
        console=console if console is not None else Console(stderr=True),
    )
    with progress:
        task = progress.add_task("hyper-cleaning", total=total, loss="-", f1="-")

        def on_step(step: int, metrics: dict[str, float]) -> None:
            progress.update(
                task,
                completed=step,
                loss=f"{metrics['outer_loss']:.4f}",
                f1=f"{metrics['f1']:.3f}",
            )

        yield on_step


def run_hyperclean(config: HypercleanConfig, *, console: Any = None) -> tuple[Path, dict[str, Any]]:
    """Run the experiment of ``config`` and write its run folder.

    Returns:
        ``(run folder, results)``; ``results`` is what ``results.json`` holds.

    Raises:
        DataError: ``config.data`` names a file that cannot be used.
    """
    started = time.perf_counter()
    with _torch_threads(config.threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        data = make_split(load_source(config.data), config.seed, quick=config.quick)
        report = Report.open(
            Path(config.out),
            "gradkit hyperclean",
            header={
                "gradkit": __version__,
                "torch": torch.__version__,
                "seed": config.seed,
                "mode": "quick" if config.quick else "full",
                "threads": torch.get_num_threads(),
            },
        )
        with _progress(config.hyper_steps, enabled=config.progress, console=console) as on_step:
            result = hyperclean(
                data,
                inner_steps=config.inner_steps,
                hyper_steps=config.hyper_steps,
                lr=config.lr,
                hyper_lr=config.hyper_lr,
                threshold=config.threshold,
                on_step=on_step,
            )
        wall = time.perf_counter() - started
        report.header["seconds"] = round(wall, 2)
        report.add_section(
            "Data hyper-cleaning",
            _markdown(config, data, result),
            hyperclean_figures(result, data),
        )
    n_train, n_val, n_test = data.sizes
    results: dict[str, Any] = {
        **result.summary(),
        "detection": result.detection,
        "data": {
            "description": data.description,
            "train": n_train,
            "validation": n_val,
            "test": n_test,
            "classes": data.num_classes,
            "features": int(data.x_train.shape[1]),
        },
        "config": {
            "quick": config.quick,
            "data": config.data,
            "seed": config.seed,
            "threads": config.threads,
            "inner_steps": config.inner_steps,
            "hyper_steps": config.hyper_steps,
            "lr": config.lr,
            "hyper_lr": config.hyper_lr,
            "threshold": config.threshold,
        },
        "versions": {"gradkit": __version__, "torch": torch.__version__},
        "seconds": {**result.seconds, "wall": wall},
        "history": result.history,
        "weights": result.weights.tolist(),
        "corrupted_indices": data.corrupted.nonzero()[:, 0].tolist(),
    }
    (report.directory / "report.md").write_text(report.to_markdown(), encoding="utf-8")
    (report.directory / "results.json").write_text(
        json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8"
    )
    return report.directory, results


def print_hyperclean_summary(
    directory: Path, results: dict[str, Any], *, stream: TextIO | None = None
) -> None:
    """Print the result table, then the report's path on a line of its own."""
    from rich.console import Console
    from rich.table import Table

    out = stream or sys.stdout
    table = Table(title="gradkit hyperclean", show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    d = results["data"]
    rows = [
        ("train / validation / test", f"{d['train']} / {d['validation']} / {d['test']}"),
        ("corrupted training labels", str(results["corrupted"])),
        ("baseline test accuracy", f"{results['baseline_accuracy']:.4f}"),
        ("oracle test accuracy", f"{results['oracle_accuracy']:.4f}"),
        ("hyper-cleaned test accuracy", f"{results['cleaned_accuracy']:.4f}"),
        (
            "flagging precision / recall / F1",
            f"{results['precision']:.3f} / {results['recall']:.3f} / {results['f1']:.3f}",
        ),
        ("wall time", f"{results['seconds']['wall']:.1f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console(file=out).print(table)
    print(f"report: {directory / 'report.md'}", file=out)

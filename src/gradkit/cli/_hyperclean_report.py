"""The report of ``gradkit hyperclean``: its markdown (settings, the result table), its three
figures (the learned weights of clean and corrupted examples, the outer loss over the
hyper-steps, the accuracy and flagging quality over the hyper-steps) and the summary printed
at the end. The run itself is :mod:`._hyperclean_run`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

import torch

from gradkit.cli._hyperclean import CleaningResult, HypercleanConfig
from gradkit.cli._hyperclean_data import HypercleanData
from gradkit.cli._report import Plot, figure_token

__all__ = [
    "hyperclean_figures",
    "markdown_table",
    "print_hyperclean_summary",
    "report_markdown",
    "result_table",
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


def report_markdown(config: HypercleanConfig, data: HypercleanData, result: CleaningResult) -> str:
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

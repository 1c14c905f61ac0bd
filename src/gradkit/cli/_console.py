"""Terminal output of the CLI: progress bars and the demo's summary table (rich).

A step bar (:func:`step_progress`) follows a run's steps: the demo's training, the hyper-steps of
``gradkit hyperclean``. Two bars cover a demo run: one over the training steps, then one over
the report's sections
(the section running, a note on what it is doing, elapsed time, and a spinner that keeps
turning through long sections). They are shown only when asked for *and* stderr is an
interactive terminal (not a pipe, a file, a CI log or ``TERM=dumb``); ``FORCE_COLOR`` alone
does not turn them on, so CI logs stay free of redraws. Without a bar the callbacks do nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from gradkit.cli._report import Report

__all__ = [
    "SectionProgress",
    "StepCallback",
    "interactive",
    "print_summary",
    "section_progress",
    "step_progress",
]

StepCallback = Callable[[int, Mapping[str, float]], None]
"""``on_step(step, metrics)``: called after each step of a run (e.g. a progress bar)."""


def interactive(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that can redraw a progress bar.

    Examples:
        >>> import io
        >>> interactive(io.StringIO())
        False
    """
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False
    return bool(tty) and os.environ.get("TERM", "").lower() not in ("dumb", "unknown")


@contextmanager
def step_progress(
    title: str,
    total: int,
    *,
    fields: Mapping[str, str],
    enabled: bool,
    console: Any = None,
) -> Iterator[StepCallback]:
    """A rich progress bar over ``total`` steps; yields the ``on_step(step, metrics)`` callback.

    Args:
        title: the bar's label (``"training"``).
        total: steps in the whole run.
        fields: the metrics shown next to the bar, key -> format with its label
            (``{"loss": "loss {:.4f}"}``); each ``metrics`` passed to ``on_step`` holds them.
        enabled: the user's choice (``--no-progress`` gives False).
        console: a ``rich.console.Console``; default one on stderr.

    Without a terminal (or with ``enabled=False``) nothing is drawn and ``on_step`` does
    nothing.
    """
    stream = console.file if console is not None else sys.stderr
    if not (enabled and interactive(stream)):
        yield lambda step, metrics: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    shown = "  ".join(f"{{task.fields[{key}]}}" for key in fields)
    progress = Progress(
        TextColumn(f"[bold]{title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(shown),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console if console is not None else Console(stderr=True),
        transient=False,
    )
    with progress:
        blank: dict[str, Any] = {key: form.split("{")[0] + "-" for key, form in fields.items()}
        task = progress.add_task(title, total=total, **blank)

        def on_step(step: int, metrics: Mapping[str, float]) -> None:
            values: dict[str, Any] = {k: form.format(metrics[k]) for k, form in fields.items()}
            progress.update(task, completed=step, **values)

        yield on_step


class SectionProgress:
    """Progress over named sections: :meth:`start` one, :meth:`note` what it is doing.

    Without a rich ``Progress`` (``progress=None``) every method does nothing.
    """

    def __init__(self, titles: Sequence[str], progress: Any = None) -> None:
        self.titles = list(titles)
        self._progress = progress
        self._task = (
            None
            if progress is None
            else progress.add_task("sections", total=len(self.titles), section="-")
        )
        self._current = ""

    def start(self, index: int) -> None:
        """Section ``index`` begins (``len(titles)``: all are done)."""
        self._current = self.titles[index] if index < len(self.titles) else "done"
        if self._progress is not None:
            self._progress.update(self._task, completed=index, section=self._current)
            self._progress.refresh()  # short sections would otherwise never be drawn

    def note(self, text: str) -> None:
        """Show what the current section is doing, e.g. ``"RTHO, 40/100 steps"``."""
        if self._progress is not None:
            self._progress.update(self._task, section=f"{self._current}: {text}")


@contextmanager
def section_progress(
    titles: Sequence[str], *, enabled: bool, console: Any = None
) -> Iterator[SectionProgress]:
    """A rich progress bar over the report's sections; yields its :class:`SectionProgress`.

    Args:
        titles: the sections' names, in order.
        enabled: the user's choice (``--no-progress`` gives False).
        console: a ``rich.console.Console``; default one on stderr.
    """
    stream = console.file if console is not None else sys.stderr
    if not (enabled and interactive(stream)):
        yield SectionProgress(titles)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]report"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[section]}"),
        console=console if console is not None else Console(stderr=True),
        transient=False,
    )
    with progress:
        yield SectionProgress(titles, progress)


def _get(metrics: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_rows(report: Report, wall_seconds: float) -> list[tuple[str, str]]:
    """The (quantity, value) rows of the demo summary, read from the report's metrics."""
    m = report.metrics
    shape = _get(m, "differentiation_showcase", "jacobian", "shape")
    mode = _get(m, "differentiation_showcase", "jacobian", "auto_mode")
    return [
        (
            "train / test examples",
            f"{_get(m, 'setup', 'train_examples')} / {_get(m, 'setup', 'test_examples')}",
        ),
        ("epochs", str(len(_get(m, "training", "epochs") or []))),
        ("final train loss", _fmt(_get(m, "training", "final", "train_loss"), ".4f")),
        ("final test loss", _fmt(_get(m, "training", "final", "test_loss"), ".4f")),
        ("final test accuracy", _fmt(_get(m, "training", "final", "test_accuracy"), ".3f")),
        ("input Jacobian", f"{shape}, mode=auto picked {mode}"),
        (
            "Hessian top eigenvalue",
            _fmt(_get(m, "differentiation_showcase", "hessian", "top_eigenvalue"), ".4g"),
        ),
        (
            "gradient norm",
            _fmt(_get(m, "differentiation_showcase", "hessian", "gradient_norm"), ".4g"),
        ),
        (
            "one HVP / one gradient",
            _fmt(_get(m, "differentiation_showcase", "hvp_cost", "hvp_over_gradient"), ".2f") + "x",
        ),
        ("wall time", f"{wall_seconds:.1f} s"),
    ]


def print_summary(report: Report, wall_seconds: float, *, stream: TextIO | None = None) -> None:
    """Print the summary table, then the report's path on a line of its own."""
    from rich.console import Console
    from rich.table import Table

    out = stream or sys.stdout
    table = Table(title="gradkit demo", show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in summary_rows(report, wall_seconds):
        table.add_row(name, value)
    Console(file=out).print(table)
    print(f"report: {report.directory / 'report.md'}", file=out)

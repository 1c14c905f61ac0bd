"""The run report (folder, figures, markdown, metrics) and the progress helpers."""

from __future__ import annotations

import datetime as dt
import io
import json
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure

from gradkit.cli._console import interactive, step_progress
from gradkit.cli._report import Plot, Report, figure_token, slug

pytestmark = pytest.mark.cpu_only  # the CLI runs its own jobs

NOW = dt.datetime(2024, 5, 6, 7, 8, 9)


LOSS = {"loss": "loss {:.4f}"}


def _figure() -> Figure:
    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [1, 0])
    return fig


def test_run_folders_are_timestamped_and_never_reused(tmp_path: Path) -> None:
    first = Report.open(tmp_path / "runs", "t", now=NOW)
    second = Report.open(tmp_path / "runs", "t", now=NOW)
    assert first.directory.name == "20240506-070809"
    assert second.directory.name == "20240506-070809-2"


def test_out_must_be_a_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        Report.open(tmp_path / "file", "t")


def test_sections_figures_and_metrics(tmp_path: Path) -> None:
    report = Report.open(tmp_path, "My run", header={"seed": 3}, now=NOW)
    report.add_section(
        "Loss curves",
        f"Before.\n\n{figure_token('inline')}\n\nAfter.",
        [Plot("inline", _figure(), "inline plot"), Plot("tail", _figure())],
        metrics={"t": torch.tensor([1.0, 2.0]), "nan": float("nan")},
    )
    report.add_section("Other", "text", key="custom")
    path = report.save()

    text = path.read_text(encoding="utf-8")
    assert text.startswith("# My run\n\n_seed: 3_")
    inline, tail = text.index("![inline plot](inline.png)"), text.index("![tail.png](tail.png)")
    assert text.index("Before.") < inline < text.index("After.") < tail < text.index("## Other")
    assert (report.directory / "inline.png").stat().st_size > 0

    metrics = json.loads((report.directory / "metrics.json").read_text())
    assert metrics == {"seed": 3, "loss_curves": {"t": [1.0, 2.0], "nan": None}, "custom": {}}


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "", "x" * 80])
def test_figure_names_stay_inside_the_run_folder(tmp_path: Path, name: str) -> None:
    report = Report.open(tmp_path, "t", now=NOW)
    with pytest.raises(ValueError, match="plain file stem"):
        report.add_section("S", "", [Plot(name, _figure())])
    assert list(report.directory.iterdir()) == []


def test_duplicate_figure_and_section_keys_raise(tmp_path: Path) -> None:
    report = Report.open(tmp_path, "t", now=NOW)
    report.add_section("S", "", [Plot("a", _figure())])
    with pytest.raises(ValueError, match="taken"):
        report.add_section("T", "", [Plot("a", _figure())])
    with pytest.raises(ValueError, match="already used"):
        report.add_section("S", "")


def test_slug() -> None:
    assert slug("Differentiation showcase") == "differentiation_showcase"
    assert slug("!!!") == "section"


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_an_interactive_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    monkeypatch.setenv("TERM", "xterm")
    assert not interactive(io.StringIO())
    assert interactive(_FakeTTY())

    quiet = Console(file=io.StringIO(), force_terminal=True)
    with step_progress("training", 3, fields=LOSS, enabled=True, console=quiet) as on_step:
        on_step(1, {"loss": 0.5})
    assert quiet.file.getvalue() == ""  # type: ignore[attr-defined]

    tty = _FakeTTY()
    with step_progress("training", 3, fields=LOSS, enabled=False, console=Console(file=tty)) as f:
        f(1, {"loss": 0.5})
    assert tty.getvalue() == ""

    wide = Console(file=tty, width=100)
    with step_progress("training", 3, fields=LOSS, enabled=True, console=wide) as on_step:
        for step in (1, 2, 3):
            on_step(step, {"loss": 0.25})
    shown = tty.getvalue()
    assert "training" in shown and "3/3" in shown and "loss 0.2500" in shown

    monkeypatch.setenv("TERM", "dumb")
    assert not interactive(_FakeTTY())

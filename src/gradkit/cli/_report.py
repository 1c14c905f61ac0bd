"""Run reports: a folder with ``report.md``, its PNG figures and ``metrics.json``.

A :class:`Report` owns one run folder, ``<out>/<timestamp>/``, created when the report is
opened and never left: figure names are checked, so every file lands inside it. Features add
what they show as sections::

    report = Report.open("runs", title="gradkit demo")
    report.add_section("Training", "Loss fell.", figures=[Plot("curves", fig, "Loss")],
                       metrics={"final_loss": 0.1})
    report.save()            # writes report.md and metrics.json

Figures are matplotlib ``Figure`` objects; they are rendered with the Agg canvas (no pyplot,
no global backend switch) and written at once, so a long report does not keep them in memory.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Plot", "Report", "Section", "figure_token", "slug"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def figure_token(name: str) -> str:
    """The placeholder that puts figure ``name`` at that spot of a section's markdown.

    Examples:
        >>> figure_token("saliency")
        '{{figure:saliency}}'
    """
    return "{{figure:" + name + "}}"


def slug(title: str) -> str:
    """A lowercase identifier for a title, used as its key in ``metrics.json``.

    Examples:
        >>> slug("Differentiation showcase")
        'differentiation_showcase'
        >>> slug("  Loss / accuracy (test)  ")
        'loss_accuracy_test'
    """
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_") or "section"


@dataclass(frozen=True)
class Plot:
    """A figure for a section: ``name`` (the PNG's file stem), the figure, and a caption."""

    name: str
    figure: Any
    caption: str = ""


@dataclass
class Section:
    """One section as added: title, markdown body, written figure files, metrics."""

    title: str
    markdown: str
    figures: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    metrics: dict[str, Any] = field(default_factory=dict)
    key: str = ""


def _jsonable(value: Any) -> Any:
    """``value`` with tensors, numpy scalars and non-finite floats made JSON-safe."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Report:
    """A markdown report in its own run folder; see the module docstring.

    Attributes:
        directory: the run folder (``<out>/<timestamp>``).
        title: the report's level-1 heading.
        sections: the sections added so far, in order.
        header: metadata written at the top of ``metrics.json`` and as the report's lead line.
    """

    def __init__(
        self, directory: Path, title: str, header: Mapping[str, Any] | None = None
    ) -> None:
        self.directory = directory
        self.title = title
        self.header: dict[str, Any] = dict(header or {})
        self.sections: list[Section] = []
        self._files: set[str] = set()

    @classmethod
    def open(
        cls,
        out: str | Path,
        title: str,
        header: Mapping[str, Any] | None = None,
        *,
        now: _dt.datetime | None = None,
    ) -> Report:
        """Create ``<out>/<timestamp>/`` (``-2``, ``-3``, ... if taken) and a report in it.

        Raises:
            NotADirectoryError: ``out`` exists and is not a folder.
        """
        root = Path(out)
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(f"{root} exists and is not a folder")
        root.mkdir(parents=True, exist_ok=True)
        stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        for attempt in range(1, 1000):
            directory = root / (stamp if attempt == 1 else f"{stamp}-{attempt}")
            try:
                directory.mkdir()
            except FileExistsError:
                continue
            return cls(directory, title, header)
        raise FileExistsError(f"{root}: no free run folder name for {stamp}")

    @property
    def metrics(self) -> dict[str, Any]:
        """Everything ``metrics.json`` holds: the header and each section's metrics by key."""
        out: dict[str, Any] = dict(self.header)
        for section in self.sections:
            out[section.key] = section.metrics
        return _jsonable(out)

    def add_section(
        self,
        title: str,
        markdown: str,
        figures: Sequence[Plot] = (),
        *,
        metrics: Mapping[str, Any] | None = None,
        key: str | None = None,
    ) -> Section:
        """Append a section; its figures are written to PNG files at once.

        Args:
            title: the level-2 heading.
            markdown: the body (may contain level-3 headings and tables).
            figures: plots, each written as ``<name>.png``; shown where the body has the line
                ``figure_token(name)`` (``{{figure:<name>}}``), else after the body.
            metrics: numbers stored under ``key`` in ``metrics.json``.
            key: the ``metrics.json`` key (default: :func:`slug` of the title).

        Raises:
            ValueError: a figure name that is not a plain file stem, or one already used;
                a key already used.
        """
        key = key or slug(title)
        if any(s.key == key for s in self.sections):
            raise ValueError(f"Report.add_section: key {key!r} is already used; pass key=")
        section = Section(title, markdown.strip(), metrics=dict(metrics or {}), key=key)
        for plot in figures:
            if not _NAME.match(plot.name):
                raise ValueError(
                    f"Report.add_section: figure name {plot.name!r} must be a "
                    "plain file stem (letters, digits, '_' or '-')"
                )
            filename = f"{plot.name}.png"
            if filename in self._files:
                raise ValueError(f"Report.add_section: figure name {plot.name!r} is taken")
            self._write_png(plot.figure, self.directory / filename)
            self._files.add(filename)
            section.figures.append((filename, plot.caption))
        self.sections.append(section)
        return section

    @staticmethod
    def _write_png(figure: Any, path: Path) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(figure)
        figure.savefig(path, dpi=110)

    def to_markdown(self) -> str:
        """The report as markdown (figures linked by relative file names)."""
        lines = [f"# {self.title}", ""]
        lead = ", ".join(
            f"{k}: {v}" for k, v in self.header.items() if isinstance(v, (str, int, float))
        )
        if lead:
            lines += [f"_{lead}_", ""]
        for section in self.sections:
            body, trailing = section.markdown, []
            for filename, caption in section.figures:
                image = f"![{caption or filename}]({filename})"
                if caption:
                    image += f"\n\n*{caption}*"
                token = figure_token(filename.removesuffix(".png"))
                if token in body:
                    body = body.replace(token, image)
                else:
                    trailing.append(image)
            lines += [f"## {section.title}", "", body, ""]
            for image in trailing:
                lines += [image, ""]
        return "\n".join(lines).rstrip() + "\n"

    def save(self) -> Path:
        """Write ``report.md`` and ``metrics.json``; returns the path of ``report.md``."""
        path = self.directory / "report.md"
        path.write_text(self.to_markdown(), encoding="utf-8")
        (self.directory / "metrics.json").write_text(
            json.dumps(self.metrics, indent=2, allow_nan=False) + "\n", encoding="utf-8"
        )
        return path

"""Where :class:`~gradkit.monitor.GradientMonitor` sends its records: a JSON-lines file, a
TensorBoard ``SummaryWriter``, or any callable taking the record."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gradkit._errors import describe, message

__all__ = ["JsonLinesWriter", "TensorBoardWriter", "Writer", "flat_scalars", "make_writers"]

Writer = Callable[[dict[str, Any]], None]


def flat_scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` for every number of a record except the step (``None`` left out):
    ``noise_scale``, ``layers/0/noise_scale``, ..."""
    for key, value in record.items():
        if key == "step":
            continue
        if key == "layers" and isinstance(value, dict):
            for layer, values in value.items():
                for k, v in values.items():
                    if isinstance(v, (int, float)):
                        yield f"layers/{layer}/{k}", float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (nested dicts and lists)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class JsonLinesWriter:
    """Append each record as one line of JSON to ``path`` (flushed at once, so a run that
    stops keeps every record written so far; ``gradkit monitor-report`` reads the file).

    Examples:
        >>> import json, tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "grads.jsonl"
        >>> write = JsonLinesWriter(path)
        >>> write({"step": 0, "noise_scale": 12.5})
        >>> json.loads(path.read_text())
        {'step': 0, 'noise_scale': 12.5}
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        call = "JsonLinesWriter(path)"
        self.path = Path(path)
        fix = "pass a file path in a folder you can write, e.g. runs/gradients.jsonl"
        if self.path.is_dir():
            raise ValueError(
                message(call, "path", "a file for JSON lines", f"the folder {str(path)!r}", fix)
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            got = f"{str(path)!r}, whose folder cannot be created ({err.strerror})"
            raise ValueError(message(call, "path", "a file path", got, fix)) from err
        if not os.access(self.path.parent, os.W_OK) or (
            self.path.exists() and not os.access(self.path, os.W_OK)
        ):
            got = f"{str(path)!r}, which cannot be written"
            raise ValueError(message(call, "path", "a writable file path", got, fix))

    def __call__(self, record: dict[str, Any]) -> None:
        # strict JSON: a NaN or inf (a NaN gradient's norm) is written as null, as the
        # undefined ratios are (JSON has no NaN; jq and JavaScript refuse the line)
        line = json.dumps(_finite(record), allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def __repr__(self) -> str:
        return f"JsonLinesWriter({str(self.path)!r})"


class TensorBoardWriter:
    """Every number of a record as a TensorBoard scalar ``<prefix>/<tag>`` at the record's
    step, through a ``torch.utils.tensorboard.SummaryWriter`` (or anything with
    ``add_scalar(tag, value, step)``)."""

    def __init__(self, summary_writer: Any, prefix: str = "gradkit") -> None:
        self.summary_writer = summary_writer
        self.prefix = prefix

    def __call__(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for tag, value in flat_scalars(record):
            self.summary_writer.add_scalar(f"{self.prefix}/{tag}", value, step)
        flush = getattr(self.summary_writer, "flush", None)
        if callable(flush):
            flush()


def _one(writer: Any, call: str) -> Writer:
    if isinstance(writer, (str, os.PathLike)):
        return JsonLinesWriter(writer)
    if callable(getattr(writer, "add_scalar", None)):
        return TensorBoardWriter(writer)
    if callable(writer):
        return writer
    raise TypeError(
        message(
            call,
            "writer",
            "None, a path (JSON lines), a TensorBoard SummaryWriter, a callable taking the "
            "record, or a list of these",
            describe(writer),
            "pass e.g. writer='runs/grads.jsonl' or writer=SummaryWriter()",
        )
    )


def make_writers(writer: Any, call: str) -> list[Writer]:
    """The writers ``writer`` names (a list gives several)."""
    if writer is None:
        return []
    if isinstance(writer, (list, tuple)):
        return [_one(w, call) for w in writer]
    return [_one(writer, call)]

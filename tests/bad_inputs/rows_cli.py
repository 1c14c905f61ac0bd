"""Bad inputs to the ``gradkit`` command line, run in-process: ``main(argv)``.

A failing row raises :class:`CliFailed` carrying the exit status and stderr, so the table checks
the status (``"exit 2"``) and the words of the one-line message; ``run`` itself raises
``AssertionError`` when stderr holds a traceback or more than one line of message (argparse's
usage line aside) or when a run folder was made. Data files are written on first use into one
temporary folder.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gradkit.cli import main
from gradkit.cli._hyperclean_data import load_source

from ._case import Case


class CliFailed(Exception):
    """``gradkit`` answered with a non-zero exit status; the message is ``exit N: stderr``."""


_ROOT: list[Path] = []


def _root() -> Path:
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="gradkit-cli-rows-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    return _ROOT[0]


def _mnist() -> dict[str, np.ndarray]:
    """uint8 6x6 'images' of 3 classes, MNIST's layout."""
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for part, n in (("train", 30), ("test", 12)):
        y = (np.arange(n) % 3).astype(np.uint8)
        arrays[f"x_{part}"] = rng.integers(0, 255, (n, 6, 6)).astype(np.uint8)
        arrays[f"y_{part}"] = y
    return arrays


def _npz(name: str, **changes: np.ndarray) -> Callable[[], str]:
    def write() -> str:
        path = _root() / name
        if not path.exists():
            np.savez(path, **{**_mnist(), **changes})
        return str(path)

    return write


def _raw(name: str, content: bytes) -> Callable[[], str]:
    def write() -> str:
        path = _root() / name
        path.write_bytes(content)
        return str(path)

    return write


def _with(key: str, index: int, value: float, dtype: type) -> np.ndarray:
    array = _mnist()[key].astype(dtype)
    array.flat[index] = value
    return array


def _cli(*argv: str | Callable[[], str]) -> Callable[[], object]:
    """A row's ``run``: ``main`` on ``argv`` (callables give paths written on first use)."""

    def run() -> object:
        args = [a() if callable(a) else a for a in argv]
        out = _root() / "runs"
        if "--out" not in args and args[0] in ("demo", "hyperclean"):
            args += ["--out", str(out)]
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:
                code = int(exc.code or 0)
        text = err.getvalue()
        assert "Traceback" not in text, text
        lines = [line for line in text.strip().splitlines() if line.startswith("gradkit")]
        assert len(lines) == 1, text  # one message line (after argparse's usage lines)
        assert not out.exists(), "a failing command made its run folder"
        if code:
            raise CliFailed(f"exit {code}: {lines[0]}")
        return code

    return run


def _reads_a_good_copy() -> None:
    """The oracle: a good .npz is read as written (flattened, scaled by 255)."""
    arrays = _mnist()
    source = load_source(_npz("good.npz")())
    want = torch.from_numpy(arrays["x_train"].reshape(30, 36) / 255.0).float()
    torch.testing.assert_close(source.x, want)
    assert torch.equal(source.y, torch.from_numpy(arrays["y_train"].astype(np.int64)))


def _quick(data: Callable[[], str]) -> tuple[str | Callable[[], str], ...]:
    return ("hyperclean", "--quick", "--no-progress", "--inner-steps", "1", "--data", data)


ROWS: list[Case] = [
    Case(
        "cli.hyperclean.data_label_far_beyond_the_classes",
        _cli(*_quick(_npz("huge.npz", y_train=_with("y_train", 0, 10**9, np.int64)))),
        CliFailed,
        ("exit 2", "huge.npz", "y_train", "1000000000", "number the classes"),
    ),
    Case(
        "cli.hyperclean.data_float_labels",
        _cli(*_quick(_npz("float.npz", y_train=_mnist()["y_train"].astype(np.float32)))),
        CliFailed,
        ("exit 2", "float.npz", "y_train", "integer class labels", "float32", "astype"),
    ),
    Case(
        "cli.hyperclean.data_negative_label",
        _cli(*_quick(_npz("negative.npz", y_train=_with("y_train", 2, -4, np.int64)))),
        CliFailed,
        ("exit 2", "negative.npz", "y_train", ">= 0", "-4"),
    ),
    Case(
        "cli.hyperclean.data_test_class_not_in_training",
        _cli(*_quick(_npz("unseen.npz", y_test=_with("y_test", 0, 3, np.int64)))),
        CliFailed,
        ("exit 2", "unseen.npz", "y_test", "0..2", "same class numbering"),
    ),
    Case(
        "cli.hyperclean.data_nan_inputs",
        _cli(*_quick(_npz("nan.npz", x_train=_with("x_train", 7, np.nan, np.float32)))),
        CliFailed,
        ("exit 2", "nan.npz", "x_train", "finite values", "repair"),
    ),
    Case(
        "cli.hyperclean.data_labels_and_images_of_other_lengths",
        _cli(*_quick(_npz("short.npz", y_train=_mnist()["y_train"][:20]))),
        CliFailed,
        ("exit 2", "short.npz", "y_train", "30 integer class labels", "(20,)"),
    ),
    Case(
        "cli.hyperclean.data_text_file",
        _cli(*_quick(_raw("text.npz", b"label,pixel\n1,0\n"))),
        CliFailed,
        ("exit 2", "text.npz", "text file", "np.savez"),
    ),
    Case(
        "cli.hyperclean.data_truncated_archive",
        _cli(*_quick(_raw("cut.npz", b"PK\x03\x04" + b"\x00" * 40))),
        CliFailed,
        ("exit 2", "cut.npz", "damaged", "again"),
    ),
    Case(
        "cli.hyperclean.data_missing_file",
        _cli(*_quick(lambda: str(_root() / "absent.npz"))),
        CliFailed,
        ("exit 2", "absent.npz", "no such file", "leave --data out"),
    ),
    Case("cli.hyperclean.data_good_copy_read_exactly", _reads_a_good_copy, None),
    Case(
        "cli.demo.epochs_zero",
        _cli("demo", "--epochs", "0"),
        CliFailed,
        ("exit 2", "--epochs", "1 to 1,000", "'0'"),
    ),
    Case(
        "cli.demo.threads_beyond_int32",
        _cli("demo", "--threads", "99999999999"),
        CliFailed,
        ("exit 2", "--threads", "1 to 1,024"),
    ),
    Case(
        "cli.hyperclean.inner_steps_not_an_integer",
        _cli("hyperclean", "--inner-steps", "1e3"),
        CliFailed,
        ("exit 2", "--inner-steps", "'1e3'"),
    ),
    Case(
        "cli.demo.out_under_a_file",
        _cli("demo", "--out", lambda: _raw("plain-file", b"x")() + "/runs"),
        CliFailed,
        ("exit 2", "--out", "is a file", "remove the file"),
    ),
    Case(
        "cli.hyperclean.out_with_nul",
        _cli("hyperclean", "--out", "runs\x00x"),
        CliFailed,
        ("exit 2", "--out", "\\x00", "write to"),
    ),
    Case(
        "cli.bench.out_under_a_file",
        _cli("bench", "--suite", "func", "--out", lambda: _raw("bench-file", b"x")() + "/r"),
        CliFailed,
        ("exit 2", "--out", "is a file"),
    ),
    Case(
        "cli.unknown_command",
        _cli("frobnicate"),
        CliFailed,
        ("exit 2", "invalid choice", "frobnicate"),
    ),
]

"""``gradkit hyperclean --data``: every unusable file is refused before anything runs.

Each case writes one broken local MNIST copy (``.npz`` or IDX folder) and checks the answer:
exit status 2, one line on stderr that names the file, the array and the problem and says what
to do, no traceback, and no run folder. A good copy next to each broken one is read exactly
(the oracle: the arrays as written, flattened and scaled by 255).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradkit.cli import main
from gradkit.cli._hyperclean_data import load_source

pytestmark = pytest.mark.cpu_only  # the CLI runs its own jobs

Arrays = dict[str, np.ndarray]


def _mnist(n_train: int = 40, n_test: int = 20, classes: int = 3) -> Arrays:
    """Separable uint8 6x6 'images' in MNIST's layout (every class in both sets)."""
    rng = np.random.default_rng(0)
    arrays: Arrays = {}
    for part, n in (("train", n_train), ("test", n_test)):
        y = (np.arange(n) % classes).astype(np.uint8)
        x = rng.integers(0, 60, (n, 6, 6)).astype(np.uint8)
        for c in range(classes):
            x[y == c, c * 2 : c * 2 + 2, :] += 180
        arrays[f"x_{part}"], arrays[f"y_{part}"] = x, y
    return arrays


def _edit(key: str, change: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], Path]:
    """A writer of an .npz whose array ``key`` went through ``change``."""

    def write(folder: Path) -> Path:
        arrays = _mnist()
        arrays[key] = change(arrays[key])
        path = folder / "mnist.npz"
        np.savez(path, **arrays)
        return path

    return write


def _set(index: int, value: Any, dtype: Any = np.int64) -> Callable[[np.ndarray], np.ndarray]:
    def change(a: np.ndarray) -> np.ndarray:
        out = a.astype(dtype)
        out.flat[index] = value
        return out

    return change


def _bytes(content: bytes, name: str = "mnist.npz") -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(content)
        return path

    return write


def _good_npz_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **_mnist())
    return buffer.getvalue()


def _npy_bytes() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, _mnist()["x_train"])
    return buffer.getvalue()


def _only(*keys: str) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        arrays = _mnist()
        path = folder / "mnist.npz"
        np.savez(path, **{k: arrays[k] for k in keys})
        return path

    return write


def _arrays(**arrays: np.ndarray) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        path = folder / "mnist.npz"
        np.savez(path, **{**_mnist(), **arrays})
        return path

    return write


_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    dtype = {0x08: ">u1", 0x0D: ">f4"}[code]
    return header + array.astype(dtype).tobytes()


def _idx(replace: dict[str, bytes] | None = None, drop: str = "") -> Callable[[Path], Path]:
    """A folder of IDX files; ``replace`` gives some files other bytes, ``drop`` leaves one out."""

    def write(folder: Path) -> Path:
        target = folder / "mnist"
        target.mkdir()
        arrays = _mnist()
        for key, name in _IDX_FILES.items():
            if key == drop:
                continue
            content = (replace or {}).get(key, _idx_bytes(arrays[key]))
            (target / name).write_bytes(content)
        return target

    return write


# (id, writer, words the one-line message must contain besides the path)
CASES: list[tuple[str, Callable[[Path], Path], tuple[str, ...]]] = [
    (
        "float_labels",
        _edit("y_train", lambda y: y.astype(np.float32)),
        ("y_train", "integer class labels", "float32", "astype"),
    ),
    (
        "huge_label",
        _edit("y_train", _set(0, 10**9)),
        ("y_train", "1000000000", "number the classes 0, 1, ..., c - 1"),
    ),
    (
        "negative_label",
        _edit("y_train", _set(3, -1)),
        ("y_train", ">= 0", "-1", "number the classes"),
    ),
    (
        "uint64_label_past_int64",
        _edit("y_train", _set(0, 2**64 - 1, np.uint64)),
        ("y_train", "18446744073709551615", "number the classes"),
    ),
    (
        "classes_with_a_gap",
        _edit("y_train", lambda y: np.where(y == 2, 7, y).astype(np.int64)),
        ("y_train", "missing 2, 3, 4, 5, 6", "renumber the classes"),
    ),
    (
        "test_label_not_a_training_class",
        _edit("y_test", _set(0, 5)),
        ("y_test", "0..2", "5", "same class numbering"),
    ),
    (
        "labels_shorter_than_images",
        _edit("y_train", lambda y: y[:-3]),
        ("y_train", "40 integer class labels", "(37,)", "one integer label per example"),
    ),
    (
        "nan_inputs",
        _edit("x_train", _set(5, np.nan, np.float64)),
        ("x_train", "finite values", "1 nan or infinite", "repair"),
    ),
    (
        "inputs_beyond_float32",
        _edit("x_train", _set(5, 1e300, np.float64)),
        ("x_train", "float32's range", "rescale"),
    ),
    (
        "bool_inputs",
        _edit("x_train", lambda x: x > 100),
        ("x_train", "numbers", "bool", "integers or floats"),
    ),
    (
        "no_examples",
        _arrays(x_train=np.zeros((0, 6, 6), np.uint8), y_train=np.zeros(0, np.int64)),
        ("x_train", "non-empty", "(0, 6, 6)", "one example per row"),
    ),
    (
        "one_value_per_example",
        _edit("x_train", lambda x: x[:, 0, 0]),
        ("x_train", "[n, ...]", "(40,)", "one example per row"),
    ),
    (
        "test_images_of_another_size",
        _edit("x_test", lambda x: x[:, :5, :5]),
        ("x_test", "36 values", "25 values", "same image size"),
    ),
    ("missing_arrays", _only("x_train", "y_train"), ("missing x_test, y_test", "np.savez")),
    (
        "object_array_needs_pickle",
        _arrays(y_train=np.array([object()] * 40, dtype=object)),
        ("without pickle", "store numbers"),
    ),
    ("text_file", _bytes(b"x,y\n1,2\n"), ("text file", "np.savez")),
    ("npy_file", _bytes(_npy_bytes()), ("single .npy array", "np.savez")),
    ("truncated_zip", _bytes(_good_npz_bytes()[:300]), ("damaged", "save the file again")),
    ("empty_file", _bytes(b""), ("empty file", "np.savez")),
    ("binary_junk", _bytes(b"\x00\xff\x10junk" * 4), ("a file starting with", "np.savez")),
    ("csv_extension", _bytes(b"1,2\n", "mnist.csv"), ("an .npz file", ".csv", "np.savez")),
    (
        "single_class",
        _arrays(y_train=np.zeros(40, np.uint8), y_test=np.zeros(20, np.uint8)),
        ("two or more classes", "a single class"),
    ),
    (
        "too_few_examples",
        _arrays(x_train=_mnist()["x_train"][:3], y_train=np.array([0, 1, 2], np.uint8)),
        ("1 training", "larger data set"),
    ),
    ("idx_folder_missing_a_file", _idx(drop="y_test"), ("four idx files", "t10k-labels")),
    (
        "idx_damaged_gzip",
        _idx({"x_train": b"\x1f\x8b\x08\x00" + b"\x00" * 12}),
        ("train-images-idx3-ubyte", "gzip", "again"),
    ),
    (
        "idx_bad_magic",
        _idx({"y_train": b"\x01\x02\x08\x01" + b"\x00" * 8}),
        ("train-labels-idx1-ubyte", "magic number", "original idx files"),
    ),
    (
        "idx_size_not_the_header_s",
        _idx({"x_train": _idx_bytes(_mnist()["x_train"])[:-7]}),
        ("train-images-idx3-ubyte", "the header says", "again"),
    ),
    (
        "idx_float_labels",
        _idx({"y_train": _idx_bytes(_mnist()["y_train"], 0x0D)}),
        ("train labels", "integer class labels", "float32", "astype"),
    ),
]


def _hyperclean(data: str, out: Path) -> tuple[int, str, str]:
    argv = ["hyperclean", "--no-progress", "--quick", "--data", data, "--out", str(out)]
    argv += ["--hyper-steps", "1", "--inner-steps", "1"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize(("write", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unusable_data_gives_one_line_and_exit_two(
    write: Callable[[Path], Path], words: tuple[str, ...], tmp_path: Path
) -> None:
    path = write(tmp_path)
    out = tmp_path / "runs"
    code, stdout, stderr = _hyperclean(str(path), out)
    assert code == 2, stderr
    assert stdout == ""
    line = stderr.strip()
    assert "\n" not in line and "Traceback" not in line, stderr
    assert line.startswith(f"gradkit hyperclean: --data {path}")
    missing = [w for w in words if w.lower() not in line.lower()]
    assert not missing, f"{missing} not in: {line}"
    assert not out.exists()  # refused before the run folder is made


@pytest.mark.parametrize("data", ["", "no-such-file.npz"])
def test_bad_paths_are_named(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, stderr = _hyperclean(data, tmp_path / "runs")
    assert code == 2
    assert stderr.count("\n") == 1 and "--data" in stderr
    assert ("leave --data out" in stderr) and ("no such file" in stderr or "''" in stderr)


def test_good_copies_are_read_exactly(tmp_path: Path) -> None:
    arrays = _mnist()
    npz = _arrays()(tmp_path)
    folder = _idx()(tmp_path)
    for source in (load_source(str(npz)), load_source(str(folder))):
        assert source.test_x is not None and source.test_y is not None
        for got, key in ((source.x, "x_train"), (source.test_x, "x_test")):
            want = torch.from_numpy(arrays[key].reshape(len(arrays[key]), -1) / 255.0)
            torch.testing.assert_close(got, want.float())
        assert torch.equal(source.y, torch.from_numpy(arrays["y_train"].astype(np.int64)))
        assert torch.equal(source.test_y, torch.from_numpy(arrays["y_test"].astype(np.int64)))


def test_gzipped_idx_with_a_damaged_body_is_refused(tmp_path: Path) -> None:
    good = gzip.compress(_idx_bytes(_mnist()["x_train"]))
    folder = _idx({"x_train": good[:-12]})(tmp_path)
    code, _, stderr = _hyperclean(str(folder), tmp_path / "runs")
    assert code == 2 and stderr.count("\n") == 1
    assert "gzip" in stderr and "unpack the file again" in stderr
    assert "Traceback" not in stderr

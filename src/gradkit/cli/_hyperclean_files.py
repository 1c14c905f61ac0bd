"""Local MNIST copies for ``gradkit hyperclean --data``: an ``.npz`` archive or a folder of IDX
files, checked before use.

Nothing is unpickled: ``.npz`` files are read with ``np.load(allow_pickle=False)`` after their
first bytes show a zip archive, IDX files by their documented header (magic number, big-endian
dimensions, then the values). Checks: the file is readable and of the expected format, the four
arrays are present, images are non-empty numbers ``[N, ...]`` with finite values and the same
size in both sets, labels are one integer per image, and the training labels are the classes
``0..C-1`` (each present) with the test labels among them. Every failure is a
:class:`DataError` whose one-line message names the file, the array, what was expected and
found, and what to do.

Shapes returned: features ``[N, D]`` float32 in [0, 1], labels ``[N]`` int64.
"""

from __future__ import annotations

import gzip
import math
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradkit._errors import message

__all__ = ["NPZ_FIX", "DataError", "fail", "one_line", "read_idx", "read_idx_folder", "read_npz"]

Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # x, y, test x, test y

_MAX_CLASSES = 1_000_000
_IDX_NAMES = {
    "x_train": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "y_train": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "x_test": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "y_test": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}
_IDX_TYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DataError(ValueError):
    """A data file that cannot be used (its message says which and why)."""


def fail(path: Path | str, key: str, expected: str, got: str, fix: str) -> DataError:
    """A :class:`DataError` worded ``--data PATH: KEY: expected ..., got ...; fix``."""
    shown = str(path) if str(path).strip() else repr(str(path))
    return DataError(message(f"--data {shown}", key, expected, got, fix))


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (its type name when it has none).

    Examples:
        >>> one_line(ValueError("two\\nlines"))
        'two lines'
    """
    return " ".join(str(err).split()) or type(err).__name__


def _features(x: np.ndarray, path: Path, key: str) -> torch.Tensor:
    if x.ndim < 2 or x.shape[0] == 0 or x.dtype.kind not in "uif":
        raise fail(
            path,
            key,
            "a non-empty array of numbers shaped [N, ...] (e.g. images [N, 28, 28])",
            f"dtype {x.dtype} and shape {x.shape}",
            "store one example per row as integers or floats",
        )
    if x.dtype.kind == "f" and not bool(np.isfinite(x).all()):
        bad = int(x.size - np.isfinite(x).sum())
        raise fail(
            path, key, "finite values", f"{bad} NaN or infinite", "drop or repair those examples"
        )
    limit = float(np.finfo(np.float32).max)
    if x.dtype.kind == "f" and float(np.abs(x).max()) > limit:
        raise fail(
            path,
            key,
            f"values within float32's range (|x| <= {limit:.3g})",
            f"{float(np.abs(x).max()):.3g}",
            "rescale the features (e.g. to [0, 1])",
        )
    flat = torch.from_numpy(np.ascontiguousarray(x.reshape(x.shape[0], -1), dtype=np.float32))
    top = float(flat.max())
    if x.dtype == np.uint8 or top > 1.0:
        flat = flat / (255.0 if top <= 255.0 else top)
    return flat


def _labels(y: np.ndarray, n: int, path: Path, key: str) -> torch.Tensor:
    if y.ndim != 1 or y.shape[0] != n or y.dtype.kind not in "ui":
        raise fail(
            path,
            key,
            f"{n} integer class labels shaped [{n}] (one per example)",
            f"dtype {y.dtype} and shape {y.shape}",
            "store one integer label per example, e.g. y.astype(np.int64)",
        )
    if y.size and int(y.min()) < 0:
        raise fail(
            path,
            key,
            "class labels >= 0",
            f"{int((y < 0).sum())} negative label(s), the smallest {int(y.min())}",
            "number the classes 0, 1, ..., C - 1",
        )
    if y.size and int(y.max()) >= _MAX_CLASSES:
        raise fail(
            path,
            key,
            f"class labels below {_MAX_CLASSES}",
            f"a label of {int(y.max())}",
            "number the classes 0, 1, ..., C - 1",
        )
    return torch.from_numpy(y.astype(np.int64))


def _check_classes(
    path: Path, train: tuple[str, torch.Tensor], test: tuple[str, torch.Tensor]
) -> None:
    """The training labels must be the classes 0..C-1, each present; test labels among them."""
    (train_key, y), (test_key, ty) = train, test
    present = torch.unique(y)
    classes = int(present.max()) + 1
    if len(present) != classes:
        missing = sorted(set(range(classes)) - set(present.tolist()))
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise fail(
            path,
            train_key,
            f"the classes 0..C-1 each present (labels reach {classes - 1}, so C = {classes})",
            f"{len(present)} distinct labels; missing {shown}",
            "renumber the classes 0, 1, ..., C - 1",
        )
    if len(ty) and int(ty.max()) >= classes:
        raise fail(
            path,
            test_key,
            f"labels among the {train_key} classes 0..{classes - 1}",
            f"a label of {int(ty.max())}",
            "use the same class numbering in both sets",
        )


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
NPZ_FIX = "save the arrays with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"


def _check_npz_bytes(path: Path) -> None:
    """Refuse a file that is not a zip archive before numpy reads it (numpy would take a text
    or ``.npy`` file for a pickle and say so)."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as err:
        raise fail(
            path,
            "file",
            "a readable .npz file",
            err.strerror or type(err).__name__,
            "check the path and its permissions",
        ) from None
    if head.startswith(_ZIP_MAGIC):
        return
    if head.startswith(_NPY_MAGIC):
        got = "a single .npy array (np.save)"
    elif not head:
        got = "an empty file"
    elif all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        got = "a text file"
    else:
        got = f"a file starting with {head[:4]!r}"
    raise fail(path, "file", "an .npz archive (a zip of .npy arrays)", got, NPZ_FIX)


def read_npz(path: Path) -> Arrays:
    """``(x_train, y_train, x_test, y_test)`` of an ``.npz`` archive, checked."""
    _check_npz_bytes(path)
    keys = ("x_train", "y_train", "x_test", "y_test")
    try:
        with path.open("rb") as handle, np.load(handle, allow_pickle=False) as archive:
            missing = [k for k in keys if k not in archive]
            if missing:
                raise fail(
                    path,
                    "keys",
                    "the arrays x_train, y_train, x_test, y_test",
                    f"{', '.join(archive.files) or 'no arrays'} (missing {', '.join(missing)})",
                    NPZ_FIX,
                )
            arrays = {k: archive[k] for k in keys}
    except DataError:
        raise
    except ValueError as err:  # object arrays need pickle: refused
        raise fail(
            path,
            "arrays",
            "plain numeric arrays (read without pickle)",
            f"an array numpy cannot read without pickle ({one_line(err)})",
            "store numbers, not Python objects",
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise fail(
            path,
            "file",
            "a complete .npz archive",
            f"a damaged one ({one_line(err)})",
            "copy or save the file again",
        ) from None
    x = _features(arrays["x_train"], path, "x_train")
    tx = _features(arrays["x_test"], path, "x_test")
    if x.shape[1] != tx.shape[1]:
        raise fail(
            path,
            "x_test",
            f"examples of {x.shape[1]} values, as in x_train",
            f"{tx.shape[1]} values per example",
            "give both sets the same image size",
        )
    y = _labels(arrays["y_train"], len(x), path, "y_train")
    ty = _labels(arrays["y_test"], len(tx), path, "y_test")
    _check_classes(path, ("y_train", y), ("y_test", ty))
    return x, y, tx, ty


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array, from its header: two zero bytes,
    a type code, the number of dimensions, then each dimension as a big-endian int32.

    Raises:
        DataError: the file cannot be read or is not a complete IDX file.
    """
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise fail(
            path,
            "file",
            "a readable IDX file",
            err.strerror or type(err).__name__,
            "check the path and its permissions",
        ) from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise fail(
                path,
                "file",
                "a complete gzip file",
                f"a damaged one ({one_line(err)})",
                "download or unpack the file again",
            ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise fail(
            path,
            "file",
            "an IDX file (magic number 0x0000 then a type code)",
            f"a file starting with {raw[:4]!r}",
            "pass MNIST's original IDX files",
        )
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise fail(
            path,
            "file",
            f"a header of {header} bytes",
            f"{len(raw)} bytes",
            "download or unpack the file again",
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    count = math.prod(dims)
    if min(dims) < 0 or len(raw) != header + count * dtype.itemsize:
        raise fail(
            path,
            "file",
            f"{header} header bytes and the {dims} values of {dtype.itemsize} byte(s) the "
            "header says",
            f"{len(raw) - header} bytes of data",
            "download or unpack the file again",
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header)
    return data.astype(dtype.newbyteorder("="), copy=False).reshape(dims)


def read_idx_folder(folder: Path) -> Arrays:
    """``(x_train, y_train, x_test, y_test)`` of a folder of MNIST IDX files, checked."""
    arrays: dict[str, np.ndarray] = {}
    for key, stems in _IDX_NAMES.items():
        candidates = [folder / (stem + suffix) for stem in stems for suffix in ("", ".gz")]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise fail(
                folder,
                "folder",
                "MNIST's four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, optionally .gz)",
                f"no {stems[0]} (or {stems[0]}.gz)",
                "pass the folder that holds them, or an .npz file",
            )
        arrays[key] = read_idx(found)
    x = _features(arrays["x_train"], folder, "train images")
    tx = _features(arrays["x_test"], folder, "test images")
    if x.shape[1] != tx.shape[1]:
        raise fail(
            folder,
            "test images",
            f"images of {x.shape[1]} pixels, as the train images",
            f"{tx.shape[1]} pixels",
            "give both sets the same image size",
        )
    y = _labels(arrays["y_train"], len(x), folder, "train labels")
    ty = _labels(arrays["y_test"], len(tx), folder, "test labels")
    _check_classes(folder, ("train labels", y), ("test labels", ty))
    return x, y, tx, ty

"""Data of ``gradkit hyperclean``: the digits bundled with scikit-learn, or a local MNIST copy
(``.npz`` or IDX files), split as in Franceschi et al. 2017 with half of the training labels
replaced by a wrong class.

Nothing is downloaded and nothing is unpickled: ``.npz`` files are read with
``np.load(allow_pickle=False)``, IDX files by their documented header (magic number, big-endian
dimensions, unsigned bytes). Shapes: features ``[N, D]`` float32 in [0, 1], labels ``[N]``.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["DataError", "HypercleanData", "Source", "load_source", "make_split"]

# the paper's MNIST protocol: 20,000 examples split 25 % / 25 % / 50 %
PAPER_TRAIN, PAPER_TEST = 5000, 10000  # and as many validation examples as training ones
QUICK_MNIST = (1000, 1000, 2000)
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


@dataclass(frozen=True)
class Source:
    """Examples before the split: ``test_*`` is None when the source has no test set of its
    own (the digits), else the source's official test set."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    test_x: torch.Tensor | None
    test_y: torch.Tensor | None


@dataclass(frozen=True)
class HypercleanData:
    """The split: training examples with corrupted labels, clean validation and test sets.

    ``y_train`` holds the labels the learner sees; ``y_train_true`` the original ones;
    ``corrupted[i]`` says whether example ``i``'s label was replaced.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    y_train_true: torch.Tensor
    corrupted: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    description: str

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(training, validation, test)`` examples."""
        return len(self.y_train), len(self.y_val), len(self.y_test)


def _digits() -> Source:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    return Source(
        "scikit-learn digits", x, torch.tensor(bunch.target, dtype=torch.long), None, None
    )


def _features(x: np.ndarray, path: Path, key: str) -> torch.Tensor:
    if x.ndim < 2 or x.shape[0] == 0 or x.dtype.kind not in "uif":
        raise DataError(
            f"--data {path}: {key}: expected a non-empty array of numbers shaped [N, ...], "
            f"got dtype {x.dtype} and shape {x.shape}"
        )
    flat = torch.from_numpy(np.ascontiguousarray(x.reshape(x.shape[0], -1), dtype=np.float32))
    if not bool(torch.isfinite(flat).all()):
        raise DataError(f"--data {path}: {key}: holds NaN or infinite values")
    top = float(flat.max())
    if x.dtype == np.uint8 or top > 1.0:
        flat = flat / (255.0 if top <= 255.0 else top)
    return flat


def _labels(y: np.ndarray, n: int, path: Path, key: str) -> torch.Tensor:
    if y.ndim != 1 or y.shape[0] != n or y.dtype.kind not in "ui":
        raise DataError(
            f"--data {path}: {key}: expected {n} integer class labels shaped [N], got dtype "
            f"{y.dtype} and shape {y.shape}"
        )
    labels = torch.from_numpy(y.astype(np.int64))
    if int(labels.min()) < 0:
        raise DataError(f"--data {path}: {key}: labels must be >= 0")
    return labels


def _npz(path: Path) -> Source:
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in archive]
            if missing:
                raise DataError(
                    f"--data {path}: expected the keys x_train, y_train, x_test, y_test, "
                    f"missing {', '.join(missing)} (found {', '.join(archive.files)})"
                )
            arrays = {k: archive[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except ValueError as err:  # object arrays need pickle: refused
        if isinstance(err, DataError):
            raise
        raise DataError(f"--data {path}: not a plain .npz of numeric arrays ({err})") from None
    except (OSError, EOFError) as err:
        raise DataError(f"--data {path}: cannot read it as .npz ({err})") from None
    x = _features(arrays["x_train"], path, "x_train")
    tx = _features(arrays["x_test"], path, "x_test")
    if x.shape[1] != tx.shape[1]:
        raise DataError(
            f"--data {path}: x_train and x_test have {x.shape[1]} and {tx.shape[1]} features"
        )
    y = _labels(arrays["y_train"], len(x), path, "y_train")
    ty = _labels(arrays["y_test"], len(tx), path, "y_test")
    return Source(f"{path.name} (.npz)", x, y, tx, ty)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array, from its header: two zero bytes,
    a type code, the number of dimensions, then each dimension as a big-endian int32."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise DataError(f"--data: {path}: a broken gzip file ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DataError(f"--data: {path}: not an IDX file (bad magic number)")
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(f"--data: {path}: a truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    count = math.prod(dims)
    if len(raw) != header + count * dtype.itemsize:
        raise DataError(
            f"--data: {path}: the header says {dims} values of {dtype.itemsize} byte(s), "
            f"the file holds {len(raw) - header} bytes of data"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header)
    return data.astype(dtype.newbyteorder("="), copy=False).reshape(dims)


def _idx_folder(folder: Path) -> Source:
    arrays: dict[str, np.ndarray] = {}
    for key, stems in _IDX_NAMES.items():
        candidates = [folder / (stem + suffix) for stem in stems for suffix in ("", ".gz")]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise DataError(
                f"--data {folder}: expected MNIST's IDX files in this folder; missing "
                f"{stems[0]} (or {stems[0]}.gz)"
            )
        arrays[key] = read_idx(found)
    x = _features(arrays["x_train"], folder, "train images")
    tx = _features(arrays["x_test"], folder, "test images")
    y = _labels(arrays["y_train"], len(x), folder, "train labels")
    ty = _labels(arrays["y_test"], len(tx), folder, "test labels")
    return Source(f"{folder.name} (IDX files)", x, y, tx, ty)


def load_source(data: str | None) -> Source:
    """The examples: the bundled digits (``data`` None), an ``.npz`` file with ``x_train``,
    ``y_train``, ``x_test``, ``y_test``, or a folder of MNIST IDX files.

    Raises:
        DataError: a path that does not exist, or a file that is not usable.
    """
    if data is None:
        return _digits()
    path = Path(data)
    if path.is_dir():
        return _idx_folder(path)
    if not path.is_file():
        raise DataError(f"--data {data}: no such file or folder")
    if path.suffix.lower() != ".npz":
        raise DataError(
            f"--data {data}: expected an .npz file (x_train, y_train, x_test, y_test) or a "
            "folder of MNIST IDX files"
        )
    return _npz(path)


def make_split(source: Source, seed: int, *, quick: bool) -> HypercleanData:
    """Split as the paper did, scaled to the source, and corrupt half the training labels.

    * Without a test set of its own (digits): the paper's proportions 25 % / 25 % / 50 % of
      all examples (its 5000 / 5000 / 10000 of 20,000 MNIST examples).
    * With one (MNIST): 5000 training and 5000 validation examples from the training set and
      the first 10,000 of the test set (``quick``: 1000 / 1000 / 2000).

    Half of the training examples (rounded down) get a label drawn uniformly from the other
    classes. Everything random follows ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    top = int(source.y.max())
    if source.test_y is not None:
        top = max(top, int(source.test_y.max()))
    num_classes = top + 1
    if num_classes < 2:
        raise DataError("--data: the labels name a single class; hyper-cleaning needs two or more")
    order = torch.randperm(len(source.y), generator=gen)
    if source.test_x is None or source.test_y is None:
        n = len(order)
        n_train = n_val = n // 4
        tr, va, te = order[:n_train], order[n_train : 2 * n_train], order[2 * n_train :]
        x_test, y_test = source.x[te], source.y[te]
        how = (
            f"{source.name}, {n} examples: the paper's 20,000-example MNIST split "
            f"(25 % / 25 % / 50 %: 5000 training / 5000 validation / 10,000 test) scaled by "
            f"{n}/20,000 to {n_train} / {n_val} / {len(te)}"
        )
    else:
        want_train, want_test = (
            (QUICK_MNIST[0], QUICK_MNIST[2]) if quick else (PAPER_TRAIN, PAPER_TEST)
        )
        n_train = n_val = min(want_train, len(order) // 2)
        tr, va = order[:n_train], order[n_train : n_train + n_val]
        n_test = min(want_test, len(source.test_y))
        x_test, y_test = source.test_x[:n_test], source.test_y[:n_test]
        how = (
            f"{source.name}: {n_train} training and {n_val} validation examples drawn from its "
            f"training set, the first {n_test} of its test set (the paper: 5000 / 5000 / 10,000)"
        )
    if n_train < 2 or n_val < 1 or len(y_test) < 1:
        raise DataError(
            f"--data: too few examples for a split ({n_train} training, {n_val} validation, "
            f"{len(y_test)} test)"
        )
    y_true = source.y[tr]
    n_bad = n_train // 2
    bad = torch.randperm(n_train, generator=gen)[:n_bad]
    shift = torch.randint(1, num_classes, (n_bad,), generator=gen)
    y_seen = y_true.clone()
    y_seen[bad] = (y_true[bad] + shift) % num_classes
    corrupted = torch.zeros(n_train, dtype=torch.bool)
    corrupted[bad] = True
    description = (
        f"{how}; {n_bad} of the {n_train} training labels replaced by a uniformly drawn wrong "
        f"class; seed {seed}"
    )
    return HypercleanData(
        source.x[tr],
        y_seen,
        y_true,
        corrupted,
        source.x[va],
        source.y[va],
        x_test,
        y_test,
        num_classes,
        description,
    )

"""Data of ``gradkit hyperclean``: the digits bundled with scikit-learn, or a local MNIST copy
(``.npz`` or IDX files), split as in Franceschi et al. 2017 with half of the training labels
replaced by a wrong class.

Nothing is downloaded and nothing is unpickled: local files are read and checked by
:mod:`gradkit.cli._hyperclean_files`. Shapes: features ``[N, D]`` float32 in [0, 1], labels
``[N]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gradkit._digits import bundled_digits
from gradkit.cli._hyperclean_files import (
    NPZ_FIX,
    DataError,
    fail,
    one_line,
    read_idx,
    read_idx_folder,
    read_npz,
)

__all__ = ["DataError", "HypercleanData", "Source", "load_source", "make_split", "read_idx"]

# the paper's MNIST protocol: 20,000 examples split 25 % / 25 % / 50 %
PAPER_TRAIN, PAPER_TEST = 5000, 10000  # and as many validation examples as training ones
QUICK_MNIST = (1000, 1000, 2000)


@dataclass(frozen=True)
class Source:
    """Examples before the split: ``test_*`` is None when the source has no test set of its
    own (the digits), else the source's official test set; ``origin`` is the ``--data`` path
    (empty for the digits)."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    test_x: torch.Tensor | None
    test_y: torch.Tensor | None
    origin: str = ""


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
    x, y = bundled_digits()
    return Source("scikit-learn digits", x / 16.0, y, None, None)


def load_source(data: str | None) -> Source:
    """The examples: the bundled digits (``data`` None), an ``.npz`` file with ``x_train``,
    ``y_train``, ``x_test``, ``y_test``, or a folder of MNIST IDX files.

    Raises:
        DataError: a path that does not exist, or a file that is not usable.
    """
    if data is None:
        return _digits()
    if not data.strip() or "\x00" in data:
        raise fail(
            data,
            "path",
            "the path of an .npz file or of a folder of MNIST IDX files",
            repr(data),
            "leave --data out to use the bundled digits",
        )
    path = Path(data)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as err:  # e.g. a name too long for the file system
        raise fail(data, "path", "a usable path", one_line(err), "check the path") from None
    if is_dir:
        return Source(f"{path.name} (IDX files)", *read_idx_folder(path), origin=data)
    if not is_file:
        raise fail(
            data,
            "path",
            "an existing .npz file or folder of MNIST IDX files",
            "no such file or folder",
            "check the path, or leave --data out to use the bundled digits",
        )
    if path.suffix.lower() != ".npz":
        raise fail(
            data,
            "file",
            "an .npz file (x_train, y_train, x_test, y_test) or a folder of MNIST IDX files",
            f"a {path.suffix} file" if path.suffix else "a file without an extension",
            NPZ_FIX,
        )
    return Source(f"{path.name} (.npz)", *read_npz(path), origin=data)


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
        raise fail(
            source.origin or source.name,
            "labels",
            "two or more classes",
            "a single class",
            "hyper-cleaning replaces labels by other classes: pass data with several",
        )
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
        raise fail(
            source.origin or source.name,
            "examples",
            "enough examples for 2 training, 1 validation and 1 test example",
            f"{n_train} training, {n_val} validation, {len(y_test)} test",
            "pass a larger data set",
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

"""The bundled dataset and model the demo, the hyper-cleaning experiment and the benchmarks
share: scikit-learn's digits (1797 grey 8x8 images, values 0..16, ten classes; they ship
inside scikit-learn, so nothing is downloaded) and a small CNN for them.

Shapes: images ``[N, 1, 8, 8]`` scaled to [0, 1], labels ``[N]``. The split follows one seed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = ["Digits", "bundled_digits", "load_digits", "make_model", "stratified_split"]


@dataclass(frozen=True)
class Digits:
    """A train/test split of the digits: images ``[N, 1, 8, 8]`` float32, labels ``[N]``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def sizes(self) -> tuple[int, int]:
        """``(train examples, test examples)``."""
        return len(self.y_train), len(self.y_test)


def bundled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits: values ``[1797, 64]`` float32 in 0..16, labels ``[1797]``.

    Read from scikit-learn's own data file (``sklearn/datasets/data/digits.csv.gz``, what
    ``sklearn.datasets.load_digits`` reads) without importing scikit-learn, which takes about
    a second; falls back to ``load_digits`` if the file is not where it has always been.
    """
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return torch.tensor(table[:, :-1], dtype=torch.float32), torch.tensor(
                table[:, -1].astype(np.int64)
            )
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return torch.tensor(bunch.data, dtype=torch.float32), torch.tensor(bunch.target)


def stratified_split(
    y: torch.Tensor, test_fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train indices, test indices)``, each in random order, with ``round(test_fraction *
    n_c)`` of the ``n_c`` examples of every class ``c`` in the test part.

    Examples:
        >>> y = torch.tensor([0] * 8 + [1] * 4)
        >>> tr, te = stratified_split(y, 0.25, torch.Generator().manual_seed(0))
        >>> sorted(y[te].tolist()), len(tr)
        ([0, 0, 1], 9)
    """
    # drawn on the generator's device (a CUDA default device must not take a CPU generator)
    order = torch.randperm(len(y), generator=generator, device=generator.device).to(y.device)
    test = torch.zeros(len(y), dtype=torch.bool, device=y.device)
    for c in torch.unique(y):
        members = order[y[order] == c]
        test[members[: round(test_fraction * len(members))]] = True
    return order[~test[order]], order[test[order]]


def load_digits(
    seed: int,
    *,
    test_fraction: float = 0.25,
    max_train: int | None = None,
    max_test: int | None = None,
) -> Digits:
    """Load the bundled digits and split them, stratified by class, with ``seed``.

    ``max_train`` / ``max_test`` keep the first examples of each (shuffled) split.
    """
    values, y = bundled_digits()
    x = values.reshape(-1, 1, 8, 8) / 16.0
    tr, te = stratified_split(y, test_fraction, torch.Generator().manual_seed(seed))
    tr, te = tr[:max_train], te[:max_test]
    return Digits(x[tr], y[tr], x[te], y[te])


def make_model(num_classes: int = 10) -> nn.Sequential:
    """The demo CNN for ``[N, 1, 8, 8]`` inputs: two 3x3 convolutions, two linear layers.

    Shapes: ``[N,1,8,8] -> conv -> [N,8,6,6] -> conv -> [N,16,4,4] -> [N,256] -> [N,64]
    -> [N,num_classes]`` (18,346 parameters for ten classes).

    Examples:
        >>> import torch
        >>> make_model()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )

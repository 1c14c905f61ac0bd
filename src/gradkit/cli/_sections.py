"""The protocol of the demo's sections: the settings (:class:`DemoConfig`), what a section
reads (:class:`DemoContext`) and its type (:data:`Section`). The sections live in the modules
of their features; :mod:`._demo` lists and runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradkit._digits import Digits
from gradkit.cli._report import Report
from gradkit.cli._train import TrainResult

__all__ = ["DemoConfig", "DemoContext", "Section", "section_title"]


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings; :meth:`from_args` fills quick-mode defaults."""

    out: str = "runs"
    quick: bool = False
    epochs: int = 6
    seed: int = 0
    threads: int | None = None
    progress: bool = True
    batch_size: int = 32
    lr: float = 1e-2
    max_train: int | None = None
    max_test: int | None = None
    hessian_batch: int = 512
    power_steps: int = 30
    timing_repeats: int = 20
    stats_every: int = 5
    hyper_inner_steps: int = 200
    hyper_steps: int = 60
    hyper_lr: float = 0.02
    rtho_steps: int = 400

    @classmethod
    def from_args(
        cls,
        *,
        out: str,
        quick: bool,
        epochs: int | None,
        seed: int,
        threads: int | None,
        progress: bool,
    ) -> DemoConfig:
        """Settings from the command line; ``--quick`` trains 2 epochs on 640 examples."""
        if quick:
            return cls(
                out=out,
                quick=True,
                epochs=epochs or 2,
                seed=seed,
                threads=threads,
                progress=progress,
                max_train=640,
                max_test=300,
                hessian_batch=256,
                power_steps=12,
                timing_repeats=5,
                stats_every=2,
                hyper_inner_steps=60,
                hyper_steps=15,
                hyper_lr=0.1,
                rtho_steps=100,
            )
        return cls(
            out=out, epochs=epochs or cls.epochs, seed=seed, threads=threads, progress=progress
        )


@dataclass
class DemoContext:
    """What the sections read: settings, data, the trained model and its history.

    ``extras`` is for sections that share results with later ones (e.g. statistics gathered
    during training); keys are the producing section's name. ``note(text)`` shows what a
    long section is doing next to the progress bar (it does nothing without one).
    """

    config: DemoConfig
    data: Digits
    model: nn.Module
    result: TrainResult
    generator: torch.Generator
    train_seconds: float
    extras: dict[str, Any] = field(default_factory=dict)
    note: Callable[[str], None] = field(default=lambda text: None)


Section = Callable[[DemoContext, Report], None]


def section_title(section: Section) -> str:
    """The name the progress bar shows for a section function.

    Examples:
        >>> def accumulation_section(ctx, report): ...
        >>> section_title(accumulation_section)
        'accumulation'
    """
    name = getattr(section, "__name__", "section")
    return name.removesuffix("_section").replace("_", " ")

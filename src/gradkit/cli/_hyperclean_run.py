"""``gradkit hyperclean``: run the experiment of a :class:`HypercleanConfig` and write its
run folder (the report itself is :mod:`._hyperclean_report`).

The run folder ``<out>/<timestamp>/`` holds ``report.md`` and ``results.json`` (the headline
numbers first: ``baseline_accuracy``, ``oracle_accuracy``, ``cleaned_accuracy``, ``f1``, ...;
then settings, history and the learned weights). Nothing is written elsewhere.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from gradkit import __version__
from gradkit._scope import torch_scope
from gradkit.cli._console import step_progress
from gradkit.cli._hyperclean import HypercleanConfig, hyperclean
from gradkit.cli._hyperclean_data import load_source, make_split
from gradkit.cli._hyperclean_report import hyperclean_figures, report_markdown
from gradkit.cli._report import Report

__all__ = ["run_hyperclean"]


def run_hyperclean(config: HypercleanConfig, *, console: Any = None) -> tuple[Path, dict[str, Any]]:
    """Run the experiment of ``config`` and write its run folder.

    Returns:
        ``(run folder, results)``; ``results`` is what ``results.json`` holds.

    Raises:
        DataError: ``config.data`` names a file that cannot be used.
    """
    started = time.perf_counter()
    with torch_scope(config.threads):
        torch.manual_seed(config.seed)
        data = make_split(load_source(config.data), config.seed, quick=config.quick)
        report = Report.open(
            Path(config.out),
            "gradkit hyperclean",
            header={
                "gradkit": __version__,
                "torch": torch.__version__,
                "seed": config.seed,
                "mode": "quick" if config.quick else "full",
                "threads": torch.get_num_threads(),
            },
        )
        with step_progress(
            "hyper-cleaning",
            config.hyper_steps,
            fields={"outer_loss": "validation loss {:.4f}", "f1": "F1 {:.3f}"},
            enabled=config.progress,
            console=console,
        ) as on_step:
            result = hyperclean(
                data,
                inner_steps=config.inner_steps,
                hyper_steps=config.hyper_steps,
                lr=config.lr,
                hyper_lr=config.hyper_lr,
                threshold=config.threshold,
                on_step=on_step,
            )
        wall = time.perf_counter() - started
        report.header["seconds"] = round(wall, 2)
        report.add_section(
            "Data hyper-cleaning",
            report_markdown(config, data, result),
            hyperclean_figures(result, data),
        )
    n_train, n_val, n_test = data.sizes
    results: dict[str, Any] = {
        **result.summary(),
        "detection": result.detection,
        "data": {
            "description": data.description,
            "train": n_train,
            "validation": n_val,
            "test": n_test,
            "classes": data.num_classes,
            "features": int(data.x_train.shape[1]),
        },
        "config": {
            "quick": config.quick,
            "data": config.data,
            "seed": config.seed,
            "threads": config.threads,
            "inner_steps": config.inner_steps,
            "hyper_steps": config.hyper_steps,
            "lr": config.lr,
            "hyper_lr": config.hyper_lr,
            "threshold": config.threshold,
        },
        "versions": {"gradkit": __version__, "torch": torch.__version__},
        "seconds": {**result.seconds, "wall": wall},
        "history": result.history,
        "weights": result.weights.tolist(),
        "corrupted_indices": data.corrupted.nonzero()[:, 0].tolist(),
    }
    (report.directory / "report.md").write_text(report.to_markdown(), encoding="utf-8")
    (report.directory / "results.json").write_text(
        json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8"
    )
    return report.directory, results

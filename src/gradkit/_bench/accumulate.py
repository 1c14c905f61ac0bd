"""The accumulate suite: :class:`gradkit.accumulate.Accumulator` against a hand-written correct
accumulation loop on the demo CNN, and the activation memory of one micro-step against the
number of micro-batches."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._bench._case import Case, Method, Target
from gradkit._digits import make_model
from gradkit.accumulate import Accumulator, activation_bytes

__all__ = ["build_cases"]

BATCH, MICRO = 256, 32


def _loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def _keeper(model: nn.Module) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """An SGD with lr=0 (parameters never move) that keeps the last gradient it stepped on."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kept: list[torch.Tensor] = []

    def keep(*_: Any) -> None:
        kept[:] = [
            torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        ]

    opt.register_step_pre_hook(keep)
    return opt, kept


def _overhead_case(base: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Case:
    def hand_written() -> Callable[[], torch.Tensor]:
        model = copy.deepcopy(base)
        opt, kept = _keeper(model)
        x, y = batch

        def run() -> torch.Tensor:
            for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
                (_loss_sum(model, (xb, yb)) / BATCH).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return kept[0]

        return run

    def with_gradkit() -> Callable[[], torch.Tensor]:
        model = copy.deepcopy(base)
        opt, kept = _keeper(model)
        acc = Accumulator(model, opt)

        def run() -> torch.Tensor:
            for mb in acc.split(batch, micro_batch_size=MICRO):
                with acc.micro_step():
                    acc.backward(_loss_sum(model, mb))
            acc.step()
            return kept[0]

        return run

    def one_pass() -> Callable[[], torch.Tensor]:
        model = copy.deepcopy(base)
        opt, kept = _keeper(model)

        def run() -> torch.Tensor:
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return kept[0]

        return run

    def curve(_: dict[str, torch.Tensor]) -> dict[str, Any]:
        model = copy.deepcopy(base)
        points: list[dict[str, float]] = []
        for k in (1, 2, 4, 8, 16, 32):
            size = BATCH // k
            part = (batch[0][:size], batch[1][:size])
            points.append(
                {
                    "micro_batches": k,
                    "micro_batch_size": size,
                    "activation_bytes": activation_bytes(model, _loss_sum, part),
                }
            )
        full = points[0]["activation_bytes"]
        for p in points:
            p["fraction_of_one_pass"] = p["activation_bytes"] / full
        return {"activation_memory_curve": points}

    return Case(
        key="accumulate_overhead",
        title=f"Accumulation of a batch of {BATCH} as {BATCH // MICRO} micro-batches of {MICRO}"
        " on the demo CNN (18,346 parameters, 1x8x8 inputs)",
        setup={
            "model": "demo CNN",
            "batch": BATCH,
            "micro_batch": MICRO,
            "loss": "cross entropy (summed per micro-batch, divided by the batch)",
            "dtype": "float32",
        },
        methods=[
            Method(
                "hand",
                "hand-written correct loop ((loss_sum / N).backward(), step)",
                hand_written(),
            ),
            Method(
                "gradkit",
                "gradkit.accumulate.Accumulator (split, micro_step, step)",
                with_gradkit(),
            ),
            Method("one_pass", "one pass over the whole batch (for scale)", one_pass()),
        ],
        baseline=("hand",),
        reference="one_pass",
        dtype=torch.float32,
        targets=[Target("Accumulator / hand-written loop", "gradkit", ("hand",), "<=", 1.03)],
        notes=[
            "The JSON's extras hold the activation memory of one micro-step (bytes saved "
            "for backward) for 1 to 32 micro-batches: it falls as 1/k."
        ],
        extras=curve,
    )


def build_cases() -> list[Case]:
    """All cases of the suite (model and data drawn from the current torch RNG state)."""
    base = make_model()
    batch = (torch.rand(BATCH, 1, 8, 8), torch.randint(0, 10, (BATCH,)))
    return [_overhead_case(base, batch)]

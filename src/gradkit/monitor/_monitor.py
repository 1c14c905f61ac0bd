"""``GradientMonitor``: statistics of the individual gradients of one step in every ``k``,
summarized and logged, with nothing installed on the other steps."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import check_bool, check_int, check_module
from gradkit.monitor._summary import _layer, summarize
from gradkit.monitor._writers import make_writers
from gradkit.per_example import Tracker, track

__all__ = ["GradientMonitor", "MonitorStep", "check_options", "read_records"]

_CALL = "GradientMonitor(model, ...)"


def check_options(
    call: str,
    *,
    quantities: Any,
    every: Any,
    layers: Any,
    loss_reduction: Any,
    scale_to_grad: Any,
    optimizer: Any,
    lr: Any,
) -> None:
    """Check the options of a :class:`GradientMonitor` (not the model, the writer or the
    options of ``track``), naming ``call`` in the errors: the trainer callbacks check theirs
    when they are made, before they have a model."""
    if isinstance(quantities, str) or not all(isinstance(q, str) for q in quantities):
        raise TypeError(
            message(
                call,
                "quantities",
                "a tuple of quantity names",
                describe(quantities),
                "pass e.g. quantities=('variance', 'batch_l2')",
            )
        )
    if "variance" not in quantities:
        raise ValueError(
            message(
                call,
                "quantities",
                "'variance' among them (the norm, noise scale and SNR need it)",
                repr(tuple(quantities)),
                "pass e.g. quantities=('variance', 'batch_l2')",
            )
        )
    check_int(every, call, "every", low=1, example=10)
    check_bool(layers, call, "layers")
    check_bool(scale_to_grad, call, "scale_to_grad")
    if scale_to_grad and loss_reduction != "sum":
        raise ValueError(
            message(
                call,
                "scale_to_grad",
                "False unless loss_reduction='sum' (the individual gradients are the "
                "shares of the summed loss, then scaled)",
                "True with loss_reduction=" + repr(loss_reduction),
                "pass loss_reduction='sum' with scale_to_grad=True",
            )
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            message(
                call,
                "optimizer",
                "None or a torch.optim.Optimizer",
                describe(optimizer),
                "pass the model's optimizer",
            )
        )
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
        raise ValueError(message(call, "lr", "None or a number > 0", repr(lr), "pass e.g. lr=1e-3"))


@dataclass
class MonitorStep:
    """One step of a :class:`GradientMonitor` (what ``with monitor.step() as s`` gives).

    Attributes:
        index: the step's number.
        tracked: whether this step's individual gradients are tracked.
        stats: the step's :class:`~gradkit.per_example.Tracker` (None on untracked steps).
        loss: set it to the step's training loss (a float or a scalar tensor) for the CABS
            batch size and the ``loss`` entry of the record.
        record: the logged record, once the block has ended (None on untracked steps).
    """

    index: int
    tracked: bool
    stats: Tracker | None = None
    loss: Any = None
    record: dict[str, Any] | None = field(default=None, repr=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class GradientMonitor:
    """Gradient statistics over training: one step in every ``every`` is tracked with
    :func:`gradkit.per_example.track` and summarized (whole model and per layer: gradient
    norm, noise scale ``B_simple``, median SNR, quantiles of the per-example norms, the CABS
    batch size), then logged.

    Untracked steps cost nothing: no hook is installed on them (the block is a plain
    ``with``). A tracked step costs what ``track`` costs; all backward passes inside its block
    (micro-batches) are merged exactly, and with ``torch.distributed`` initialized the ranks
    are merged (``stats.all_reduce``: every rank must run the tracked steps).

    Args:
        model: the model whose parameters to watch.
        quantities: what ``track`` computes; ``"variance"`` is needed (norm, noise scale,
            SNR); ``"batch_l2"`` adds the per-example norm quantiles.
        every: track steps ``0, every, 2 every, ...`` (an int >= 1).
        writer: where records go: None (kept in :attr:`records` only), a path (one JSON line
            per record: :class:`JsonLinesWriter`), a TensorBoard ``SummaryWriter``, a callable
            taking the record, or a list of these. Only rank 0 writes.
        optimizer: its first group's ``lr`` is the learning rate of the CABS batch size.
        lr: the learning rate, when there is no ``optimizer``.
        layers: also summarize each layer (parameters grouped by module).
        loss_reduction: as for ``track``: ``"mean"`` or ``"sum"``.
        scale_to_grad: with ``loss_reduction="sum"``, take each example's share of the
            backpropagated loss (whatever the loss was divided by: its own mean, a token count,
            the number of micro-batches) and its gradient times the step's number of examples,
            so that the individual gradients' mean is the gradient the step's backward passes
            summed into ``.grad``: what trainers that normalize the loss themselves need. The
            noise scale and the SNR do not depend on the scale. A backward whose loss is a
            micro-batch's mean, scaled (divided by the number of micro-batches), is read as a
            mean instead, times the number of backward passes: the examples' own gradients,
            also for micro-batches of different sizes.
        group: the process group for merging ranks (default: the world).
        **track_options: further keyword arguments of :func:`gradkit.per_example.track`
            (``batch_dim``, ``fallback``, ``max_memory``, ...).

    Attributes:
        records: every record logged so far (on every rank).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.monitor import GradientMonitor
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> monitor = GradientMonitor(model, every=2, optimizer=opt)
        >>> for i in range(4):
        ...     x, y = torch.randn(16, 4), torch.randn(16, 1)
        ...     with monitor.step() as step:
        ...         loss = nn.functional.mse_loss(model(x), y)
        ...         loss.backward()
        ...         step.loss = loss
        ...     opt.step()
        ...     opt.zero_grad()
        >>> [r["step"] for r in monitor.records], monitor.records[0]["examples"]
        ([0, 2], 16)
        >>> sorted(monitor.records[0]["layers"])
        ['0', '2']
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: Sequence[str] = ("variance", "batch_l2"),
        *,
        every: int = 1,
        writer: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr: float | None = None,
        layers: bool = True,
        loss_reduction: str = "mean",
        scale_to_grad: bool = False,
        group: Any = None,
        **track_options: Any,
    ) -> None:
        check_module(model, _CALL, "pass the model being trained")
        check_options(
            _CALL,
            quantities=quantities,
            every=every,
            layers=layers,
            loss_reduction=loss_reduction,
            scale_to_grad=scale_to_grad,
            optimizer=optimizer,
            lr=lr,
        )
        self.every = check_int(every, _CALL, "every", low=1, example=10)
        self.model = model
        self.quantities = tuple(quantities)
        self.optimizer = optimizer
        self.lr = lr
        self.layers = layers
        self.scale_to_grad = scale_to_grad
        self._warned_mixed = False  # see _share_scale
        self._warned_empty = False  # see _empty_record
        self.group = group
        self._track = {"loss_reduction": loss_reduction, **track_options}
        self._writers = make_writers(writer, _CALL)
        self.records: list[dict[str, Any]] = []
        self._next = 0
        self._open: tuple[MonitorStep, contextlib.ExitStack] | None = None
        # the options are checked now, not at the first tracked step
        track(model, *self.quantities, **self._track)

    def __repr__(self) -> str:
        return (
            f"GradientMonitor(every={self.every}, quantities={self.quantities}, "
            f"records={len(self.records)})"
        )

    def tracks(self, index: int) -> bool:
        """Whether step ``index`` is tracked."""
        return index % self.every == 0

    # -- the step as a pair of calls (for trainers' hooks) ------------------------------------

    def begin(self, index: int | None = None) -> MonitorStep:
        """Start step ``index`` (default: the one after the last): on a tracked step, install
        ``track``'s hooks until :meth:`end`."""
        if self._open is not None:
            raise GradkitError(
                f"GradientMonitor.begin(): step {self._open[0].index} is still open; end it "
                "with monitor.end() (or use `with monitor.step():`)"
            )
        if index is None:
            index = self._next
        index = check_int(index, "GradientMonitor.begin(index)", "index", low=0)
        self._next = index + 1
        current = MonitorStep(index, self.tracks(index))
        scope = contextlib.ExitStack()
        if current.tracked:
            tracker = track(self.model, *self.quantities, **self._track)
            # the shares of any loss, mean or divided by hand, are rescaled in the summary
            tracker.verify_reduction = not self.scale_to_grad
            tracker.read_means = self.scale_to_grad
            current.stats = scope.enter_context(tracker)
        self._open = (current, scope)
        return current

    def end(
        self, *, loss: Any = None, failed: bool = False, divided_by: int | None = None
    ) -> dict[str, Any] | None:
        """End the open step; on a tracked one, summarize, log and return its record
        (``failed=True``: remove the hooks and log nothing).

        ``divided_by`` (with ``scale_to_grad=True``): the count each micro-batch's mean loss
        was divided by, where it is not the number of backward passes of the step (Lightning
        divides by ``accumulate_grad_batches`` also in an epoch's shorter last window). None:
        the number of passes."""
        if self._open is None:
            raise GradkitError("GradientMonitor.end(): no step is open; call monitor.begin()")
        if divided_by is not None:
            check_int(divided_by, "GradientMonitor.end(...)", "divided_by", low=1)
        current, scope = self._open
        self._open = None
        if loss is not None:
            current.loss = loss
        if failed:
            scope.__exit__(GradkitError, GradkitError("step failed"), None)
            return None
        scope.close()
        if current.stats is None:
            return None
        current.record = self._summarize(current, divided_by)
        return current.record

    @contextlib.contextmanager
    def step(self, index: int | None = None) -> Iterator[MonitorStep]:
        """One training step: run its forward and backward passes (all its micro-batches)
        inside the block."""
        current = self.begin(index)
        try:
            yield current
        except BaseException:
            self.end(failed=True)
            raise
        self.end()

    # -- the record ----------------------------------------------------------------------------

    def _learning_rate(self) -> float | None:
        if self.optimizer is not None:
            value = self.optimizer.param_groups[0].get("lr")
            return float(value) if value is not None else None
        return None if self.lr is None else float(self.lr)

    def _share_scale(self, index: int, stats: Any, divided_by: int | None = None) -> float:
        """The factor from the tracked shares to the individual gradients (``scale_to_grad``).
        Passes whose loss is a sum over their items divided by a count common to the step: the
        step's examples (the shares' mean is then ``.grad``). Passes whose loss is each
        micro-batch's mean, scaled (divided by the number of micro-batches: Lightning, the HF
        Trainer for a model without ``num_items_in_batch``): the tracker read each as a mean
        (its shares times its examples), and the factor is the number of passes, which gives
        the examples' own gradients also for micro-batches of different sizes (with the step's
        examples instead, a short micro-batch's examples weighed more: 58 % on the variance
        for 8 and 2), or ``divided_by`` where the trainer says what it divided by. A pass
        whose loss is over one row (its mean is its sum) goes with either kind. A step mixing
        both kinds is read as the former, with a warning."""
        passes = stats._pass_means
        means = [m for m in passes if m is not None]
        if all(means) and (means or divided_by is not None):
            return float(divided_by if divided_by is not None else len(passes))
        if any(means) and not self._warned_mixed:
            self._warned_mixed = True
            warnings.warn(
                f"GradientMonitor: step {index} mixed backward passes whose loss was a "
                "micro-batch's mean and passes whose loss was not: with scale_to_grad=True "
                "each example's gradient is then its share times the step's examples, which "
                "weighs the examples of the mean passes by their micro-batch's size. Said once "
                "per monitor.",
                stacklevel=4,
            )
        return float(stats.num_examples)

    def _empty_record(self, index: int, stats: Any, loss: Any) -> dict[str, Any]:
        """The record of a tracked step without any example (no backward pass through the
        model: a batch the training loop skipped): 0 examples, every statistic None."""
        if not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                f"GradientMonitor: tracked step {index} had no backward pass through the model "
                "(a skipped batch, or backward run outside the step): its record has 0 "
                "examples and no statistics. Said once per monitor.",
                stacklevel=4,
            )
        empty: dict[str, Any] = dict.fromkeys(
            ("grad_norm", "grad_variance", "noise_scale", "snr_median")
        )
        record: dict[str, Any] = {"step": index, "examples": 0, **empty}
        if loss is not None:
            record["loss"] = float(loss)
        if self.layers:
            record["layers"] = {_layer(name): dict(empty) for name in stats}
        return record

    def _summarize(self, current: MonitorStep, divided_by: int | None = None) -> dict[str, Any]:
        stats = current.stats
        assert stats is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            stats.all_reduce(self.group)
        loss = current.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach().double().mean())  # a float64 loss kept to the last digit
        if stats.num_examples == 0:  # no backward pass: a skipped batch
            record = self._empty_record(current.index, stats, loss)
        else:
            scale = 1.0
            if self.scale_to_grad:
                scale = self._share_scale(current.index, stats, divided_by)
            norms = stats.batch_l2() if "batch_l2" in self.quantities else None
            record = summarize(
                stats,
                current.index,
                norms=norms,
                lr=self._learning_rate(),
                loss=None if loss is None else float(loss),
                layers=self.layers,
                scale=scale,
            )
        self.records.append(record)
        if _rank() == 0:
            for write in self._writers:
                write(record)
        return record


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines log written by a :class:`GradientMonitor` (blank lines
    skipped; a line that is not JSON raises, naming the file and the line)."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"read_records({str(path)!r}): line {number} is not JSON ({err.msg}); the "
                "file should hold one record per line, as a GradientMonitor writes"
            ) from None
        if not isinstance(value, dict) or "step" not in value:
            raise ValueError(
                f"read_records({str(path)!r}): line {number} is not a monitor record (a JSON "
                "object with a 'step')"
            )
        records.append(value)
    return records

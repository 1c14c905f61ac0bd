"""The statistics a ``track`` block gives: a mapping from parameter name to
:class:`ParamStats`, plus totals over parameters (:class:`TrackerResults`, the reading half of
:class:`~gradkit.per_example.Tracker`; the capturing half is in :mod:`._track`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from gradkit._errors import GradkitError, message
from gradkit.per_example import _dist
from gradkit.per_example._stats import (
    ParamStats,
    PowerSums,
    Want,
    as_dtype,
    check_order,
    merged_l2,
    statistics_dtype,
)

__all__ = ["TrackerResults"]


class TrackerResults(Mapping[str, ParamStats]):
    """The statistics of one ``track`` block, read by parameter name (see :func:`track`).

    Holds one accumulator per tracked parameter; the tracker's backward hooks add to them.
    Reading inside the block is allowed between backward passes, not while a forward call
    awaits its backward (its examples would be silently left out).
    """

    _names: dict[int, str]  # id(parameter) -> name
    _pids: dict[str, int]  # name -> id(parameter), of the tracked parameters
    _accs: dict[int, PowerSums]  # id(parameter) -> its statistics
    _want: Want
    _unbiased: bool
    _frozen: set[str]  # names of parameters not tracked because frozen
    _active: bool  # inside the block
    _unbackwarded: int  # model calls since the last backward pass
    _merged: bool  # all_reduce was called

    def _check_complete(self, call: str) -> None:
        """Refuse to go on after a backward pass that ended part-way (see the tracker)."""

    def _check_rule_sums(self, call: str) -> None:
        """Refuse statistics a user's rule gave that do not sum to autograd's gradient (see the
        tracker)."""

    def _check_reruns(self, call: str) -> None:
        """Refuse statistics a module's re-run example by example did not reproduce (see the
        tracker)."""

    def _check_mixed_rows(self, call: str) -> None:
        """Refuse statistics of layers before rows combined in different orders (see the
        tracker)."""

    def _readable(self, call: str) -> None:
        """Refuse to read statistics inside the block while a model call waits for its
        backward pass: they would silently leave its examples out. Refuse them too after a
        backward pass that raised part-way (:meth:`_check_complete`), and where the fallback's
        re-runs did not reproduce a module's output (:meth:`_check_reruns`)."""
        self._check_complete(call)
        self._check_reruns(call)
        self._check_mixed_rows(call)
        self._check_rule_sums(call)
        if self._active and self._unbackwarded:
            raise GradkitError(
                message(
                    call,
                    "the track block",
                    "a backward pass after every forward call of the model before reading",
                    f"{self._unbackwarded} forward call(s) of the model since the last backward "
                    "pass",
                    "call backward on their loss first (the statistics cover completed backward "
                    "passes only), or run forward calls you do not backpropagate under "
                    "torch.no_grad()",
                )
            )

    def __getitem__(self, name: str) -> ParamStats:
        pid = self._pids.get(name) if isinstance(name, str) else None
        if pid is not None:
            acc = self._accs[pid]
            return ParamStats(name, acc, self._want, self._unbiased, check=self._readable)
        tracked = [self._names[pid] for pid in self._accs]
        if isinstance(name, str) and name in self._frozen:
            why = f"no tracked parameter {name!r}: it did not require grad when track() was called"
        else:
            why = f"no tracked parameter {name!r}: the model has none of that name"
        raise KeyError(
            message(
                "stats[name]",
                "name",
                f"the name of a tracked parameter: {tracked}",
                why,
                "use a name from list(stats) (as in model.named_parameters())",
            )
        )

    def __iter__(self) -> Iterator[str]:
        return iter([self._names[pid] for pid in self._accs])

    def __len__(self) -> int:
        return len(self._accs)

    @property
    def num_examples(self) -> int:
        """Examples seen, the most of any parameter: the same for every parameter unless a
        backward pass computed the gradients of some only (``torch.autograd.grad(loss,
        [some])``; ``stats[name].num_examples`` gives each). One the loss of a backward pass
        did not reach counts that pass's examples, with gradient 0."""
        self._check_complete("stats.num_examples")
        counts = {acc.n for acc in self._accs.values()}
        return max(counts) if counts else 0

    def batch_l2(self) -> torch.Tensor:
        """``[N]``: ``||g_i||**2`` summed over all tracked parameters."""
        self._readable("batch_l2()")
        accs = self._accs.values()
        if "batch_l2" in self._want.quantities and all(acc.n for acc in accs):
            for acc in accs:
                check_order(acc, "batch_l2()")
            parts = [merged_l2(acc) for acc in accs]  # checked once, not per parameter
        else:  # the per-parameter read raises the error that names the parameter
            parts = [self[name].batch_l2 for name in self]
        sizes = {p.shape[0] for p in parts}
        if len(sizes) != 1:
            raise GradkitError(
                "per_example.track: batch_l2(): parameters saw different numbers "
                f"of examples {sorted(sizes)}; read stats[name].batch_l2 instead"
            )
        return torch.stack([as_dtype(p, statistics_dtype(p.dtype)) for p in parts]).sum(0)

    def all_reduce(self, group: Any = None) -> None:
        """Merge the statistics of every rank of ``group`` (torch.distributed), in place.

        Sums are all-reduced; ``batch_l2`` and ``batch_grad`` are gathered in rank order.
        Every rank must call it, with the same tracked parameters and quantities.
        """
        self._check_complete("stats.all_reduce(group)")
        if self._merged:
            raise GradkitError(
                message(
                    "stats.all_reduce(group)",
                    "stats",
                    "statistics not yet merged",
                    "a second call (the sums of every rank were already added)",
                    "call all_reduce once per track block",
                )
            )
        _dist.all_reduce_accs(list(self._accs.values()), self._want, group)
        self._merged = True

    def summary(self) -> str:
        """A per-parameter table: ``|mean|``, ``tr(var)``, gradient SNR and noise scale."""
        from gradkit.per_example._derived import summary_table

        self._readable("summary()")
        if self.num_examples == 0:
            raise GradkitError(
                message(
                    "stats.summary()",
                    "the track block",
                    "statistics of at least one example",
                    "0 examples",
                    "backpropagate inside the block first: with gradkit.per_example.track("
                    "model, ...) as stats: loss.backward()",
                )
            )
        return summary_table(self)

"""Sparse :class:`SparseConditionalAccumulator` (TensorFlow's ``SparseConditionalAccumulator``)
for row-sparse gradients: ``(indices, values)`` pairs (TensorFlow's ``IndexedSlices``) and
torch sparse COO tensors (e.g. from ``nn.Embedding(sparse=True)``).

Index legend: ``n`` rows present in a gradient, ``*`` the row shape. A gradient is
``indices [n]`` and ``values [n, *]``: row ``indices[k]`` of the dense gradient is
``values[k]``, other rows are zero. Duplicate indices add up.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradkit._errors import message
from gradkit.accumulate._conditional_checks import (
    MISSING,
    as_tensor,
    check_local_step,
    check_num_required,
    check_timeout,
)
from gradkit.accumulate._conditional_dense import Configured
from gradkit.accumulate._conditional_rows import (
    check_slices,
    coalesce,
    merge,
    normalize_dense_shape,
    rows_of_coo,
)

__all__ = ["IndexedSlices", "SparseConditionalAccumulator"]


class IndexedSlices(NamedTuple):
    """A row-sparse gradient: rows ``indices`` (int64, sorted, unique) of a dense tensor of
    ``dense_shape`` hold ``values``; ``dense_shape[0]`` is ``-1`` when unknown.

    Examples:
        >>> import torch
        >>> from gradkit.accumulate import IndexedSlices
        >>> s = IndexedSlices(torch.tensor([0, 2]), torch.tensor([[1.0], [3.0]]), (-1, 1))
        >>> s.to_dense(num_rows=4).flatten()
        tensor([1., 0., 3., 0.])
        >>> s.to_sparse_coo().shape  # unknown rows: up to the largest index
        torch.Size([3, 1])
    """

    indices: torch.Tensor
    values: torch.Tensor
    dense_shape: tuple[int, ...]

    def _rows(self, num_rows: int | None) -> int:
        if self.dense_shape[0] >= 0:
            return self.dense_shape[0]
        needed = int(self.indices.max().item()) + 1 if self.indices.numel() else 0
        if num_rows is None:
            return needed
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < needed:
            raise (ValueError if isinstance(num_rows, int) else TypeError)(
                message(
                    "IndexedSlices.to_dense/to_sparse_coo(num_rows)",
                    "num_rows",
                    f"None or an int >= {needed} (the largest index + 1)",
                    repr(num_rows),
                    "pass the dense gradient's number of rows, or leave it out",
                )
            )
        return num_rows

    def to_sparse_coo(self, num_rows: int | None = None) -> torch.Tensor:
        """A coalesced sparse COO tensor (``sparse_dim=1``). Its number of rows is
        ``dense_shape[0]``, else ``num_rows``, else the largest index + 1."""
        size = (self._rows(num_rows), *self.values.shape[1:])
        return torch.sparse_coo_tensor(
            self.indices.unsqueeze(0), self.values, size, is_coalesced=True, check_invariants=True
        )

    def to_dense(self, num_rows: int | None = None) -> torch.Tensor:
        """The dense tensor (rows as in :meth:`to_sparse_coo`)."""
        out = self.values.new_zeros((self._rows(num_rows), *self.values.shape[1:]))
        out.index_add_(0, self.indices, self.values)
        return out


class SparseConditionalAccumulator(Configured):
    r"""A :class:`ConditionalAccumulator` for row-sparse gradients.

    Each gradient is coalesced on apply (indices sorted, duplicate indices summed), then merged
    into the aggregate. With ``c`` gradients accepted since the last take and ``n_r`` the
    number of them that have row ``r``, ``take_grad`` returns for every row present

    .. math:: \text{mean}_r = \frac1c \sum_i g_{i,r}, \quad
              \text{row\_mean}_r = \frac1{n_r} \sum_i g_{i,r}, \quad
              \text{sum}_r = \sum_i g_{i,r}.

    ``"mean"`` (the default) equals the dense accumulator's mean of the densified gradients.
    TensorFlow's ``MEAN`` is ``"row_mean"``: a row present in one gradient of two is not
    halved.

    Args:
        shape: partial shape constraining the *leading* dims (TensorFlow's rule): ``None`` or
            ``()`` constrain nothing; a known ``shape[0]`` bounds the row indices and is
            reported as ``dense_shape[0]``; values may have more trailing dims than ``shape``.
        dtype, device: as for :class:`ConditionalAccumulator`.
        reduction: ``"mean"``, ``"row_mean"`` or ``"sum"``.

    Examples:
        >>> import torch
        >>> from gradkit.accumulate import SparseConditionalAccumulator
        >>> acc = SparseConditionalAccumulator(shape=(None, 2))
        >>> acc.apply_indexed_slices_grad(
        ...     torch.tensor([0, 1]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]), local_step=0)
        True
        >>> acc.apply_indexed_slices_grad(
        ...     torch.tensor([0, 2]), torch.tensor([[0.0, 1.0], [3.0, 0.0]]), local_step=0)
        True
        >>> out = acc.take_grad(2)
        >>> out.indices, out.dense_shape
        (tensor([0, 1, 2]), (-1, 2))
        >>> out.values  # divided by 2 everywhere: the dense mean
        tensor([[0.5000, 0.5000],
                [0.0000, 1.0000],
                [1.5000, 0.0000]])
    """

    _NAME = "SparseConditionalAccumulator"
    _REDUCTIONS = ("mean", "row_mean", "sum")

    # the window's rows (None: empty)
    _indices: torch.Tensor | None = None  # [m] int64, sorted, unique
    _values: torch.Tensor | None = None  # [m, *]
    _counts: torch.Tensor | None = None  # [m] int64: gradients that had each row
    _rows_hint: int | None = None  # largest dense_shape[0] seen in this window

    # ---- apply
    def apply_indexed_slices_grad(
        self,
        indices: Any,
        values: Any = MISSING,
        local_step: Any = MISSING,
        *,
        dense_shape: Any = None,
    ) -> bool:
        """Add the gradient whose rows ``indices`` (``[n]``, int32 or int64) hold ``values``
        (``[n, *]``), unless it is stale (``local_step < global_step``). TensorFlow's form,
        ``apply_indexed_slices_grad(IndexedSlices, local_step)``, is accepted too.

        Args:
            indices, values: the gradient; copied and coalesced.
            local_step: required, as for :meth:`ConditionalAccumulator.apply_grad`.
            dense_shape: optional shape of the dense gradient (a sequence or an int tensor),
                checked against the accumulator's shape and the values.

        Returns:
            ``True`` if accepted, ``False`` if dropped as stale (counted in ``num_dropped``).
            Validation (index vector, value rank, row counts, index limits, shapes, dtype)
            applies to non-stale gradients only, after the staleness test; on error nothing
            is added.
        """
        if isinstance(indices, IndexedSlices):
            if values is not MISSING and local_step is not MISSING:
                raise TypeError(
                    f"{self._NAME}.apply_indexed_slices_grad(grad, local_step): with an "
                    "IndexedSlices, pass only local_step after it (its values are inside it)"
                )
            step_arg = local_step if values is MISSING else values
            return self.apply_grad(indices, local_step=step_arg)
        if values is MISSING:
            raise TypeError(
                f"{self._NAME}.apply_indexed_slices_grad(indices, values, local_step): missing "
                "values; pass indices and values, or one IndexedSlices"
            )
        step = check_local_step(
            local_step, f"{self._NAME}.apply_indexed_slices_grad(indices, values, local_step)"
        )
        call = f"{self._NAME}.apply_indexed_slices_grad(indices, values, local_step={step})"
        idx = as_tensor(indices, call, "indices").detach()
        vals = as_tensor(values, call, "values").detach()
        shape = normalize_dense_shape(dense_shape, call)
        return self._accept(call, step, lambda: self._add_locked(idx, vals, shape, call))

    def apply_grad(
        self,
        grad: Any = MISSING,
        *args: Any,
        local_step: Any = MISSING,
        grad_indices: Any = MISSING,
        grad_values: Any = MISSING,
        grad_shape: Any = None,
    ) -> bool:
        """Add a row-sparse gradient unless it is stale. Three call forms:

        * ``apply_grad(grad, local_step)``: ``grad`` a sparse COO tensor (any ``sparse_dim``;
          rows are its first dim, duplicates are summed) or an :class:`IndexedSlices`;
        * ``apply_grad(grad_indices, grad_values, grad_shape=None, local_step=...)``:
          TensorFlow's form (positional or keyword), the same as
          :meth:`apply_indexed_slices_grad` with ``dense_shape=grad_shape``.

        The forms are told apart by the second positional argument: values (a tensor with at
        least one dimension, or a list) make it TensorFlow's form; a number is ``local_step``.

        >>> import torch
        >>> acc = SparseConditionalAccumulator(shape=(4, 2))
        >>> acc.apply_grad(torch.tensor([1]), torch.tensor([[1.0, 2.0]]), local_step=0)
        True
        >>> acc.apply_grad(grad_indices=torch.tensor([1]), grad_values=torch.ones(1, 2),
        ...                grad_shape=(4, 2), local_step=0)
        True
        >>> acc.take_grad(2).values
        tensor([[1.0000, 1.5000]])
        """
        if grad_values is not MISSING or grad_indices is not MISSING or _values_like(args):
            return self._apply_tf_form(
                grad, args, local_step, grad_indices, grad_values, grad_shape
            )
        base = f"{self._NAME}.apply_grad(grad, local_step)"
        if grad is MISSING:
            raise TypeError(
                f"{base}: missing the gradient; pass grad (a sparse COO tensor or an "
                "IndexedSlices) or grad_indices and grad_values"
            )
        if len(args) > 1 or (args and local_step is not MISSING):
            raise TypeError(
                message(
                    base,
                    "local_step",
                    "one local_step",
                    f"{len(args)} extra positional "
                    f"argument(s){' and local_step=' if local_step is not MISSING else ''}",
                    "pass apply_grad(grad, local_step=...) or TensorFlow's "
                    "apply_grad(grad_indices, grad_values, grad_shape, local_step)",
                )
            )
        if grad_shape is not None:
            raise TypeError(
                message(
                    base,
                    "grad_shape",
                    "None with a COO tensor or IndexedSlices",
                    repr(grad_shape),
                    "grad_shape goes with grad_indices and grad_values",
                )
            )
        if args:
            local_step = args[0]
        step = check_local_step(local_step, base)
        call = f"{self._NAME}.apply_grad(grad, local_step={step})"
        if isinstance(grad, IndexedSlices):
            idx = as_tensor(grad.indices, call, "grad.indices").detach()
            vals = as_tensor(grad.values, call, "grad.values").detach()
            dims = grad.dense_shape
            unknown = isinstance(dims, (tuple, list)) and len(dims) > 0 and dims[0] == -1
            shape = None if unknown else normalize_dense_shape(dims, call)
        else:
            g = as_tensor(grad, call, "grad")
            if g.layout == torch.sparse_coo and g.dim() == 0:
                raise ValueError(
                    message(
                        call,
                        "grad",
                        "a sparse COO tensor with rows (dimension 0)",
                        "a 0-dimensional sparse tensor",
                        "pass the gradient of a parameter with at least one dimension",
                    )
                )
            if g.layout != torch.sparse_coo:
                raise TypeError(
                    message(
                        call,
                        "grad",
                        "a sparse COO tensor or an IndexedSlices",
                        f"a tensor with layout {g.layout}",
                        "use ConditionalAccumulator for dense gradients, or grad.to_sparse(1)",
                    )
                )
            idx, vals = rows_of_coo(g.detach())
            shape = tuple(g.shape)
        return self._accept(call, step, lambda: self._add_locked(idx, vals, shape, call))

    def _apply_tf_form(
        self,
        grad: Any,
        args: tuple[Any, ...],
        local_step: Any,
        grad_indices: Any,
        grad_values: Any,
        grad_shape: Any,
    ) -> bool:
        """``apply_grad(grad_indices, grad_values, grad_shape=None, local_step=...)``."""
        call = f"{self._NAME}.apply_grad(grad_indices, grad_values, grad_shape, local_step)"
        rest = list(args)
        if grad is not MISSING and grad_indices is not MISSING:
            raise TypeError(f"{call}: grad_indices given twice (positionally and by keyword)")
        indices = grad_indices if grad is MISSING else grad
        if grad_values is MISSING:
            grad_values = rest.pop(0) if rest else MISSING
        elif _values_like(args):
            raise TypeError(f"{call}: grad_values given twice (positionally and by keyword)")
        if indices is MISSING or grad_values is MISSING:
            raise TypeError(f"{call}: expected both grad_indices and grad_values")
        if rest and grad_shape is None:
            grad_shape = rest.pop(0)
        if rest and local_step is MISSING:
            local_step = rest.pop(0)
        if rest:
            raise TypeError(
                message(
                    call,
                    "arguments",
                    "at most grad_indices, grad_values, grad_shape and local_step",
                    f"{len(rest)} more positional argument(s) (or one given twice)",
                    "pass local_step by keyword",
                )
            )
        # TensorFlow converts Python lists (of row numbers, of values in the accumulator's dtype)
        if isinstance(indices, (list, tuple)):  # its own dtype: float rows are refused
            indices = torch.as_tensor(indices, device="cpu")
            indices = indices.long() if indices.numel() == 0 else indices
        if isinstance(grad_values, (list, tuple)):
            grad_values = torch.as_tensor(grad_values, dtype=self._dtype, device="cpu")
        return self.apply_indexed_slices_grad(
            indices, grad_values, local_step, dense_shape=grad_shape
        )

    def _add_locked(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        dense_shape: tuple[int, ...] | None,
        call: str,
    ) -> None:
        current = None if self._values is None else tuple(self._values.shape)
        check_slices(indices, values, dense_shape, self._shape, current, self._dtype, call)
        rows, summed = coalesce(indices, values, self._acc_dtype, self._device)
        if self._indices is None or self._values is None or self._counts is None:
            self._indices, self._values = rows, summed
            self._counts = torch.ones(rows.shape, dtype=torch.int64, device=self._device)
        else:
            self._indices, self._values, self._counts = merge(
                (self._indices, self._values, self._counts), (rows, summed)
            )
        if dense_shape is not None and dense_shape[0] > (self._rows_hint or -1):
            self._rows_hint = dense_shape[0]

    # ---- take
    def _pop_locked(self) -> tuple[Any, ...]:
        out = (self._indices, self._values, self._counts, self._counter, self._rows_hint)
        self._indices = self._values = self._counts = self._rows_hint = None
        return out

    def _take_slices(
        self, call: str, num_required: Any, timeout: Any
    ) -> tuple[IndexedSlices, int | None]:
        n = check_num_required(num_required, call)
        t = check_timeout(timeout, call)
        indices, values, counts, counter, hint = self._take(call, n, t)
        if self._reduction == "mean":
            values.div_(counter)
        elif self._reduction == "row_mean":
            values.div_(counts.reshape(-1, *([1] * (values.dim() - 1))))
        dim0 = self._shape[0] if self._shape and self._shape[0] is not None else -1
        shape = (dim0, *values.shape[1:])
        return IndexedSlices(indices, values.to(self._dtype), shape), hint

    def take_grad(self, num_required: Any, *, timeout: Any = None) -> IndexedSlices:
        """Wait (FIFO) until ``num_accumulated >= num_required``; return the reduced aggregate
        as ``IndexedSlices(indices, values, dense_shape)`` (fresh tensors), reset the counter
        and advance ``global_step`` by 1.

        ``dense_shape[0]`` is the accumulator's ``shape[0]`` if known, else ``-1``; the other
        dims are the values' (TensorFlow's rule). Timeouts, cancellation and closing behave as
        in :meth:`ConditionalAccumulator.take_grad`.
        """
        call = f"{self._NAME}.take_grad(num_required={num_required!r})"
        return self._take_slices(call, num_required, timeout)[0]

    def take_indexed_slices_grad(self, num_required: Any, *, timeout: Any = None) -> IndexedSlices:
        """Alias of :meth:`take_grad` (TensorFlow's name)."""
        call = f"{self._NAME}.take_indexed_slices_grad(num_required={num_required!r})"
        return self._take_slices(call, num_required, timeout)[0]

    def take_sparse_coo(
        self, num_required: Any, *, timeout: Any = None, num_rows: int | None = None
    ) -> torch.Tensor:
        """:meth:`take_grad` as a coalesced torch sparse COO tensor. Its number of rows is
        the accumulator's ``shape[0]``, else ``num_rows``, else the largest ``dense_shape[0]``
        applied in the window (sparse COO gradients carry one), else the largest index + 1."""
        call = f"{self._NAME}.take_sparse_coo(num_required={num_required!r})"
        if num_rows is not None and (
            isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0
        ):
            raise (ValueError if isinstance(num_rows, int) else TypeError)(
                message(
                    call,
                    "num_rows",
                    "None or an int >= 0",
                    repr(num_rows),
                    "pass the dense gradient's number of rows; nothing was consumed",
                )
            )
        slices, hint = self._take_slices(call, num_required, timeout)
        needed = int(slices.indices.max().item()) + 1 if slices.indices.numel() else 0
        if num_rows is not None and num_rows < needed:
            err = ValueError(
                message(
                    call,
                    "num_rows",
                    f"an int >= {needed} (the largest row index taken + 1)",
                    repr(num_rows),
                    "the take was served: its result is the error's `slices` attribute "
                    "(IndexedSlices); pass the dense gradient's number of rows",
                )
            )
            err.slices = slices  # type: ignore[attr-defined]
            raise err
        rows = num_rows if num_rows is not None else max(hint or 0, needed)
        return slices.to_sparse_coo(rows)

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Configuration, aggregate rows (``indices``, ``values``, per-row ``counts``, or
        ``None``s), counter, global step and dropped count."""
        with self._cond:
            clone = lambda t: None if t is None else t.clone()  # noqa: E731
            return {
                **self._config(),
                **self._core_state(),
                "indices": clone(self._indices),
                "values": clone(self._values),
                "counts": clone(self._counts),
                "rows_hint": self._rows_hint,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the configuration must be the same)."""
        call = f"{self._NAME}.load_state_dict(state)"
        self._check_config(state, call)
        parts = [state.get(k) for k in ("indices", "values", "counts")]
        empty = state.get("counter") == 0
        ok = (
            all(p is None for p in parts)
            if empty
            else all(isinstance(p, torch.Tensor) for p in parts)
        )
        if not ok:
            raise ValueError(
                message(
                    call,
                    "state['indices'/'values'/'counts']",
                    "None when the counter is 0, else tensors",
                    repr([type(p).__name__ for p in parts]),
                    f"pass the state_dict() of a {self._NAME}",
                )
            )
        with self._cond:
            self._load_core_state(state, call)
            if empty:
                self._indices = self._values = self._counts = None
            else:
                indices, values, counts = (p for p in parts if isinstance(p, torch.Tensor))
                self._indices = indices.to(self._device, torch.int64).clone()
                self._values = values.to(self._device, self._acc_dtype).clone()
                self._counts = counts.to(self._device, torch.int64).clone()
            self._rows_hint = state.get("rows_hint")
            self._flush_locked()


for _cls in (IndexedSlices, SparseConditionalAccumulator):
    _cls.__module__ = "gradkit.accumulate"


def _values_like(args: tuple[Any, ...]) -> bool:
    """Whether the second positional argument of ``apply_grad`` is gradient values (TensorFlow's
    form) rather than a ``local_step``: a tensor with at least one dimension, or a sequence."""
    if not args:
        return False
    first = args[0]
    return isinstance(first, (list, tuple)) or (isinstance(first, torch.Tensor) and first.dim() > 0)

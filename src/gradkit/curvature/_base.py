"""The base class of the curvature operators: vectors, blocks, batches, dense and scipy views.

A subclass says how to build a :class:`~gradkit.curvature._layout.Point` (the operator's
contribution of one batch, with whatever graph its products reuse) and the base class does the
rest: products ``op @ v`` on flat vectors ``[P]``, matrices ``[P, k]`` and dicts keyed like the
parameters; batches weighed ``Z_b / Z`` (``reduction="mean"``, ``Z_b`` what the batch's mean
divides by: its examples, or its counted targets for a torch classification loss) or 1
(``"sum"``);
block-diagonal operators; ``dense()`` and ``to_scipy()``.

Block-diagonal products: block ``b`` of ``C v`` is ``C_bb v_b``, the block-``b`` rows of
``C (v masked to block b)``. All blocks go through one matrix product of ``k * B`` columns, so a
block-diagonal product costs ``B`` products of the full operator.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, overload

import torch
from torch import nn

from gradkit._autograd import second_order_message
from gradkit._errors import GradkitError, message
from gradkit._state import TensorState, named_state
from gradkit._validate import (
    check_bool,
    check_int,
    check_number,
    check_optional_int,
)
from gradkit.curvature._data import Data, LossFn, select_params
from gradkit.curvature._diag import unit_diagonal
from gradkit.curvature._layout import Layout, Point, parse_blocks
from gradkit.curvature._solve import ShiftedOperator, check_damping
from gradkit.curvature._vectors import FlatVectors
from gradkit.func._common import unbatched_retry

__all__ = [
    "DENSE_MAX",
    "CurvatureOperator",
    "Layout",
    "Point",
    "exact_diagonal_of",
    "operator_call",
]

logger = logging.getLogger(__name__)

_VECTORIZE_MAX = 10_000  # parameters up to which op @ V uses one batched backward
DENSE_MAX = 10_000


class CurvatureOperator(FlatVectors):
    """A curvature matrix of ``loss_fn(model(inputs), targets)`` w.r.t. the model's parameters
    as a matrix-free, symmetric linear operator (base class of :class:`Hessian`, :class:`GGN`
    and :class:`Fisher`).

    Vectors are flat over the selected parameters in ``model.named_parameters()`` order
    (``names``); :meth:`flatten`, :meth:`unflatten` and :meth:`as_dict` convert. Follows
    scipy's convention: ``op @ v`` for ``[P]``, ``op @ V`` for ``[P, k]`` (columns), and a dict
    keyed like the parameters gives a dict back.

    Products follow the model: on one batch, the graph kept from construction is rebuilt at the
    current values before a product when the model changed since (an optimizer step, ``p.add_``
    under ``no_grad``, an edit of ``p.data``, a new buffer, ``model.train()``/``eval()``:
    parameters' and buffers' version counters, storage and values, and the modules' modes are
    compared before every product, which costs one pass over the parameters and keeps a copy of
    them); several batches are recomputed at every product anyway. So ``op @ v``,
    :func:`diagonal`, :func:`trace` and :func:`eigenvalues` always give the curvature at the
    model's current parameters. A parameter replaced by a new tensor object (``model.fc.weight =
    nn.Parameter(...)``) is refused: build a new operator.

    Attributes:
        shape: ``(P, P)``.
        dtype, device: those of the parameters; products come back in this dtype.
        names: the selected parameters' names, in flat order.
        shapes: their shapes.
        num_examples: ``N``, the examples over all batches.
        blocks: ``None`` (full) or lists of parameter names, one per diagonal block.
    """

    _kind = "CurvatureOperator"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        data: Any,
        *,
        params: Iterable[str] | str | None = None,
        blocks: Any = "full",
        reduction: str = "mean",
        vectorize: bool | None = None,
        chunk_size: int | None = None,
    ) -> None:
        self._call = call = f"{self._kind}({type(model).__name__})"
        vectorize = check_bool(vectorize, call, "vectorize", optional=True)
        chunk_size = check_optional_int(chunk_size, call, "chunk_size")
        chosen = select_params(model, params, call)
        self._data = Data(model, loss_fn, data, reduction=reduction, call=call)
        self._layout = Layout(chosen)
        self._params = self._layout.params
        self.names = list(chosen)
        self.shapes = self._layout.shapes
        self._sizes = self._layout.sizes
        n = self._layout.n
        self.shape = (n, n)
        self.dtype = self._params[0].dtype
        self.device = self._params[0].device
        self.num_examples = self._data.num_examples
        parsed = parse_blocks(blocks, self.names, call)
        self.blocks = None if parsed is None else [[self.names[i] for i in g] for g in parsed]
        self._masks: list[torch.Tensor] | None = None
        if parsed is not None:
            bounds = torch.tensor([0, *self._sizes], device="cpu").cumsum(0).tolist()
            self._masks = []
            for group in parsed:
                mask = torch.zeros(n, dtype=self.dtype, device=self.device)
                for i in group:
                    mask[bounds[i] : bounds[i + 1]] = 1
                self._masks.append(mask)
        self.vectorize = n <= _VECTORIZE_MAX if vectorize is None else vectorize
        self.chunk_size = chunk_size
        self._point: Point | None = None
        self._state: TensorState | None = None
        self._configure()
        self._data.weigh(by_examples=self._by_examples())
        self._start()

    # -- subclass interface -------------------------------------------------------------------
    # A subclass gives the product at one batch (_make_point) and, if it has arguments of its
    # own, checks them in _configure (called once the shared arguments are checked, before the
    # first batch's point is built).

    def _configure(self) -> None:
        """Check and set the subclass's own arguments (the shared ones are set)."""

    def _make_point(self, inputs: Any, targets: torch.Tensor, index: int) -> Point:
        raise NotImplementedError  # pragma: no cover

    def _by_examples(self) -> bool:
        """Whether batches weigh ``n_b / N`` whatever the targets (the per-batch matrix is a
        mean over the examples), rather than by what the mean loss divides by."""
        return False

    def _start(self) -> None:
        """Build the first batch's point (the first that counts: not all its targets ignored;
        kept for a single batch, with the state of the model it was built at), warn about
        unused parameters, refuse graphs that cannot be differentiated twice."""
        data = self._data
        index, (inputs, targets, _) = next(
            (i, b) for i, b in enumerate(data) if data.weight(i, b[2], b[1]) != 0
        )
        with torch.enable_grad():
            point = data.first(lambda: self._make_point(inputs, targets, index), self.dtype)
        if point.errors:  # curvature products differentiate the backward pass
            raise GradkitError(second_order_message(self._call, point.errors))
        self._data.warn_unused([self.names[i] for i in point.unused])
        if self._data.single:
            self._point = point
            self._state = self._record()

    def _record(self) -> TensorState:
        model = self._data.model
        return TensorState(named_state(model), modules=model, data=self._data.tensors())

    def _check_params(self) -> None:
        """Refuse parameters that are no longer the model's (replaced by new objects), no
        longer require grad (frozen since), or were cast or moved since the operator was built
        (its vectors keep the dtype and device it was built with)."""
        named = dict(self._data.model.named_parameters())
        for name, p in zip(self.names, self._params, strict=True):
            if named.get(name) is not p:
                raise GradkitError(
                    f"{self._call}: parameter {name!r} is no longer the model's parameter of "
                    "that name (it was replaced by a new tensor object or removed after the "
                    "operator was built); the operator differentiates the parameters it was "
                    "built with: build a new operator from the model as it is now"
                )
            if not p.requires_grad:
                raise GradkitError(
                    f"{self._call}: parameter {name!r} no longer requires grad (it was frozen "
                    "after the operator was built, which differentiates it); unfreeze it "
                    "(requires_grad_(True)) while using the operator, or build a new operator "
                    "from the model as it is now (frozen parameters are left out)"
                )
            if p.dtype != self.dtype or p.device != self.device:
                raise GradkitError(
                    f"{self._call}: parameter {name!r} is {p.dtype} on {p.device} now; the "
                    f"operator was built for {self.dtype} on {self.device} (the model was cast "
                    "or moved since): build a new operator from the model as it is now"
                )

    def _current_point(self) -> Point | None:
        """The kept point, rebuilt at the current values if the model changed since it was
        built (None for several batches: every product recomputes them)."""
        self._check_params()
        if self._point is None or self._state is None:
            return self._point
        current = named_state(self._data.model)
        why = None if self._state.same_objects(current) else "a parameter or buffer was replaced"
        why = why or self._state.changed()
        if why is None:
            return self._point
        logger.debug(
            "%s: %s since the last product; rebuilding at the current values", self._call, why
        )
        inputs, targets, _ = next(iter(self._data))
        self._point = None  # free the old graph before building the new one
        with torch.enable_grad():
            self._point = self._make_point(inputs, targets, 0)
        self._state = self._record()
        return self._point

    # -- vectors ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        blocks = "full" if self.blocks is None else f"{len(self.blocks)} blocks"
        return (
            f"{self._kind}(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
            f"{blocks}, num_examples={self.num_examples})"
        )

    @overload
    def __matmul__(self, v: torch.Tensor) -> torch.Tensor: ...

    @overload
    def __matmul__(self, v: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def __matmul__(
        self, v: torch.Tensor | Mapping[str, torch.Tensor]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        if isinstance(v, Mapping):
            return self.as_dict(self._matvec(self.flatten(v)))
        v = self._check(v)
        return self._matvec(v) if v.dim() == 1 else self._matmat(v)

    def __add__(self, damping: float) -> ShiftedOperator:
        """``op + damping``: the operator ``C + damping * I`` (e.g. for
        :func:`~gradkit.curvature.solve`), a :class:`ShiftedOperator`."""
        return ShiftedOperator(self, check_damping(damping, f"{self._call} + damping"))

    __radd__ = __add__

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``C v`` for ``v`` of shape ``[P]``."""
        return self._matvec(self._check(v).reshape(-1))

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``C V`` for ``V`` of shape ``[P, k]``."""
        V = self._check(V)
        return self._matmat(V if V.dim() == 2 else V[:, None])

    # -- products -----------------------------------------------------------------------------

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        point = self._current_point()
        if point is None or self._masks is not None:
            return self._matmat(v[:, None])[:, 0]
        with torch.enable_grad(), self._inplace_errors():
            return point.apply(v)

    @contextlib.contextmanager
    def _inplace_errors(self) -> Iterator[None]:
        """Word autograd's error about a saved tensor modified in place (one the operator does
        not track: a tensor captured by ``loss_fn``)."""
        try:
            yield
        except RuntimeError as err:
            if "modified by an inplace operation" not in str(err):
                raise
            raise GradkitError(
                f"{self._call} @ v: a tensor the loss depends on, other than the model's "
                "parameters, buffers and the batch (e.g. one captured by loss_fn), was modified "
                f"in place after the operator was built ({str(err).split(';')[0]}); build a new "
                "operator after changing it"
            ) from err

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        if V.shape[1] == 0:
            return V.clone()
        with torch.enable_grad(), self._inplace_errors():
            if self._masks is None:
                return self._full(V)
            k = V.shape[1]
            stacked = torch.cat([V * m[:, None] for m in self._masks], dim=1)
            res = self._full(stacked)
            out = torch.zeros_like(V)
            for b, m in enumerate(self._masks):
                out += res[:, b * k : (b + 1) * k] * m[:, None]
            return out

    def _exact_diagonal(self, *, max_size: int, max_memory: int, call: str) -> torch.Tensor:
        """The diagonal from products with unit vectors (blocks do not change it)."""

        def product(E: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                return self._full(E)

        n = self.shape[0]
        return unit_diagonal(product, n, self.dtype, self.device, max_size=max_size, call=call)

    def _full(self, V: torch.Tensor) -> torch.Tensor:
        point = self._current_point()
        if point is not None:
            return self._columns(point, V)
        total: torch.Tensor | None = None
        for index, (inputs, targets, n) in enumerate(self._data):
            weight = self._data.weight(index, n, targets)
            if weight == 0:  # nothing of it counts (its own mean loss is nan)
                continue
            res = self._columns(self._make_point(inputs, targets, index), V) * weight
            total = res if total is None else total + res
        assert total is not None  # a batch that counts (checked at construction)
        return total

    def _columns(self, point: Point, V: torch.Tensor) -> torch.Tensor:
        k = V.shape[1]
        if k == 1 or not self.vectorize:
            return torch.stack([point.apply(c) for c in V.T], dim=1)
        step = k if self.chunk_size is None else self.chunk_size
        cols = []
        for start in range(0, k, step):
            block = V[:, start : start + step].T.contiguous()
            try:
                cols.append(point.apply_batched(block).T)
            except RuntimeError as err:
                head = unbatched_retry(err, functools.partial(point.apply, block[0]))
                logger.debug("%s: batched backward failed (%s); one at a time", self._call, err)
                rest = [point.apply(c) for c in block[1:]]
                cols.append(torch.stack([head, *rest], dim=1))
        return torch.cat(cols, dim=1)

    # -- views ------------------------------------------------------------------------------

    def dense(self, *, max_size: int = DENSE_MAX, chunk: int = 256) -> torch.Tensor:
        """The matrix ``[P, P]``, ``chunk`` columns per product (for models up to ``max_size``
        parameters)."""
        n = self.shape[0]
        max_size = check_int(max_size, f"{self._call}.dense()", "max_size", low=1, example=n)
        chunk = check_int(chunk, f"{self._call}.dense()", "chunk", low=1, example=256)
        if n > max_size:
            raise GradkitError(
                message(
                    f"{self._call}.dense()",
                    "max_size",
                    f"at least the number of parameters ({n})",
                    str(max_size),
                    f"raise max_size (the matrix takes {n * n * self._itemsize() / 2**30:.1f} "
                    "GiB and P products), or stay matrix-free: op @ v, eigenvalues(op), "
                    "trace(op)",
                )
            )
        eye = torch.eye(n, dtype=self.dtype, device=self.device)
        return torch.cat([self._matmat(eye[:, i : i + chunk]) for i in range(0, n, chunk)], 1)

    def _itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype, device="cpu").element_size()

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` (numpy in and out) for scipy's solvers."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def mv(v: np.ndarray) -> np.ndarray:
            t = torch.as_tensor(np.asarray(v).reshape(-1), device=self.device)
            return self.matvec(t).detach().cpu().numpy()

        def mm(V: np.ndarray) -> np.ndarray:
            t = torch.as_tensor(np.asarray(V), device=self.device)
            return self.matmat(t).detach().cpu().numpy()

        dtype = torch.empty((), dtype=self.dtype, device="cpu").numpy().dtype
        return LinearOperator(self.shape, matvec=mv, rmatvec=mv, matmat=mm, dtype=dtype)

    def check_deterministic(self, *, rtol: float | None = None) -> None:
        """Raise unless two evaluations of the same product agree (opt-in, costs 4 products).

        Catches data iterables that change between passes (shuffling, random augmentation),
        and models that are random in the forward (dropout in training mode).
        """
        from gradkit.testing import tolerances

        call = f"{self._call}.check_deterministic()"
        if rtol is not None:
            rtol = check_number(rtol, call, "rtol", low=0, low_open=True, example="1e-6")
        tol = rtol if rtol is not None else 1e3 * tolerances(self.dtype)[0]
        self._check_params()
        g = torch.Generator(device="cpu").manual_seed(0)
        v = torch.randn(self.shape[0], 2, generator=g, dtype=torch.float64, device="cpu")
        v = v.to(device=self.device, dtype=self.dtype)  # drawn on the CPU: the same everywhere
        kept, self._point = self._point, None  # rebuild from the data each time
        try:
            first, second = self._full(v), self._full(v)
        finally:
            self._point = kept
        scale = float(first.abs().max())
        diff = float((first - second).abs().max())
        if diff > tol * max(scale, 1e-30):
            raise GradkitError(
                f"{self._call}.check_deterministic(): two evaluations of the same product "
                f"differ by {diff:.3g} (max abs value {scale:.3g}, rtol {tol:g}); the data "
                "iterable must give the same batches every pass (no shuffling or random "
                "augmentation) and the model must be deterministic (model.eval() turns dropout "
                "off)"
            )


# -- what the estimators read from an operator (they live in other modules) ----------------


def operator_call(op: CurvatureOperator) -> str:
    """How ``op`` is named in error messages, e.g. ``"Hessian(Sequential)"``."""
    return op._call


def exact_diagonal_of(
    op: CurvatureOperator, *, max_size: int, max_memory: int, call: str
) -> torch.Tensor:
    """``diag(op)`` ``[P]`` by the operator's own exact method (per-example gradients for the
    GGN and the Fisher, per-example Hessian blocks for a sequential MLP's Hessian, else ``P``
    products with unit vectors up to ``max_size``), once its parameters are checked to be still
    the model's. ``call`` names the estimator in errors."""
    op._check_params()
    return op._exact_diagonal(max_size=max_size, max_memory=max_memory, call=call)

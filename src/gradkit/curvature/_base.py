"""The base class of the curvature operators: vectors, blocks, batches, dense and scipy views.

A subclass says how to build a :class:`~gradkit.curvature._layout.Point` (the operator's
contribution of one batch, with whatever graph its products reuse) and the base class does the
rest: products ``op @ v`` on flat vectors ``[P]``, matrices ``[P, k]`` and dicts keyed like the
parameters; batches weighed ``n_b / N`` (``reduction="mean"``) or 1 (``"sum"``);
block-diagonal operators; ``dense()`` and ``to_scipy()``.

Block-diagonal products: block ``b`` of ``C v`` is ``C_bb v_b``, the block-``b`` rows of
``C (v masked to block b)``. All blocks go through one matrix product of ``k * B`` columns, so a
block-diagonal product costs ``B`` products of the full operator.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit._validate import is_batching_error
from gradkit.curvature._data import Data, LossFn, select_params
from gradkit.curvature._diag import unit_diagonal
from gradkit.curvature._layout import Layout, Point, parse_blocks

__all__ = ["DENSE_MAX", "CurvatureOperator", "Layout", "Point"]

logger = logging.getLogger(__name__)

_VECTORIZE_MAX = 10_000  # parameters up to which op @ V uses one batched backward
DENSE_MAX = 10_000


class CurvatureOperator:
    """A curvature matrix of ``loss_fn(model(inputs), targets)`` w.r.t. the model's parameters
    as a matrix-free, symmetric linear operator (base class of :class:`Hessian`, :class:`GGN`
    and :class:`Fisher`).

    Vectors are flat over the selected parameters in ``model.named_parameters()`` order
    (``names``); :meth:`flatten`, :meth:`unflatten` and :meth:`as_dict` convert. Follows
    scipy's convention: ``op @ v`` for ``[P]``, ``op @ V`` for ``[P, k]`` (columns), and a dict
    keyed like the parameters gives a dict back.

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
        params: Iterable[str] | str | None,
        blocks: Any,
        reduction: str,
        vectorize: bool | None = None,
        chunk_size: int | None = None,
    ) -> None:
        self._call = call = f"{self._kind}({type(model).__name__})"
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
            bounds = torch.tensor([0, *self._sizes]).cumsum(0).tolist()
            self._masks = []
            for group in parsed:
                mask = torch.zeros(n, dtype=self.dtype, device=self.device)
                for i in group:
                    mask[bounds[i] : bounds[i + 1]] = 1
                self._masks.append(mask)
        self.vectorize = n <= _VECTORIZE_MAX if vectorize is None else vectorize
        self.chunk_size = chunk_size
        self._point: Point | None = None

    # -- subclass interface -------------------------------------------------------------------

    def _make_point(self, inputs: Any, targets: torch.Tensor, index: int) -> Point:
        raise NotImplementedError  # pragma: no cover

    def _start(self) -> None:
        """Build the first batch's point (kept for a single batch), warn about unused
        parameters, refuse graphs that cannot be differentiated twice."""
        inputs, targets, _ = next(iter(self._data))
        with torch.enable_grad():
            point = self._make_point(inputs, targets, 0)
        if point.errors:
            raise GradkitError(
                f"{self._call}: the model's backward cannot be differentiated again (graph "
                f"nodes {point.errors}, left by an autograd.Function whose backward is marked "
                "@once_differentiable); curvature products differentiate the backward pass: "
                "write that backward with differentiable torch operations"
            )
        self._data.warn_unused([self.names[i] for i in point.unused])
        if self._data.single:
            self._point = point

    # -- vectors ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        blocks = "full" if self.blocks is None else f"{len(self.blocks)} blocks"
        return (
            f"{self._kind}(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
            f"{blocks}, num_examples={self.num_examples})"
        )

    def flatten(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> torch.Tensor:
        """Tensors shaped like the parameters (a dict keyed by name, or a list in ``names``
        order) as one flat vector ``[P]``."""
        if isinstance(tensors, Mapping):
            if set(tensors) != set(self.names):
                raise ValueError(
                    message(
                        f"{self._call}.flatten",
                        "tensors",
                        f"exactly the keys {self.names}",
                        repr(sorted(tensors)),
                        "key the vector like op.names",
                    )
                )
            parts = [tensors[n] for n in self.names]
        else:
            parts = list(tensors)
        ok = len(parts) == len(self.shapes) and all(
            isinstance(t, torch.Tensor) and t.shape == s
            for t, s in zip(parts, self.shapes, strict=False)
        )
        if not ok:
            raise ValueError(
                message(
                    f"{self._call}.flatten",
                    "tensors",
                    f"tensors of shapes {[tuple(s) for s in self.shapes]}",
                    describe(parts),
                    "shape each piece like its parameter",
                )
            )
        return torch.cat([t.reshape(-1).to(self.dtype) for t in parts])

    def unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Split ``[P]`` (or ``[P, k]``) into pieces shaped like the parameters (``[*shape,
        k]``)."""
        self._check(vector, ".unflatten(vector)")
        tail = vector.shape[1:]
        return [
            p.reshape((*s, *tail))
            for p, s in zip(vector.split(self._sizes), self.shapes, strict=True)
        ]

    def as_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split ``[P]`` (or ``[P, k]``) by parameter name."""
        return dict(zip(self.names, self.unflatten(vector), strict=True))

    def _check(self, v: Any, where: str = " @ v") -> torch.Tensor:
        n = self.shape[0]
        if not isinstance(v, torch.Tensor) or v.dim() not in (1, 2) or v.shape[0] != n:
            raise ValueError(
                message(
                    f"{self._call}{where}",
                    "v",
                    f"a tensor of shape [{n}] or [{n}, k], or a dict keyed like op.names",
                    describe(v),
                    "flatten parameter-shaped vectors with op.flatten(...)",
                )
            )
        if not v.is_floating_point():
            raise TypeError(
                message(
                    f"{self._call}{where}", "v", "a floating-point tensor", describe(v), "cast it"
                )
            )
        return v.to(dtype=self.dtype, device=self.device)

    def __matmul__(self, v: Any) -> Any:
        if isinstance(v, Mapping):
            return self.as_dict(self._matvec(self.flatten(v)))
        v = self._check(v)
        return self._matvec(v) if v.dim() == 1 else self._matmat(v)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``C v`` for ``v`` of shape ``[P]``."""
        return self._matvec(self._check(v).reshape(-1))

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``C V`` for ``V`` of shape ``[P, k]``."""
        V = self._check(V)
        return self._matmat(V if V.dim() == 2 else V[:, None])

    # -- products -----------------------------------------------------------------------------

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        if self._point is None or self._masks is not None:
            return self._matmat(v[:, None])[:, 0]
        with torch.enable_grad():
            return self._point.apply(v)

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        if V.shape[1] == 0:
            return V.clone()
        with torch.enable_grad():
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
        if self._point is not None:
            return self._columns(self._point, V)
        total: torch.Tensor | None = None
        for index, (inputs, targets, n) in enumerate(self._data):
            res = self._columns(self._make_point(inputs, targets, index), V)
            res = res * self._data.weight(n)
            total = res if total is None else total + res
        assert total is not None  # at least one batch (checked at construction)
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
                if not is_batching_error(err):
                    raise
                logger.debug("%s: batched backward failed (%s); one at a time", self._call, err)
                cols.append(torch.stack([point.apply(c) for c in block], dim=1))
        return torch.cat(cols, dim=1)

    # -- views ------------------------------------------------------------------------------

    def dense(self, *, max_size: int = DENSE_MAX, chunk: int = 256) -> torch.Tensor:
        """The matrix ``[P, P]``, ``chunk`` columns per product (for models up to ``max_size``
        parameters)."""
        n = self.shape[0]
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
        return torch.empty((), dtype=self.dtype).element_size()

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

        dtype = torch.empty((), dtype=self.dtype).numpy().dtype
        return LinearOperator(self.shape, matvec=mv, rmatvec=mv, matmat=mm, dtype=dtype)

    def check_deterministic(self, *, rtol: float | None = None) -> None:
        """Raise unless two evaluations of the same product agree (opt-in, costs 4 products).

        Catches data iterables that change between passes (shuffling, random augmentation),
        and models that are random in the forward (dropout in training mode).
        """
        from gradkit.testing import tolerances

        tol = rtol if rtol is not None else 1e3 * tolerances(self.dtype)[0]
        g = torch.Generator(device="cpu").manual_seed(0)
        v = torch.randn(self.shape[0], 2, generator=g, dtype=torch.float64).to(self.dtype)
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

"""Hessian-vector products: one-off (:func:`hvp`) and as a reusable operator
(:func:`hvp_operator`) that computes the first gradient once and keeps its graph.

Method: double backward (reverse over reverse), the fastest HVP in eager PyTorch on CPU
(about 2.4x a gradient, and about 1.4x per extra vector when the first-gradient graph is kept;
forward over reverse costs about 5x). Inside ``torch.func`` transforms (e.g. under ``vmap``)
double backward through ``torch.autograd`` is not available, and forward over reverse is used.

Convention, pinned by a test: for :math:`f(x) = \\tfrac12 x^\\top A x` the Hessian is
:math:`(A + A^\\top)/2` and the HVP is :math:`(A + A^\\top) v / 2` (TensorFlow's private
``_hessian_vector_product`` docstring says :math:`(A + A^\\top) v`, a factor-2 slip).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch

from gradkit._autograd import first_grads
from gradkit._autograd import second_grads as _second_grads
from gradkit._errors import GradkitError, describe, message
from gradkit._forward_ad import load_decompositions
from gradkit._state import TensorState, graph_leaves, named_state
from gradkit._validate import (
    check_bool,
    check_callable,
    check_choice,
    check_optional_int,
)
from gradkit.func._common import (
    _as_tuple,
    _check_differentiable,
    _check_floating_output,
    _check_like,
    _check_scalar,
    _mutation_errors,
    _name,
    _without_overlap,
    is_transformed,
    unbatched_retry,
)

__all__ = ["HVPOperator", "hvp", "hvp_operator"]

logger = logging.getLogger(__name__)

_METHODS = ("auto", "reverse_over_reverse", "forward_over_reverse")


@overload
def hvp(
    f: Callable[..., torch.Tensor], args: torch.Tensor, v: Any, *, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def hvp(
    f: Callable[..., torch.Tensor],
    args: Sequence[torch.Tensor],
    v: Any,
    *,
    method: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...


def hvp(
    f: Callable[..., torch.Tensor], args: Any, v: Any, *, method: str = "auto"
) -> tuple[torch.Tensor, Any]:
    r"""Hessian-vector product of a scalar function: ``(f(*args), H v)``.

    .. math:: \text{out}_k = \sum_j \frac{\partial^2 f}{\partial \text{args}_k
              \partial \text{args}_j} v_j

    Args:
        f: function of tensors returning a scalar tensor.
        args: a tensor or a tuple of tensors (the point).
        v: vectors with the structure and shapes of ``args``.
        method: ``"auto"`` (double backward, or forward over reverse inside ``torch.func``
            transforms), ``"reverse_over_reverse"`` or ``"forward_over_reverse"``.

    Returns:
        ``(value, hvp)``, ``hvp`` mirroring ``args``. A function whose second derivative is
        identically zero gives zeros. The result is detached from any graph ``args`` belong to.

    Examples:
        >>> import torch
        >>> from gradkit.func import hvp
        >>> value, hv = hvp(lambda x: (x**3).sum(), torch.tensor([1.0, 2.0]),
        ...                 torch.tensor([1.0, 0.0]))
        >>> hv
        tensor([6., 0.])
        >>> hvp(lambda x: (3 * x).sum(), torch.tensor([1.0]), torch.tensor([1.0]))[1]
        tensor([0.])
    """
    call = f"hvp({_name(f)})"
    check_callable(f, call)
    check_choice(method, _METHODS, call, "method")
    primals, was_seq = _as_tuple(args, call, "args")
    _check_differentiable(primals, range(len(primals)), call, argnums=False)
    vs, _ = _as_tuple(v, call, "v")
    _check_like(vs, primals, call, "v", "argument")
    with _mutation_errors(call):
        value, res = _hvp(f, primals, vs, method, call)
    return value, (tuple(res) if was_seq else res[0])


def _hvp(
    f: Callable[..., torch.Tensor],
    primals: tuple[torch.Tensor, ...],
    vs: tuple[torch.Tensor, ...],
    method: str,
    call: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(f(*primals), H vs)`` by the method :func:`hvp` documents."""
    if method == "forward_over_reverse" or (
        method == "auto" and any(is_transformed(p) for p in (*primals, *vs))
    ):

        def grad_f(*p: torch.Tensor) -> tuple[torch.Tensor, ...]:
            grads: tuple[torch.Tensor, ...] = torch.func.grad(f, argnums=tuple(range(len(p))))(*p)
            return grads

        value = f(*primals)
        _check_scalar(value, call)
        _check_floating_output(value, call)
        load_decompositions()
        try:
            hv = torch.func.jvp(grad_f, tuple(_without_overlap(p) for p in primals), vs)[1]
        except NotImplementedError as err:  # an autograd.Function without a forward-mode rule
            raise GradkitError(
                message(
                    call,
                    "f",
                    "operations with a forward-mode derivative (forward over reverse: "
                    + (
                        "asked for"
                        if method == "forward_over_reverse"
                        else "the method inside torch.func transforms such as vmap"
                    )
                    + ")",
                    f"one without (a custom_gradient or torch.autograd.Function): {err}",
                    "call hvp outside the transform with method='reverse_over_reverse' (a loop "
                    "over the vectors instead of vmap), or give the function a jvp rule",
                )
            ) from err
        res = list(hv)
    else:
        with torch.enable_grad():
            xs = [p.detach().requires_grad_(True) for p in primals]
            value = f(*xs)
            _check_scalar(value, call)
            _check_floating_output(value, call)
            gs = first_grads(value, xs, call=call)
            res = _second_grads(gs, xs, vs, retain_graph=False)
        value = value.detach()
    return value, list(res)


_VECTORIZE_MAX = 10_000


def _check_one_dtype(xs: Sequence[torch.Tensor], call: str) -> None:
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1:
        raise TypeError(
            message(
                call,
                "args",
                "tensors of one dtype",
                ", ".join(str(d) for d in dtypes),
                "convert the arguments to one dtype",
            )
        )


class HVPOperator:
    """The Hessian of a scalar at a fixed point as a matrix-free linear operator.

    The first gradient is computed once, with its graph kept; each product is one backward
    through that graph. Vectors are flat: the arguments are concatenated in order
    (:meth:`flatten` / :meth:`unflatten` convert). Follows scipy's convention: ``op @ v`` for a
    vector ``[n]``, ``op @ V`` for a matrix ``[n, k]`` whose columns are vectors.

    The operator is the Hessian at the point it was built at and cannot recompute itself (the
    function is not kept, only its graph). A product after that point changed raises a
    :class:`~gradkit.GradkitError` instead of mixing old and new values: the differentiated
    tensors and the parameters the function captured are compared before every product by
    version counter (``optimizer.step()``, ``p.add_`` under ``no_grad``), storage and values
    (an edit of ``p.data`` bumps no version; a copy of them is kept); for
    :func:`gradkit.func.module_hvp_operator` also every parameter, buffer and module mode of the
    model. :func:`gradkit.func.hvp_operator` differentiates a copy of ``args``: later edits of
    ``args`` do not move the point. Build a new operator after an optimizer step, or use
    :class:`gradkit.curvature.Hessian`, which follows the model.

    Attributes:
        shape: ``(n, n)``.
        value: the scalar at the point (detached).
        gradient: the flat gradient at the point (detached), ``[n]``.
        names: parameter names in flat order (operators from a module), else None.
    """

    def __init__(
        self,
        value: torch.Tensor,
        xs: Sequence[torch.Tensor],
        *,
        chunk_size: int | None = None,
        call: str = "hvp_operator",
        names: Sequence[str] | None = None,
        shapes: Sequence[torch.Size] | None = None,
        vectorize: bool | None = None,
        track: Sequence[tuple[str, torch.Tensor]] | None = None,
        modules: torch.nn.Module | None = None,
        rebuild: str = "hvp_operator(f, args)",
    ) -> None:
        chunk_size = check_optional_int(chunk_size, call, "chunk_size")
        vectorize = check_bool(vectorize, call, "vectorize", optional=True)
        _check_scalar(value, call)
        _check_floating_output(value, call)
        _check_one_dtype(xs, call)
        self._xs = list(xs)
        self._gs = first_grads(value, self._xs, call=call)
        if track is None:  # the arguments, and the leaves the function captured (parameters)
            own = {id(x) for x in self._xs}
            captured = [t for t in graph_leaves([value]) if id(t) not in own]
            track = [(f"argument {i}", x) for i, x in enumerate(self._xs)]
            track += [(f"captured {describe(t)}", t) for t in captured]
        self._state = TensorState(track, modules=modules)
        # the model's parameters and buffers by object: one replaced (a new nn.Parameter, a layer
        # swapped) leaves the kept graph on the old one, whose state never changes
        self._model = modules
        self._objects = self._model_objects()
        self._rebuild = rebuild
        self._sizes = [x.numel() for x in self._xs]
        self._shapes = (
            [torch.Size(s) for s in shapes] if shapes is not None else [x.shape for x in self._xs]
        )
        n = sum(self._sizes)
        self.vectorize = n <= _VECTORIZE_MAX if vectorize is None else vectorize
        self.shape = (n, n)
        self.dtype = self._xs[0].dtype
        self.device = self._xs[0].device
        self.chunk_size = chunk_size
        self.value = value.detach()
        self.gradient = torch.cat(
            [
                (torch.zeros_like(x) if g is None else g.detach()).reshape(-1)
                for g, x in zip(self._gs, self._xs, strict=True)
            ]
        )
        self._call = call
        self.names = list(names) if names is not None else None

    def __repr__(self) -> str:
        return f"HVPOperator(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate tensors shaped like the arguments into one vector ``[n]``."""
        refs = [torch.empty(s, device="meta") for s in self._shapes]
        _check_like(tensors, refs, self._call, "tensors", "argument", dtype=False)
        return torch.cat([t.reshape(-1) for t in tensors])

    def unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Split a vector ``[n]`` (or ``[n, k]``) into pieces shaped like the arguments."""
        tail = vector.shape[1:]
        sizes = [s.numel() for s in self._shapes]
        return [
            p.reshape((*s, *tail)) for p, s in zip(vector.split(sizes), self._shapes, strict=True)
        ]

    def _check_vector(self, v: Any) -> torch.Tensor:
        n = self.shape[0]
        if not isinstance(v, torch.Tensor) or v.dim() not in (1, 2) or v.shape[0] != n:
            raise ValueError(
                message(
                    f"{self._call} @ v",
                    "v",
                    f"a tensor of shape [{n}] or [{n}, k]",
                    describe(v),
                    "flatten the vector(s) with op.flatten(...)",
                )
            )
        if v.dtype != self.dtype:  # a silent cast would round (float64) or truncate (integers)
            raise TypeError(
                message(
                    f"{self._call} @ v",
                    "v",
                    f"dtype {self.dtype} (that of the operator)",
                    describe(v),
                    f"convert it with v.to({self.dtype})",
                )
            )
        return v

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` for a flat vector ``v`` of shape ``[n]``."""
        return self._apply(self._check_vector(v))

    def _model_objects(self) -> list[tuple[str, int]] | None:
        if self._model is None:
            return None
        return [(label, id(t)) for label, t in named_state(self._model)]

    def _check_current(self) -> None:
        """Refuse products after the point changed: the kept graph holds the old values."""
        why = None
        if self._model is not None and self._model_objects() != self._objects:
            why = "a parameter or buffer of the model was replaced by another object, as "
            why += "assigning a new nn.Parameter or swapping a layer does,"
        why = why or self._state.changed()
        if why is not None:
            raise GradkitError(
                f"{self._call} @ v: the operator was built at other values ({why} after it "
                "was built); its kept graph holds the old values, so products would mix old and "
                "new ones. "
                f"Build a new operator at the current values ({self._rebuild}), or use "
                "gradkit.curvature.Hessian(model, loss_fn, data), which follows the model"
            )

    @contextlib.contextmanager
    def _inplace_errors(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:
            if "modified by an inplace operation" not in str(err):
                raise
            raise GradkitError(
                f"{self._call} @ v: a tensor the function depends on was modified in place "
                f"after the operator was built ({str(err).split(';')[0]}); build a new operator "
                f"at the current values ({self._rebuild})"
            ) from err

    def _apply(self, v: torch.Tensor) -> torch.Tensor:
        self._check_current()
        with self._inplace_errors():
            return self._apply_unchecked(v)

    def _apply_unchecked(self, v: torch.Tensor) -> torch.Tensor:
        if len(self._xs) == 1:  # one flat leaf: no split, no concatenation
            return _second_grads(self._gs, self._xs, [v.view(self._xs[0].shape)])[0].reshape(-1)
        vs = [p.view(x.shape) for p, x in zip(v.split(self._sizes), self._xs, strict=True)]
        return torch.cat([r.reshape(-1) for r in _second_grads(self._gs, self._xs, vs)])

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``H V`` for a matrix ``V`` of shape ``[n, k]`` (vectorized over columns)."""
        return self._apply_columns(self._check_vector(V))

    def _apply_columns(self, V: torch.Tensor) -> torch.Tensor:
        self._check_current()
        with self._inplace_errors():
            return self._apply_columns_unchecked(V)

    def _apply_columns_unchecked(self, V: torch.Tensor) -> torch.Tensor:
        if not self.vectorize:
            return torch.stack([self._apply_unchecked(c) for c in V.T], dim=1)
        k = V.shape[1]
        step = k if self.chunk_size is None else self.chunk_size
        cols = []
        for start in range(0, k, step):
            block = V[:, start : start + step].T  # [c, n]
            vs = [
                p.reshape(-1, *x.shape)
                for p, x in zip(block.split(self._sizes, dim=1), self._xs, strict=True)
            ]
            try:
                res = _second_grads(self._gs, self._xs, vs, batched=True)
                cols.append(torch.cat([r.reshape(len(block), -1) for r in res], dim=1).T)
            except RuntimeError as err:
                head = unbatched_retry(err, functools.partial(self._apply_unchecked, block[0]))
                logger.debug(
                    "%s: vectorized backward failed (%s); one vector at a time", self._call, err
                )
                rest = [self._apply_unchecked(c) for c in block[1:]]
                cols.append(torch.stack([head, *rest], dim=1))
        return torch.cat(cols, dim=1)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        v = self._check_vector(v)
        return self._apply(v) if v.dim() == 1 else self._apply_columns(v)

    def as_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a vector ``[n]`` (or ``[n, k]``) by parameter name (module operators only)."""
        if self.names is None:
            raise ValueError(
                message(
                    f"{self._call}.as_dict(vector)",
                    "self",
                    "an operator built from a module (it has names)",
                    "a functional operator",
                    "use op.unflatten(vector)",
                )
            )
        return dict(zip(self.names, self.unflatten(vector), strict=True))

    def to_dense(self) -> torch.Tensor:
        """The full Hessian ``[n, n]`` (n products; for small n)."""
        return self.matmat(torch.eye(self.shape[0], dtype=self.dtype, device=self.device))

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` (numpy in and out) for scipy's solvers."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def mv(v: np.ndarray) -> np.ndarray:
            t = torch.as_tensor(np.asarray(v).reshape(-1), dtype=self.dtype, device=self.device)
            return self.matvec(t).detach().cpu().numpy()

        def mm(V: np.ndarray) -> np.ndarray:
            t = torch.as_tensor(np.asarray(V), dtype=self.dtype, device=self.device)
            return self.matmat(t).detach().cpu().numpy()

        dtype = torch.empty((), dtype=self.dtype, device="cpu").numpy().dtype
        return LinearOperator(self.shape, matvec=mv, rmatvec=mv, matmat=mm, dtype=dtype)


def hvp_operator(
    f: Callable[..., torch.Tensor],
    args: Any,
    *,
    chunk_size: int | None = None,
    vectorize: bool | None = None,
) -> HVPOperator:
    r"""The Hessian of ``f`` at ``args`` as a reusable operator (first gradient computed once).

    Args:
        f: function of tensors returning a scalar tensor.
        args: a tensor or a tuple of tensors of one dtype (the point).
        chunk_size: how many columns ``op @ V`` pushes through one vectorized backward.
        vectorize: whether ``op @ V`` vectorizes over columns (``is_grads_batched``) or loops;
            default: vectorize up to 10,000 elements, where per-operation overhead dominates,
            loop above (a batched backward of a large model is slower per column on CPU).

    Returns:
        An :class:`HVPOperator` of shape ``(n, n)``, ``n`` the total number of elements.

    Examples:
        >>> import torch
        >>> from gradkit.func import hvp_operator
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 4.0]])
        >>> op = hvp_operator(lambda x: 0.5 * x @ A @ x, torch.ones(2))
        >>> op @ torch.tensor([1.0, 0.0])
        tensor([2., 1.])
        >>> op @ torch.eye(2)
        tensor([[2., 1.],
                [1., 4.]])
    """
    call = f"hvp_operator({_name(f)})"
    check_callable(f, call)
    primals, _ = _as_tuple(args, call, "args")
    _check_differentiable(primals, range(len(primals)), call, argnums=False)
    _check_one_dtype(primals, call)
    with torch.enable_grad():
        # one flat leaf with the arguments as views: products need no split or concatenation
        flat = torch.cat([p.detach().reshape(-1) for p in primals]).requires_grad_(True)
        views = [
            t.view(p.shape)
            for t, p in zip(flat.split([p.numel() for p in primals]), primals, strict=True)
        ]
        with _mutation_errors(call):
            value = f(*views)
        return HVPOperator(
            value,
            [flat],
            chunk_size=chunk_size,
            call=call,
            shapes=[p.shape for p in primals],
            vectorize=vectorize,
        )

"""The generalized Gauss-Newton matrix ``J^T H_out J`` as a matrix-free operator.

Index legend: ``n`` example, ``o`` output feature (all output dimensions but the first, flat),
``k`` vectors, ``P`` parameters.

Products use autograd only (no forward-mode AD, so an ``autograd.Function`` without ``jvp``
works):

1. ``J v`` by the double-backward trick: with ``u`` a dummy output gradient that requires
   grad, ``g(u) = J^T u`` is one backward with ``create_graph=True`` (built once per batch);
   ``J v`` is the gradient of ``<g(u), v>`` w.r.t. ``u``, one backward through that graph;
2. ``H_out (J v)`` by double backward of the loss w.r.t. the detached output (tiny);
3. ``J^T (...)`` by one backward through the forward graph (kept).

About 2x a gradient from scratch; the loss Hessian ``H_out`` is never materialized.
"""

from __future__ import annotations

from typing import Any

import torch

from gradkit._autograd import find_error_nodes
from gradkit._errors import GradkitError, describe, message
from gradkit.curvature._base import CurvatureOperator, Layout, Point
from gradkit.curvature._data import Data, forward_graph
from gradkit.curvature._diag import factor_diagonal
from gradkit.func._common import unbatched_retry

__all__ = ["GGN", "JPoint", "LossHessian", "loss_hessian_blocks", "output_factors"]


class JPoint:
    """The model's Jacobian ``J`` (output w.r.t. parameters) at one batch: ``jvp`` and ``vjp``,
    both batched over a leading dimension of vectors on request."""

    def __init__(self, layout: Layout, data: Data, inputs: Any) -> None:
        self._layout = layout
        out = data.forward(inputs)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() == 0:
            raise TypeError(
                message(
                    data.call,
                    "model",
                    "a model returning one floating-point tensor with a batch dimension",
                    describe(out),
                    "wrap the model so that it returns the tensor the loss takes",
                )
            )
        self.out = out
        self._g: tuple[torch.Tensor | None, ...] | None = None
        self._live: list[int] = []
        if not out.requires_grad:
            self._g = (None,) * len(layout.params)
            self.unused = list(range(len(layout.params)))
            self.errors: list[str] = []
            return
        # which parameters the output reaches, from the forward graph; the J^T u graph that
        # jvp needs is built at the first jvp (a diagonal or a vjp never needs it), except
        # where a custom autograd.Function or a fused attention kernel may refuse a second
        # backward: those are found in that graph, now
        reached, suspect = forward_graph(out)
        self.unused = [i for i, p in enumerate(layout.params) if id(p) not in reached]
        self.errors = []
        if suspect:
            self.errors = find_error_nodes(out, self.g, weight_norm=False)  # J v: linear in u

    @property
    def g(self) -> tuple[torch.Tensor | None, ...]:
        """``J^T u`` per parameter, with its graph (``u`` a dummy output gradient)."""
        if self._g is None:
            self.u = torch.zeros_like(self.out, requires_grad=True)
            with torch.enable_grad():
                self._g = torch.autograd.grad(
                    self.out, self._layout.params, self.u, create_graph=True, allow_unused=True
                )
            self._live = [i for i, g in enumerate(self._g) if g is not None and g.requires_grad]
        return self._g

    def jvp(self, v: torch.Tensor, batched: bool = False) -> torch.Tensor:
        """``J v``: ``[P] -> out.shape`` (``[k, P] -> [k, *out.shape]`` when batched)."""
        lead = (v.shape[0],) if batched else ()
        gs = self.g
        if not self._live:
            return self.out.new_zeros((*lead, *self.out.shape))
        parts = self._layout.split(v, batched)
        (res,) = torch.autograd.grad(
            [g for g in gs if g is not None and g.requires_grad],
            [self.u],
            [parts[i] for i in self._live],
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=batched,
        )
        return self.out.new_zeros((*lead, *self.out.shape)) if res is None else res

    def vjp(self, w: torch.Tensor, batched: bool = False) -> torch.Tensor:
        """``J^T w``: ``out.shape -> [P]`` (``[k, *out.shape] -> [k, P]`` when batched)."""
        lay = self._layout
        lead = (w.shape[0],) if batched else ()
        if not self.out.requires_grad:
            return w.new_zeros((*lead, lay.n))
        res = torch.autograd.grad(
            self.out,
            lay.params,
            w,
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=batched,
        )
        parts = [
            p.new_zeros((*lead, *p.shape)) if r is None else r
            for r, p in zip(res, lay.params, strict=True)
        ]
        return lay.cat(parts, batched)


_FEW = 4
"""Up to this many vectors, products with the loss Hessian are taken one by one."""


class LossHessian:
    """``H_out``, the Hessian of the loss w.r.t. the (detached) model output, applied by double
    backward; ``r`` is the loss gradient w.r.t. the output (with its graph, built at first
    use: the loss itself is evaluated, and checked, at once)."""

    def __init__(self, data: Data, out: torch.Tensor, targets: torch.Tensor) -> None:
        self.od = out.detach().requires_grad_(True)
        with torch.enable_grad():
            self._loss: torch.Tensor | None = data.loss(self.od, targets)
        self._r: torch.Tensor | None = None

    @property
    def r(self) -> torch.Tensor:
        if self._r is None:
            assert self._loss is not None
            with torch.enable_grad():
                (r,) = torch.autograd.grad(
                    self._loss, self.od, create_graph=True, allow_unused=True
                )
            self._r = torch.zeros_like(self.od) if r is None else r
            self._loss = None
        return self._r

    def apply(self, U: torch.Tensor, batched: bool = False) -> torch.Tensor:
        r = self.r
        if not r.requires_grad:  # a loss linear in the output
            return torch.zeros_like(U)
        (res,) = torch.autograd.grad(
            r, self.od, U, retain_graph=True, allow_unused=True, is_grads_batched=batched
        )
        return torch.zeros_like(U) if res is None else res

    def apply_each(self, U: torch.Tensor) -> torch.Tensor:
        """Products with every ``U[k]``: one batched backward (one per vector for a few
        vectors, where vmap's setup costs more than the products, or where the loss has an
        operation without a batching rule)."""
        if U.shape[0] <= _FEW:
            return torch.stack([self.apply(u) for u in U])
        try:
            return self.apply(U, batched=True)
        except RuntimeError as err:
            head = unbatched_retry(err, lambda: self.apply(U[0]))
            return torch.stack([head, *[self.apply(u) for u in U[1:]]])


class _GGNPoint(Point):
    def __init__(self, layout: Layout, data: Data, inputs: Any, targets: torch.Tensor) -> None:
        self.j = JPoint(layout, data, inputs)
        self.h = LossHessian(data, self.j.out, targets)
        self.unused, self.errors = self.j.unused, self.j.errors

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return self.j.vjp(self.h.apply(self.j.jvp(v)))

    def apply_batched(self, V: torch.Tensor) -> torch.Tensor:
        return self.j.vjp(self.h.apply(self.j.jvp(V, True), True), True)


class GGN(CurvatureOperator):
    r"""The generalized Gauss-Newton matrix, matrix-free.

    .. math:: G = \sum_b w_b\, J_b^\top H_b J_b, \qquad
              J_b = \frac{\partial f_\theta(x_b)}{\partial \theta},\quad
              H_b = \nabla^2_{f}\, \ell(f, y_b)\big|_{f = f_\theta(x_b)}

    with ``w_b = Z_b / Z`` (mean, as for :class:`Hessian`) or 1 (sum). ``G`` is positive
    semi-definite for losses convex in the output (cross entropy, MSE); it equals the Hessian
    when the model is linear in the parameters, or piecewise linear (ReLU networks) with MSE.
    Each product is about 2x a gradient (autograd only: ``J v`` by the double-backward trick,
    ``H_out`` by double backward of the loss w.r.t. the output, ``J^T`` by a backward).
    :func:`diagonal` gives its exact diagonal from per-example gradients
    (:mod:`gradkit.per_example`).

    Args:
        model: the model; it must return one tensor, the loss's first argument, with the
            examples along dimension 0.
        loss_fn: ``loss_fn(output, targets)`` returning a scalar.
        data: a pair ``(inputs, targets)`` or a re-iterable of pairs.
        params, blocks, reduction, vectorize, chunk_size: as for :class:`Hessian`.

    Returns:
        A :class:`CurvatureOperator` of shape ``(P, P)``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.curvature import GGN, Hessian
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = nn.Linear(3, 2).double()
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> G = GGN(model, nn.functional.mse_loss, (x, y))
        >>> torch.allclose(G.dense(), Hessian(model, nn.functional.mse_loss, (x, y)).dense())
        True
    """

    _kind = "GGN"

    def _make_point(self, inputs: Any, targets: torch.Tensor, index: int) -> Point:
        return _GGNPoint(self._layout, self._data, inputs, targets)

    def _exact_diagonal(self, *, max_size: int, max_memory: int, call: str) -> torch.Tensor:
        def factors(
            out: torch.Tensor, targets: torch.Tensor, index: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return output_factors(self._data, out, targets, max_memory=max_memory, call=call)

        return factor_diagonal(self._data, self._layout, factors, call=call)


def loss_hessian_blocks(
    data: Data, out: torch.Tensor, targets: torch.Tensor, *, max_memory: int, call: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every example's block of the loss Hessian w.r.t. the output, ``[N, O, O]`` in float64,
    and the loss gradient w.r.t. the output ``[N, O]``.

    The blocks come from ``O`` batched products of the loss Hessian: exact for a loss that is a
    sum over examples, which is checked with one random product.
    """
    h = LossHessian(data, out, targets)
    n = out.shape[0]
    o = out[0].numel()
    need = n * o * o * 8 * 3
    if need > max_memory:
        raise GradkitError(
            message(
                call,
                "max_memory",
                f"room for the per-example loss Hessians ({n} x {o} x {o}, {need / 2**20:.0f} MiB)",
                f"{max_memory / 2**20:.0f} MiB",
                "raise max_memory, or use method='hutchinson' / 'hutch++'",
            )
        )
    eye = torch.eye(o, dtype=out.dtype, device=out.device)
    E = eye[:, None, :].expand(o, n, o).reshape(o, *out.shape)
    HE = h.apply_each(E)
    blocks = HE.reshape(o, n, o).permute(1, 2, 0).double()  # [n, row, col]
    gen = torch.Generator(device=out.device).manual_seed(0)
    z = torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)
    direct = h.apply(z).reshape(n, o).double()
    assembled = torch.einsum("nij,nj->ni", blocks, z.reshape(n, o).double())
    scale = float(direct.abs().max()) + float(assembled.abs().max())
    eps = torch.finfo(out.dtype).eps
    if float((direct - assembled).abs().max()) > 1e3 * eps * max(scale, 1e-300):
        raise GradkitError(
            f"{call}: the loss couples examples (its Hessian w.r.t. "
            "the output is not block-diagonal over dimension 0), so the exact diagonal from "
            "per-example terms does not apply; use method='hutchinson' or 'hutch++'"
        )
    return (blocks + blocks.transpose(1, 2)) / 2, h.r.detach().reshape(n, o)


def _softmax_factors(data: Data, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    r"""The closed-form factors of a softmax cross-entropy's output Hessian, or None.

    The Hessian of ``-log softmax(z)_y`` (and of any target distribution, label smoothing
    included) w.r.t. the logits ``z`` is ``diag(p) - p p^T = M M^T`` with ``M = diag(\sqrt p) -
    p \sqrt p^T``, whose column ``k`` is ``\sqrt{p_k} (e_k - p)``. The loss's block for example
    ``n`` is ``c_n (diag(p_n) - p_n p_n^T)`` for a weight ``c_n >= 0`` (the reduction, a class
    weight, 0 for an ignored target); whether it is, and ``c_n``, are read from two products of
    the actual loss Hessian with random vectors, so any other loss falls back to the general
    eigendecomposition. ``C`` columns, no eigendecomposition, two products instead of ``C + 1``.
    """
    if out.dim() != 2 or out.shape[0] == 0 or out.shape[1] < 2 or not out.is_floating_point():
        return None
    h = LossHessian(data, out, targets)
    gen = torch.Generator(device=out.device).manual_seed(1)
    Z = torch.randn((2, *out.shape), generator=gen, dtype=out.dtype, device=out.device)
    HZ = h.apply_each(Z)
    p = torch.softmax(out.detach().double(), dim=1)  # [n, C]
    Z64, HZ64 = Z.double(), HZ.double()
    BZ = p * Z64 - p * (p * Z64).sum(-1, keepdim=True)  # (diag(p) - p p^T) z, per example
    norm2 = BZ.square().sum((0, 2))
    c = (HZ64 * BZ).sum((0, 2)) / norm2.clamp_min(1e-300)  # [n]
    residual = (HZ64 - c[None, :, None] * BZ).abs().max()
    scale = HZ64.abs().max() + (c[None, :, None] * BZ).abs().max()
    if float(residual) > 1e3 * torch.finfo(out.dtype).eps * max(float(scale), 1e-300):
        return None
    if bool((c < 0).any()):
        return None
    eye = torch.eye(out.shape[1], dtype=torch.float64, device=out.device)
    cols = (p * c[:, None]).sqrt().T[:, :, None] * (eye[:, None, :] - p[None])  # [C, n, C]
    return cols.to(out.dtype)


def output_factors(
    data: Data, out: torch.Tensor, targets: torch.Tensor, *, max_memory: int, call: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns ``s_c`` with ``H_n = sum_c s_nc s_nc^T - sum_c t_nc t_nc^T`` for every example's
    block of the loss Hessian w.r.t. the output: ``(s [C+, *out], t [C-, *out])``; in closed
    form for a softmax cross entropy (:func:`_softmax_factors`), else from an eigenvalue
    decomposition in float64 of each block (:func:`loss_hessian_blocks`).
    """
    n, o = out.shape[0], out[0].numel()
    if n * o * o * 8 * 3 <= max_memory:
        closed = _softmax_factors(data, out, targets)
        if closed is not None:
            return closed, closed[:0]
    blocks, _ = loss_hessian_blocks(data, out, targets, max_memory=max_memory, call=call)
    o = blocks.shape[1]
    lam, vecs = torch.linalg.eigh(blocks)
    tiny = o * torch.finfo(torch.float64).eps * 4 * lam.abs().amax(1, keepdim=True)
    cols = vecs * lam.abs().sqrt()[:, None, :]  # [n, o, c]
    pos = torch.where((lam > tiny)[:, None, :], cols, 0.0)
    neg = torch.where((lam < -tiny)[:, None, :], cols, 0.0)

    def pick(c: torch.Tensor) -> torch.Tensor:
        keep = c.abs().amax((0, 1)) > 0
        return c[:, :, keep].permute(2, 0, 1).reshape(-1, *out.shape).to(out.dtype)

    return pick(pos), pick(neg)

"""The Hessian of the loss w.r.t. the parameters as a matrix-free operator.

Products are double backward (reverse over reverse), the fastest HVP in eager PyTorch: the first
gradient is computed with its graph kept (``create_graph=True``), and each product is one
backward of ``<g, v>`` through that graph (:func:`gradkit.func.hvp_operator` does the same for
functions). A single batch keeps that graph for the operator's lifetime; several batches rebuild
it per product, batch by batch.
"""

from __future__ import annotations

from typing import Any

import torch

from gradkit._autograd import find_error_nodes
from gradkit._autograd import second_grads as _second_grads
from gradkit._errors import GradkitError
from gradkit.curvature._base import CurvatureOperator, Layout, Point
from gradkit.curvature._data import Data
from gradkit.curvature._mlp_diag import mlp_hessian_diagonal, mlp_layers

__all__ = ["Hessian"]


class _HessianPoint(Point):
    def __init__(self, layout: Layout, data: Data, inputs: Any, targets: torch.Tensor) -> None:
        loss = data.loss(data.forward(inputs), targets)
        self._layout = layout
        self._gs = torch.autograd.grad(loss, layout.params, create_graph=True, allow_unused=True)
        self.unused = [i for i, g in enumerate(self._gs) if g is None]
        self.errors = find_error_nodes(loss, self._gs)

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        lay = self._layout
        return lay.cat(_second_grads(self._gs, lay.params, lay.split(v)))

    def apply_batched(self, V: torch.Tensor) -> torch.Tensor:
        lay = self._layout
        parts = _second_grads(self._gs, lay.params, lay.split(V, True), batched=True)
        return lay.cat(parts, True)


class Hessian(CurvatureOperator):
    r"""The Hessian of the loss w.r.t. the parameters, matrix-free.

    .. math:: H = \sum_b w_b \, \nabla^2_\theta\, \ell\big(f_\theta(x_b), y_b\big),
              \qquad w_b = Z_b / Z \text{ (mean) or } 1 \text{ (sum)}

    with ``Z_b`` what the mean of batch ``b`` divides by: its ``n_b`` examples, or for
    ``nn.CrossEntropyLoss``/``nn.NLLLoss`` and their functions the sum of the class weights of
    its targets not equal to ``ignore_index`` (their number without ``weight``).

    Each product ``op @ v`` is one double backward: about 2.4x a gradient for the first vector
    of a batch, about 1.4x for every further vector (the first-gradient graph is kept for a
    single batch; several batches recompute it per product).

    Args:
        model: the model; ``model(inputs)`` (``model(*inputs)`` for a tuple).
        loss_fn: ``loss_fn(output, targets)`` returning a scalar.
        data: a pair ``(inputs, targets)`` or a re-iterable of pairs (then the operator equals
            the one of all batches concatenated, for mean and sum losses alike; a mean
            ``loss_fn`` that is a lambda or any other function is taken to be a mean over the
            batch's examples: for a mean over tokens, pass ``reduction="sum"`` and divide by
            the total count, see curvature.md).
        params: names of the parameters to differentiate (default: all with
            ``requires_grad=True``, in ``named_parameters()`` order).
        blocks: ``"full"``, ``"layer"`` (one diagonal block per module), ``"param"`` (one per
            parameter) or lists of names; off-block entries are exactly 0.
        reduction: how ``loss_fn`` combines the examples of a batch, ``"mean"`` or ``"sum"``
            (checked against ``loss_fn.reduction`` where it has one).
        vectorize: ``op @ V`` with one batched backward for all columns (default: for up to
            10,000 parameters) or one backward per column.
        chunk_size: columns per batched backward.

    Returns:
        A :class:`CurvatureOperator` of shape ``(P, P)``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.curvature import Hessian
        >>> model = nn.Linear(2, 1, bias=False)
        >>> x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0]])
        >>> H = Hessian(model, nn.functional.mse_loss, (x, y))
        >>> H @ torch.tensor([1.0, 0.0])
        tensor([2., 4.])
        >>> H.dense()
        tensor([[2., 4.],
                [4., 8.]])

    Warning:
        An ``autograd.Function`` in the model must have a differentiable backward (written
        with torch operations); one marked ``@once_differentiable`` is refused at
        construction. Parameters the loss does not use get zero rows and a warning.
    """

    _kind = "Hessian"

    def _make_point(self, inputs: Any, targets: torch.Tensor, index: int) -> Point:
        return _HessianPoint(self._layout, self._data, inputs, targets)

    def _exact_diagonal(self, *, max_size: int, max_memory: int, call: str) -> torch.Tensor:
        """Sequential MLPs: one sweep of per-example Hessian blocks; otherwise unit vectors."""
        layers = mlp_layers(self._data.model)
        if layers is not None:
            try:
                d = mlp_hessian_diagonal(
                    self._data, self._layout, layers, max_memory=max_memory, call=call
                )
            except GradkitError:  # a loss that couples examples, or too many outputs
                d = None
            if d is not None:
                return d
        return super()._exact_diagonal(max_size=max_size, max_memory=max_memory, call=call)

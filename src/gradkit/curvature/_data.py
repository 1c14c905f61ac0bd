"""What a curvature operator is built from: the model's selected parameters, the loss and the data.

Conventions (shared by every operator):

* ``data`` is one pair ``(inputs, targets)`` (``targets`` a tensor) or a re-iterable of such
  pairs (a list, a ``DataLoader``); ``model(*inputs)`` is called when ``inputs`` is a tuple;
* examples are indexed by dimension 0 of the inputs, the outputs and the targets;
* ``reduction`` says how ``loss_fn`` combines the examples of one batch: ``"mean"`` (batch ``b``
  of ``n_b`` examples then weighs ``n_b / N``, so several batches equal one batch of ``N``) or
  ``"sum"`` (weight 1);
* the parameters are those with ``requires_grad=True`` (frozen ones are skipped) or those named
  in ``params``, in ``model.named_parameters()`` order; buffers are never changed: modules in
  training mode that own buffers (BatchNorm running statistics) run on copies of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from gradkit._autograd import graph_nodes
from gradkit._errors import describe, message
from gradkit._params import LossFn
from gradkit._params import select_params as choose
from gradkit._validate import check_choice

__all__ = [
    "Data",
    "LossFn",
    "check_generator",
    "find_error_nodes",
    "forward_graph",
    "select_params",
]

Batch = tuple[Any, torch.Tensor]
T = TypeVar("T")


def select_params(
    model: nn.Module, params: Iterable[str] | str | None, call: str
) -> dict[str, torch.Tensor]:
    """The differentiated parameters by name, in ``model.named_parameters()`` order, of one
    floating dtype and device."""
    chosen = choose(model, params, call, fix="pass the model whose curvature to compute")
    dtypes = {p.dtype for p in chosen.values()}
    devices = {p.device for p in chosen.values()}
    if len(dtypes) != 1 or len(devices) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TypeError(
            message(
                call,
                "model",
                "floating-point parameters of one dtype on one device",
                f"dtypes {sorted(map(str, dtypes))} on {sorted(map(str, devices))}",
                "convert the model with model.to(dtype, device)",
            )
        )
    if next(iter(devices)).type == "meta":
        raise ValueError(
            message(
                call,
                "model",
                "parameters with values",
                "parameters on the meta device (shapes only)",
                "materialize the model first (model.to_empty(device=...) and load_state_dict)",
            )
        )
    return chosen


def check_generator(generator: Any, call: str) -> torch.Generator | None:
    """``generator`` if it is a ``torch.Generator`` or ``None``, else a TypeError naming
    ``call`` (Fisher's samples and the estimators' probes take one)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            message(
                call,
                "generator",
                "a torch.Generator or None",
                describe(generator),
                "pass torch.Generator().manual_seed(0)",
            )
        )
    return generator


def _is_pair(data: Any) -> bool:
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        return False
    inputs, targets = data
    ok_inputs = isinstance(inputs, torch.Tensor) or (
        isinstance(inputs, tuple) and any(isinstance(t, torch.Tensor) for t in inputs)
    )
    return ok_inputs and isinstance(targets, torch.Tensor)


def _batch_size(inputs: Any, call: str) -> int:
    first = (
        inputs
        if isinstance(inputs, torch.Tensor)
        else next(t for t in inputs if isinstance(t, torch.Tensor))
    )
    if first.dim() == 0:
        raise ValueError(
            message(
                call,
                "data",
                "inputs with a batch dimension (dimension 0)",
                describe(first),
                "add one with x.unsqueeze(0)",
            )
        )
    return int(first.shape[0])


def _check_batch(inputs: Any, index: int | None, call: str) -> int:
    """The number of examples of one batch: at least one."""
    n = _batch_size(inputs, call)
    if n == 0:
        raise ValueError(
            message(
                call,
                "data" if index is None else f"data[{index}]",
                "a batch of at least one example",
                "a batch of 0 examples (the operator would be 0, or nan for a mean loss)",
                "drop empty batches from data",
            )
        )
    return n


def forward_graph(out: torch.Tensor) -> tuple[set[int], bool]:
    """The ids of the leaf tensors ``out``'s graph reaches (its parameters) and whether it holds
    a custom ``autograd.Function`` node: one walk of the forward graph."""
    custom = torch.autograd.function.BackwardCFunction
    reached: set[int] = set()
    has_custom = False
    for node in graph_nodes([out.grad_fn]):
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        has_custom = has_custom or isinstance(node, custom)
    return reached, has_custom


def find_error_nodes(forward: torch.Tensor, grads: Iterable[torch.Tensor | None]) -> list[str]:
    """Names of nodes in the graph of the first gradients ``grads`` that silently drop a second
    backward: the ``Error`` nodes an ``@once_differentiable`` backward leaves. Only custom
    ``autograd.Function`` nodes in the forward graph (of ``forward``) can leave them, so that
    smaller graph is searched first."""
    custom = torch.autograd.function.BackwardCFunction
    if not any(isinstance(n, custom) for n in graph_nodes([forward.grad_fn])):
        return []
    roots = [t.grad_fn for t in grads if t is not None and t.grad_fn is not None]
    return sorted({n.name() for n in graph_nodes(roots) if "Error" in type(n).__name__})


class Data:
    """The model, the loss and the batches of one operator.

    Attributes:
        single: whether ``data`` was one pair (products then reuse one kept graph).
        num_examples: ``N``, the examples over all batches.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        data: Any,
        *,
        reduction: str,
        call: str,
    ) -> None:
        self.call = call
        self.model = model
        self._buffered = [m for m in model.modules() if next(m.buffers(False), None) is not None]
        if not callable(loss_fn):
            raise TypeError(
                message(
                    call,
                    "loss_fn",
                    "a callable loss_fn(output, target) returning a scalar",
                    describe(loss_fn),
                    "pass e.g. torch.nn.functional.cross_entropy",
                )
            )
        self.loss_fn = loss_fn
        self.reduction = check_choice(reduction, ("mean", "sum"), call, "reduction")
        declared = getattr(loss_fn, "reduction", None)
        if isinstance(declared, str) and declared != reduction:
            raise ValueError(
                message(
                    call,
                    "reduction",
                    f"the reduction loss_fn uses ({declared!r})",
                    repr(reduction),
                    f"pass reduction={declared!r}"
                    if declared in ("mean", "sum")
                    else "use a loss with reduction 'mean' or 'sum' (it must return a scalar)",
                )
            )
        self.single = _is_pair(data)
        if self.single:
            self._batches: Any = [tuple(data)]
            self.num_examples = _check_batch(data[0], None, call)
            return
        if not isinstance(data, Iterable) or isinstance(data, (str, bytes, dict, torch.Tensor)):
            raise TypeError(self._data_error(data))
        if iter(data) is data:
            raise TypeError(
                message(
                    call,
                    "data",
                    "a pair (inputs, targets) or a re-iterable of pairs (list, DataLoader)",
                    f"a one-shot iterator ({type(data).__name__})",
                    "pass list(data): products iterate over the batches again",
                )
            )
        self._batches = data
        self.num_examples = sum(n for _, _, n in self)
        if self.num_examples == 0:
            raise ValueError(
                message(
                    call,
                    "data",
                    "at least one batch",
                    f"an empty {type(data).__name__}",
                    "pass non-empty data",
                )
            )

    def _data_error(self, got: Any) -> str:
        return message(
            self.call,
            "data",
            "a pair (inputs, targets) with a tensor of targets, or an iterable of such pairs",
            describe(got),
            "pass data=(x, y) or data=[(x1, y1), (x2, y2), ...]",
        )

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor, int]]:
        for index, batch in enumerate(self._batches):
            if not _is_pair(batch):
                raise TypeError(self._data_error(batch))
            where = None if self.single else index
            yield batch[0], batch[1], _check_batch(batch[0], where, self.call)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors of a single batch by label (for change detection), else none."""
        return self._first_tensors() if self.single else []

    def _first_tensors(self) -> list[tuple[str, torch.Tensor]]:
        inputs, targets = next(iter(self._batches))
        prefix = "data" if self.single else "data[0]"
        parts = inputs if isinstance(inputs, tuple) else (inputs,)
        named = [
            (f"{prefix} inputs[{i}]", t) for i, t in enumerate(parts) if isinstance(t, torch.Tensor)
        ]
        return [*named, (f"{prefix} targets", targets)]

    def first(self, build: Callable[[], T], dtype: torch.dtype) -> T:
        """Run ``build`` (the first batch's forward and backward), wording the errors of data
        on another device or of another floating dtype than the parameters, and of targets
        with another number of rows than the inputs (flattened targets are fine as long as the
        loss takes them)."""
        try:
            return build()
        except ValueError as err:
            _, targets, n = next(iter(self))
            if targets.dim() > 0 and targets.shape[0] != n:
                raise ValueError(
                    message(
                        self.call,
                        "data" if self.single else "data[0]",
                        f"targets with {n} rows along dimension 0 (one per example of the "
                        "inputs), as the loss requires",
                        f"{describe(targets)}, and loss_fn raised {type(err).__name__}: {err}",
                        "pair each batch of inputs with its own targets",
                    )
                ) from err
            raise
        except RuntimeError as err:
            device = next(self.model.parameters()).device
            text = str(err)
            for label, t in self._first_tensors():
                if t.device != device and "device" in text:
                    raise ValueError(
                        message(
                            self.call,
                            label,
                            f"a tensor on the parameters' device ({device})",
                            f"a tensor on {t.device}",
                            f"move the data with .to({str(device)!r})",
                        )
                    ) from err
                if t.is_floating_point() and t.dtype != dtype and "dtype" in text.lower():
                    raise TypeError(
                        message(
                            self.call,
                            label,
                            f"a tensor of the parameters' dtype ({dtype})",
                            describe(t),
                            f"convert the data with .to({dtype})",
                        )
                    ) from err
            raise

    def weight(self, n: int) -> float:
        """The weight of a batch of ``n`` examples in the total (1 for a single batch)."""
        if self.single or self.reduction == "sum":
            return 1.0
        return n / self.num_examples

    def forward(self, inputs: Any) -> Any:
        """``model(inputs)``; modules in training mode that own buffers use copies of them."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        model = self.model
        if not any(m.training for m in self._buffered):
            return model(*args)
        copies = {n: b.clone() for n, b in model.named_buffers()}
        return torch.func.functional_call(model, copies, args, strict=False)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise ValueError(
                message(
                    self.call,
                    "loss_fn",
                    "a loss returning a floating-point scalar tensor",
                    describe(loss),
                    "reduce the per-example losses with reduction='mean' or 'sum'",
                )
            )
        return loss if loss.dim() == 0 else loss.reshape(())

    def warn_unused(self, names: list[str]) -> None:
        if names:
            warnings.warn(
                f"{self.call}: parameters {names} do not affect the loss of the first batch; "
                "their rows and columns are zero (leave them out with params=[...] or freeze "
                "them)",
                UserWarning,
                stacklevel=4,
            )

"""What a curvature operator is built from: the model's selected parameters, the loss and the data.

Conventions (shared by every operator):

* ``data`` is one pair ``(inputs, targets)`` (``targets`` a tensor) or a re-iterable of such
  pairs (a list, a ``DataLoader``); ``model(*inputs)`` is called when ``inputs`` is a tuple;
* examples are indexed by dimension 0 of the inputs, the outputs and the targets;
* ``reduction`` says how ``loss_fn`` combines the examples of one batch: ``"mean"`` or ``"sum"``;
  batch ``b`` weighs ``Z_b / Z`` (mean) or 1 (sum), ``Z_b`` what its mean divides by, so that
  several batches equal one big batch: the sum of the class weights of the targets not
  ignored for ``nn.CrossEntropyLoss``/``nn.NLLLoss`` and their functions
  (:mod:`~gradkit.curvature._mean`), the batch's ``n_b`` examples for any other loss;
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

from gradkit._autograd import graph_nodes, second_order_suspect
from gradkit._errors import describe, message
from gradkit._layouts import sequence_first_layer
from gradkit._params import LossFn
from gradkit._params import select_params as choose
from gradkit._validate import check_choice
from gradkit.curvature import _mean

__all__ = [
    "Data",
    "LossFn",
    "check_generator",
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


def _sequential(data: Any) -> bool:
    """Whether ``data`` is a DataLoader that yields its batches in the same order on every
    pass (a sequential sampler over a map-style dataset)."""
    from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

    return (
        isinstance(data, DataLoader)
        and not isinstance(data.dataset, IterableDataset)
        and isinstance(data.sampler, SequentialSampler)
    )


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
    a node that may refuse a second backward (a custom ``autograd.Function``, a fused attention
    kernel: see :func:`~gradkit._autograd.find_error_nodes`): one walk of the forward graph."""
    reached: set[int] = set()
    suspect = False
    for node in graph_nodes([out.grad_fn]):
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        suspect = suspect or second_order_suspect(node)
    return reached, suspect


def _labelled(inputs: Any, targets: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """A batch's tensors, each with its label in errors (``data[1] inputs[0]``)."""
    parts = inputs if isinstance(inputs, tuple) else (inputs,)
    named = [
        (f"{where} inputs[{i}]", t) for i, t in enumerate(parts) if isinstance(t, torch.Tensor)
    ]
    return [*named, (f"{where} targets", targets)]


class Data:
    """The model, the loss and the batches of one operator.

    Attributes:
        single: whether ``data`` was one pair (products then reuse one kept graph).
        num_examples: ``N``, the examples over all batches.
        targets: how ``loss_fn`` reads its targets where it is a torch classification loss
            (then its mean divides by what the targets say), else None.
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
        self.targets: _mean.TargetLoss | None = _mean.target_loss(loss_fn)
        self._shares: list[float] | None = None  # Z_b / Z, once weigh() has checked them
        self._fixed_order = True  # batch i holds the same examples on every pass
        self.single = _is_pair(data)
        if (
            not self.single
            and isinstance(data, tuple)
            and len(data) == 2
            and isinstance(data[1], torch.Tensor)
            and isinstance(data[0], (dict, list))
        ):  # a pair whose inputs are not a tensor or a tuple (it cannot be a list of batches)
            raise TypeError(
                message(
                    call,
                    "data[0]",
                    "the inputs of a pair (inputs, targets): a tensor, or a tuple of them "
                    "(the model is called as model(*inputs))",
                    f"a {type(data[0]).__name__}",
                    "pass a tuple of tensors, in the order of the model's forward arguments "
                    "(for a model that takes a dict, wrap it in a module whose forward takes "
                    "the tensors and builds the dict)",
                )
            )
        if self.single:
            self._batches: Any = [tuple(data)]
            self.num_examples, self._divisors = self._count()
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
        # a DataLoader that shuffles (or any data but a list or tuple of batches) may put other
        # examples at a position on the next pass: Z_b is read from each batch as it comes
        self._fixed_order = isinstance(data, (list, tuple)) or _sequential(data)
        self.num_examples, self._divisors = self._count()
        self.warn_sequence_first(
            "batches are weighed by the examples of each",
            "Pass batch-first batches (transposed outside the model), or one batch.",
            stacklevel=3,
        )
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

    def _mean_targets(self) -> _mean.TargetLoss | None:
        """``targets`` where the mean of ``loss_fn`` divides by what its targets say."""
        spec = self.targets
        mean = self.reduction == "mean" and spec is not None and spec.reduction == "mean"
        return spec if mean else None

    def _count(self) -> tuple[int, list[float] | None]:
        """``N`` and every batch's divisor ``Z_b`` (one host sync per batch, at construction;
        None where the mean is over the examples), in one pass over the data."""
        spec = self._mean_targets()
        total, divisors = 0, []
        device = next(self.model.parameters()).device
        for index, (inputs, targets, n) in enumerate(self):
            total += n
            if spec is not None:  # the divisor is read here, before any forward: check first
                where = "data" if self.single else f"data[{index}]"
                for label, t in _labelled(inputs, targets, where):
                    if t.device != device:
                        raise self._device_error(label, t, device)
                divisors.append(float(_mean.divisor(spec, targets)))
        return total, None if spec is None else divisors

    def weigh(self, *, by_examples: bool = False) -> None:
        """Fix the batches' weights: ``Z_b / Z``, or ``n_b / N`` with ``by_examples`` (for an
        operator whose per-batch matrix is a mean over the examples whatever the targets, the
        Monte Carlo Fisher of a sampling ``likelihood``). Refuses data in which nothing counts
        (the mean loss is 0/0)."""
        if self._divisors is None or by_examples:
            return
        total = sum(self._divisors)
        if total == 0:
            spec = self.targets
            assert spec is not None
            weights = "" if spec.weight is None else " or of class weight 0"
            raise ValueError(
                message(
                    self.call,
                    "data",
                    "at least one target that loss_fn's mean counts (one not equal to "
                    f"ignore_index={spec.ignore_index}{weights})",
                    f"targets that are all ignored{weights} (the mean loss is 0/0, nan)",
                    "pass data with a target that is not ignored"
                    if self.single
                    else "drop the batches whose targets are all ignored",
                )
            )
        self._shares = [z / total for z in self._divisors]

    def divisor(self, targets: torch.Tensor) -> torch.Tensor | None:
        """``Z_b`` of a batch with ``targets`` as a 0-dim float64 tensor (no host sync), for a
        mean torch classification loss; None for any other loss (its mean is over the
        ``n_b`` examples)."""
        spec = self._mean_targets()
        return None if spec is None else _mean.divisor(spec, targets)

    def ignored(self, targets: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The targets ``loss_fn`` ignores (a bool mask shaped like ``targets``) and the value
        that marks them, for a torch classification loss with class-index targets; else
        None."""
        spec = self.targets
        mask = None if spec is None else _mean.ignored(spec, targets)
        return None if mask is None or spec is None else (mask, spec.ignore_index)

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
        return _labelled(inputs, targets, "data" if self.single else "data[0]")

    def _device_error(self, label: str, t: torch.Tensor, device: torch.device) -> ValueError:
        return ValueError(
            message(
                self.call,
                label,
                f"a tensor on the parameters' device ({device})",
                f"a tensor on {t.device}",
                f"move the data with .to({str(device)!r})",
            )
        )

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
                    raise self._device_error(label, t, device) from err
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

    def weight(self, index: int, n: int, targets: torch.Tensor) -> float:
        """The weight of batch ``index`` of ``n`` examples with ``targets`` in the total:
        ``Z_b / Z`` (1 for a single batch or a sum). A batch of weight 0 (all its targets
        ignored) adds nothing to one big batch: skip it (its own mean loss is nan). Read from
        ``targets`` (a host sync) where the batches' order may change between passes (a
        shuffling DataLoader gave a batch another's weight: a Hessian 0.36-1.05 off)."""
        if self.single or self.reduction == "sum":
            return 1.0
        if self._shares is not None:
            if self._fixed_order:
                return self._shares[index]
            spec = self._mean_targets()
            assert spec is not None and self._divisors is not None
            return float(_mean.divisor(spec, targets)) / sum(self._divisors)
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

    def warn_sequence_first(self, what: str, fix: str, stacklevel: int) -> None:
        """Warn where the model has a layer that takes its examples along dimension 1 by
        default (a sequence-first RNN or attention): ``what`` reads them along dimension 0.
        ``stacklevel``: the caller's frames up to the user's call, counted from this one."""
        name = sequence_first_layer(self.model)
        if name is not None:
            warnings.warn(
                f"{self.call}: {name} takes its examples along dimension 1 (batch_first=False), "
                f"and {what} along dimension 0: a sequence-first batch ([T, N, ...]) would be "
                f"read as T examples of N steps. {fix}",
                stacklevel=stacklevel + 1,
            )

    def warn_unused(self, names: list[str]) -> None:
        if names:
            warnings.warn(
                f"{self.call}: parameters {names} do not affect the loss of the first batch; "
                "their rows and columns are zero (leave them out with params=[...] or freeze "
                "them)",
                UserWarning,
                stacklevel=4,
            )

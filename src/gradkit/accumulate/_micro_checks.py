"""Checks of the arguments of :class:`~gradkit.accumulate.Accumulator` and its methods: the
constructor's arguments, a micro-step's count and loss, DDP's forward, BatchNorm. Every
message names the call, the argument, what was expected and received, and what to do.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradkit._autograd import graph_nodes
from gradkit._errors import GradkitError, describe, message
from gradkit.per_example._batch import _op, _saved_dims
from gradkit.per_example._layout import loss_reductions, root_factor
from gradkit.per_example._loss_graph import _NLL, match_loss

__all__ = [
    "as_count",
    "batchnorm_in_training",
    "check_ddp_forward",
    "check_deferred_counts",
    "check_loss",
    "check_max_grad_norm",
    "check_optimizer_covers",
    "check_scaler",
    "check_scheduler",
    "find_ddp",
    "is_bad",
    "prepare_fsdp2",
    "read_counts",
    "resolve_count",
]


def as_count(value: Any, call: str) -> float | torch.Tensor:
    """A micro-step's ``count``: an int or a float as a float; a one-element real tensor (e.g.
    ``(labels != -100).sum()``) as a detached 0-d tensor, *not read*: reading it would wait
    for the device, so the window reads all its tensor counts at once in ``step()``. NaN, inf
    and negative values are returned as they are: the caller treats them like a non-finite
    gradient."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.is_meta:
            raise TypeError(
                message(
                    call,
                    "count",
                    "a number, or a one-element real tensor holding it",
                    describe(value) + (" on the meta device" if value.is_meta else ""),
                    "pass e.g. count=int((labels != -100).sum())",
                )
            )
        return value.detach().reshape(()).clone()  # later in-place changes are not the count
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            message(
                call,
                "count",
                "a number (the items whose summed loss this micro-step backpropagates)",
                repr(value),
                "pass e.g. count=len(micro_batch) or the number of non-padding tokens",
            )
        )
    return float(value)


def is_bad(count: float) -> bool:
    """A count that cannot normalize a window: NaN, inf or negative."""
    return math.isnan(count) or math.isinf(count) or count < 0


def resolve_count(
    count: Any, pending: int | None, normalize: str, skip_nonfinite: bool, call: str
) -> float | torch.Tensor:
    """The count of a micro-step: ``count`` itself, else the examples of the micro-batch
    ``split`` just yielded (``pending``). A bad number (:func:`is_bad`) raises unless the
    window is to be skipped for it (``skip_nonfinite``); a tensor is returned unread (see
    :func:`as_count`) and checked by :func:`check_deferred_counts`."""
    if count is None:
        if normalize == "tokens":
            raise ValueError(
                message(
                    call,
                    "count",
                    "the number of tokens of this micro-batch (normalize='tokens')",
                    "None",
                    "pass count=number of non-padding tokens",
                )
            )
        if normalize == "examples" and pending is None:
            raise ValueError(
                message(
                    call,
                    "count",
                    "the number of examples of this micro-batch",
                    "None",
                    "pass count=len(micro_batch) or iterate over acc.split(batch, ...)",
                )
            )
        return float(pending or 0)
    value = as_count(count, call)
    if isinstance(value, torch.Tensor):
        return value
    if is_bad(value) and not skip_nonfinite:
        raise ValueError(
            message(
                call,
                "count",
                "a finite number >= 0",
                repr(value),
                "pass the number (or total weight) of the items the summed loss covers; "
                "nothing was changed (with skip_nonfinite=True the window is skipped instead)",
            )
        )
    return value


def read_counts(counts: list[torch.Tensor]) -> list[float]:
    """The values of the tensor counts of a window, read with one device synchronization."""
    if not counts:
        return []
    device = counts[0].device
    stacked = torch.stack([c.to(device=device, dtype=torch.float64) for c in counts])
    return [float(v) for v in stacked.tolist()]


def check_deferred_counts(values: list[float], skip_nonfinite: bool, call: str) -> None:
    """Raise for a bad tensor count (read in ``step()``) unless the window is to be skipped."""
    for k, value in enumerate(values):
        if is_bad(value) and not skip_nonfinite:
            raise ValueError(
                message(
                    call,
                    "count",
                    "a finite number >= 0 in every micro-step",
                    f"{value!r} (a tensor count, read at step(), of the window's tensor "
                    f"count number {k})",
                    "pass the number (or total weight) of the items the summed loss covers; "
                    "nothing was changed (with skip_nonfinite=True the window is skipped "
                    "instead)",
                )
            )


def check_max_grad_norm(value: Any, call: str) -> float | None:
    """``None`` or a number > 0 (``inf``: report the norm without clipping)."""
    if value is None:
        return None
    fix = "pass e.g. max_grad_norm=1.0 (or float('inf') to only report the norm)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            message(call, "max_grad_norm", "None or a positive number", repr(value), fix)
        )
    if not float(value) > 0:  # also NaN
        raise ValueError(
            message(call, "max_grad_norm", "None or a positive number", repr(value), fix)
        )
    return float(value)


def check_optimizer_covers(model: nn.Module, optimizer: torch.optim.Optimizer, call: str) -> None:
    """Refuse an optimizer that holds none of the model's trainable parameters: every step
    would leave the model as it was."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    model_name, opt_name = type(model).__name__, type(optimizer).__name__
    if not trainable:
        raise ValueError(
            message(
                call,
                "model",
                "a model with trainable parameters (requires_grad=True)",
                f"{model_name} with none",
                "unfreeze the parameters to train (p.requires_grad_(True)) before building the "
                "optimizer",
            )
        )
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.is_meta for p in held):
        raise ValueError(
            message(
                call,
                "optimizer",
                "parameters that hold data",
                f"{opt_name} over parameters on the meta device (shapes only)",
                "materialize the model first (model.to_empty(device=...) and load the weights), "
                "then build the optimizer",
            )
        )
    if not any(id(p) in trainable for p in held):
        raise ValueError(
            message(
                call,
                "optimizer",
                f"an optimizer over trainable parameters of the model ({model_name})",
                f"{opt_name} over {len(held)} tensor(s), none of them a trainable parameter of "
                f"the {model_name}",
                "build the optimizer from this model's parameters, e.g. "
                f"torch.optim.{opt_name}(model.parameters(), ...); a copied or re-created model "
                "has new parameters and needs a new optimizer",
            )
        )


def check_scaler(scaler: Any, call: str) -> None:
    """``None`` or a ``torch.amp.GradScaler``-like object."""
    needed = ("scale", "unscale_", "step", "update", "get_scale")
    if scaler is not None and not all(callable(getattr(scaler, n, None)) for n in needed):
        raise TypeError(
            message(
                call,
                "scaler",
                "None or a torch.amp.GradScaler (with " + ", ".join(needed) + ")",
                describe(scaler),
                "pass e.g. scaler=torch.amp.GradScaler('cuda')",
            )
        )


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, call: str) -> None:
    """``None`` or a learning-rate scheduler (``.step()``) of this very optimizer."""
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            message(
                call,
                "scheduler",
                "None or a learning-rate scheduler with a step() method",
                describe(scheduler),
                "pass e.g. scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 10)",
            )
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            message(
                call,
                "scheduler",
                "a scheduler whose step() takes no argument (step() calls it after each "
                "optimizer step)",
                "a ReduceLROnPlateau, whose step(metrics) needs a metric",
                "leave scheduler= out and call scheduler.step(metric) yourself after acc.step()",
            )
        )
    owner = getattr(scheduler, "optimizer", None)
    if isinstance(owner, torch.optim.Optimizer) and owner is not optimizer:
        raise ValueError(
            message(
                call,
                "scheduler",
                "a scheduler of the optimizer passed to the Accumulator",
                f"a {type(scheduler).__name__} of another {type(owner).__name__}",
                "build the scheduler from the same optimizer object",
            )
        )


def batchnorm_in_training(model: nn.Module) -> str | None:
    """The class name of a BatchNorm layer of ``model`` in training mode, if any."""
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.training:
            return type(m).__name__
    return None


def batch_statistics_node(loss: torch.Tensor) -> str | None:
    """The name of a batch normalization in ``loss``'s graph that used the batch's statistics
    (``F.batch_norm(..., training=True)`` called directly, outside a BatchNorm module), if any;
    one of a single row (``F.instance_norm`` normalizes ``[1, N * C, ...]`` by example) is not
    one."""
    for node in graph_nodes([loss.grad_fn]):
        if "BatchNorm" in type(node).__name__ and getattr(node, "_saved_training", False) is True:
            saved = getattr(node, "_saved_input", None)
            if isinstance(saved, torch.Tensor) and saved.dim() > 0 and saved.shape[0] > 1:
                return str(node.name())
    return None


def check_loss(loss: Any, call: str) -> None:
    """A micro-step's loss: a real floating-point scalar that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            message(
                call,
                "loss",
                "a scalar tensor (the sum of the micro-batch's losses)",
                describe(loss),
                "reduce with .sum()",
            )
        )
    if not loss.is_floating_point():
        raise TypeError(
            message(call, "loss", "a real floating-point scalar", describe(loss), "pass the loss")
        )
    if not loss.requires_grad:
        raise ValueError(
            message(
                call,
                "loss",
                "a loss computed from the model's parameters (requires_grad=True)",
                "a tensor that does not require grad",
                "compute it inside the block, outside torch.no_grad() and without .detach()",
            )
        )


def check_summed(loss: torch.Tensor, call: str, normalize: str = "examples") -> None:
    """Refuse a loss whose graph records a mean over more than one row: a torch loss with its
    default ``reduction="mean"`` (Hugging Face's ``.loss`` among them), a ``reduction="none"``
    loss's ``.mean()``, also with a regularizer added; a loss that is a plain ``.mean()`` or
    ``.mean(0)`` over more than one row (:func:`_plain_mean`). Each micro-batch's items would
    weigh ``1/n_j`` instead of ``1/N``. A mean the graph does not record (a sum divided by
    hand, a custom loss's mean below other operations, a mean times the micro-batch's count)
    is not seen. A mean times ``1/k`` for
    a whole ``k >= 2`` (``mean / k``, the recipe of a plain loop, which ``step()``'s division
    shrinks again) is warned about: it is also a weighted sum (a task weight times a small
    count), so it is not refused. With ``normalize="sum"`` (no division) it is the recipe."""
    factor, node = root_factor(loss)
    below = match_loss(node) if node is not loss.grad_fn else None
    if (
        normalize != "sum"
        and below is not None
        and below.reduction == "mean"
        and below.rows != 1
        and 0 < factor < 1
        and abs(1 / factor - round(1 / factor)) < 1e-9 * (1 / factor)
    ):
        warnings.warn(
            f"{call}: the loss is {below.label}, a mean, times {factor:.6g}: if that is a plain "
            f"loop's mean / {round(1 / factor)}, step()'s division by the window's count "
            "shrinks it again (the gradient about N times too small); backpropagate the summed "
            "loss (reduction='sum'), or the mean times the micro-batch's count",
            stacklevel=3,
        )
    for found in loss_reductions([loss]):
        if found.reduction != "mean" or found.rows == 1:
            continue
        over = f"{found.rows} rows" if found.rows is not None else "its rows"
        nll = type(found.node).__name__ in _NLL
        raise GradkitError(
            message(
                call,
                "loss",
                "a sum over the micro-batch's items (step() divides by the window's count, once)",
                f"a loss that ends in {found.label}, a mean over {over}",
                "build it with reduction='sum' (e.g. F.cross_entropy(logits, y, "
                "reduction='sum')) or multiply the mean by the micro-batch's count; a Hugging "
                "Face model's .loss is a mean over its tokens: sum the token losses from its "
                "logits and pass the token count as micro_step(count=...)"
                + (
                    "; a cross entropy with ignore_index targets or class weights divides by "
                    "the count of the targets kept (or the sum of their weights, w[y].sum()): "
                    "pass that as micro_step(count=...) with Accumulator(..., "
                    "normalize='tokens'), not the number of examples"
                    if nll
                    else ""
                ),
            )
        )

    # a mean times a constant may be a sum (times the micro-batch's count): not refused
    plain = _plain_mean(node) if factor == 1.0 else None
    if plain is not None:
        raise GradkitError(
            message(
                call,
                "loss",
                "a sum over the micro-batch's items (step() divides by the window's count, once)",
                f"a loss that ends in {plain}: each micro-batch's items would weigh 1/n_j "
                "instead of 1/N",
                "take the sum instead of the mean (or build the torch loss with "
                "reduction='sum'), or multiply the mean by the micro-batch's count",
            )
        )


_REDUCING = ("Sum", "Mean", "Nansum", "Amax", "Amin", "Max", "Min", "Logsumexp", "Norm")


def _over_rows(node: Any) -> bool:
    """Whether the reduction ``node`` reduces dimension 0 of its input (all of them where it
    saved no dimension)."""
    rank = len(getattr(node, "_saved_self_sym_sizes", ()) or ())
    dims = _saved_dims(node, rank)
    return dims is None or 0 in dims


def _plain_mean(node: Any) -> str | None:
    """What the loss's top node (below multiplications by constants: :func:`root_factor`) is
    where it is a mean over the rows of a tensor of more than one row: ``t.mean()``, and a
    ``t.mean(0)`` (also under a full ``.sum()``), ``t`` not itself a reduction over its rows
    (whose rows may then be features: ``t.sum(0).mean()`` is a sum over the items). The torch
    losses whose mean torch writes out so (``margin_ranking_loss``, ``hinge_embedding_loss``,
    ``triplet_margin_loss``) and a hand-written ``((o - t)**2).mean()`` end so; None
    otherwise."""
    if node is None:
        return None
    if _op(node) == "Sum" and getattr(node, "_saved_dim", None) is None:  # .mean(0).sum()
        kids = [n for n, _ in node.next_functions if n is not None]
        if len(kids) == 1 and _op(kids[0]) == "Mean":
            node = kids[0]
    if _op(node) != "Mean":
        return None
    sizes = tuple(getattr(node, "_saved_self_sym_sizes", ()) or ())
    if not sizes or int(sizes[0]) <= 1 or not _over_rows(node):
        return None
    below = [n for n, _ in node.next_functions if n is not None]
    if not below or (_op(below[0]) in _REDUCING and _over_rows(below[0])):
        return None  # no input, or the rows reduced already (t.sum(0).mean())
    dims = _saved_dims(node, len(sizes))
    what = "mean()" if dims is None else f"mean(dim={dims})"
    return (
        f"{type(node).__name__}, a mean over {int(sizes[0])} rows ({what} of "
        f"{type(below[0]).__name__})"
    )


def find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` of ``model``: itself, or the one ``torch.compile``
    wrapped (``_orig_mod``)."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, nn.parallel.DistributedDataParallel) else None


def check_ddp_forward(model: nn.Module, call: str) -> None:
    """Refuse a backward whose forward ran outside DDP's ``no_sync`` (DDP then all-reduces in
    the backward, on top of the explicit all-reduce of ``step``). DDP sets
    ``require_forward_param_sync`` in each forward: False under ``no_sync``."""
    ddp = find_ddp(model)
    if ddp is None:
        return
    model = ddp
    if getattr(model, "_delay_all_reduce_all_params", False) or getattr(
        model, "_use_python_reducer", False
    ):
        return
    if getattr(model, "require_forward_param_sync", False):
        raise GradkitError(
            f"{call}: the last forward of the DistributedDataParallel model ran outside "
            "`with acc.micro_step(...)`, so DDP would all-reduce in this backward (on top of "
            "step()'s one all-reduce); run model(...) inside the block. If you call "
            "model.module directly, pass the unwrapped module to Accumulator instead: it "
            "all-reduces over the process group itself"
        )


def prepare_fsdp2(
    modules: list[nn.Module], optimizer: torch.optim.Optimizer, scaler: Any, call: str
) -> Any:
    """Check an FSDP2 model for :class:`Accumulator` and set each FSDP module's gradient divide
    factor to 1, with plain-sum collectives (FSDP then sums over the ranks; ``step()`` divides
    by the window's count).
    Returns the process group of the parameters' device mesh (None without sharded
    parameters)."""
    if scaler is not None:
        raise GradkitError(
            f"{call}: scaler with an FSDP2 model: GradScaler's inf/NaN check sees only this "
            "rank's gradient shards; train in bfloat16 (FSDP's MixedPrecisionPolicy) without a "
            "scaler, or pass scaler=None"
        )
    for module in modules:
        m = cast(Any, module)
        if not callable(getattr(m, "set_gradient_divide_factor", None)):
            raise GradkitError(
                f"{call}: this torch's FSDP2 module has no set_gradient_divide_factor, so its "
                "reduction's scaling cannot be fixed; upgrade torch (2.6 or later)"
            )
        m.set_gradient_divide_factor(1.0)
        force_sum = getattr(m, "set_force_sum_reduction_for_comms", None)
        if callable(force_sum):  # a plain sum (gloo has no pre-multiplied sum)
            force_sum(True)
    group = None
    for g in optimizer.param_groups:
        for p in g["params"]:
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                continue
            if mesh.ndim != 1:
                raise GradkitError(
                    f"{call}: a parameter sharded over a {mesh.ndim}-D device mesh (HSDP); "
                    "the accumulator supports FSDP2 over a 1-D mesh; shard with "
                    "fully_shard(module, mesh=init_device_mesh(device, (world_size,)))"
                )
            group = mesh.get_group() if group is None else group
    return group

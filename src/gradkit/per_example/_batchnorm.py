r"""``replace_batchnorm``: a copy of a model with GroupNorm in place of every BatchNorm, so that
individual gradients are defined.

For an input ``x`` of shape ``[N, C, *]`` (index legend: ``n`` example, ``c`` channel, ``s`` the
positions ``*``, ``g`` a group of ``C / G`` consecutive channels), BatchNorm in training mode
computes

.. math:: y_{ncs} = \gamma_c \frac{x_{ncs} - \mu_c}{\sqrt{\sigma^2_c + \epsilon}} + \beta_c,
          \qquad \mu_c, \sigma^2_c \text{ over } (n, s),

so ``y_n`` depends on every example of the batch and ``d l_n / d theta`` is not a gradient of
``l_n`` alone. GroupNorm takes the statistics of each example by itself,

.. math:: y_{ncs} = \gamma_c \frac{x_{ncs} - \mu_{ng}}{\sqrt{\sigma^2_{ng} + \epsilon}}
          + \beta_c, \qquad \mu_{ng}, \sigma^2_{ng} \text{ over } (c \in g, s),

and has the same affine parameters ``gamma = weight [C]`` and ``beta = bias [C]``.
"""

from __future__ import annotations

import copy as _copy
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from gradkit._errors import describe, message
from gradkit._validate import check_module

__all__ = ["replace_batchnorm"]

logger = logging.getLogger(__name__)
_CALL = "per_example.replace_batchnorm(model, ...)"


def _check_groups(groups: object) -> None:
    if callable(groups):
        return
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(
            message(
                _CALL,
                "groups",
                "a positive int or a callable num_channels -> num_groups",
                describe(groups),
                "pass e.g. groups=32 or groups=lambda c: c // 16",
            )
        )
    if groups < 1:
        raise ValueError(
            message(_CALL, "groups", "a positive int", repr(groups), "pass e.g. groups=32")
        )


def _num_groups(groups: int | Callable[[int], int], channels: int, name: str) -> int:
    if not callable(groups):
        return math.gcd(groups, channels)
    value = groups(channels)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or channels % value:
        raise ValueError(
            message(
                _CALL,
                "groups",
                f"groups({channels}) to return a positive int dividing num_channels={channels} "
                f"(for {name or 'model'})",
                describe(value),
                "return a divisor of the channel count, or pass an int (gcd(groups, C) is used)",
            )
        )
    return value


def _check_initialized(model: nn.Module) -> None:
    for name, m in model.named_modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if any(is_lazy(t) for t in own):
            raise ValueError(
                message(
                    _CALL,
                    "model",
                    "initialized modules only",
                    f"an uninitialized lazy module at {name or 'model'} ({type(m).__name__})",
                    "run one forward pass on the model first, then convert it",
                )
            )


def _to_group_norm(bn: _BatchNorm, groups: int | Callable[[int], int], name: str) -> nn.GroupNorm:
    channels = int(bn.num_features)
    g = _num_groups(groups, channels, name)
    ref = bn.weight if bn.affine else bn.running_mean
    factory: dict[str, Any] = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    gn = nn.GroupNorm(g, channels, eps=bn.eps, affine=bn.affine, **factory)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def _log(name: str, bn: nn.Module, gn: nn.GroupNorm) -> None:
    logger.debug(
        "replace_batchnorm: %s: %s(%d) -> GroupNorm(%d, %d)",
        name or "model",
        type(bn).__name__,
        gn.num_channels,
        gn.num_groups,
        gn.num_channels,
    )


def replace_batchnorm(
    model: nn.Module,
    *,
    groups: int | Callable[[int], int] = 32,
    copy: bool = True,
) -> nn.Module:
    r"""A copy of ``model`` with ``nn.GroupNorm`` in place of every BatchNorm module.

    Every ``_BatchNorm`` module (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and their
    subclasses) with ``C = num_features`` becomes, under the same name,

    .. math:: \text{GroupNorm}(G, C,\ \epsilon = \text{bn.eps},\ \text{affine} =
              \text{bn.affine}),\qquad G = \gcd(\text{groups}, C)\ \text{or}\
              \text{groups}(C),

    whose output ``y_n`` depends on example ``n`` only (statistics over the ``C / G`` channels
    of a group and the positions of one example, not over the batch), so
    :func:`gradkit.per_example.track` accepts it in training mode. ``G = C`` normalizes each
    channel of each example by itself (like InstanceNorm), ``G = 1`` all channels together
    (like LayerNorm over ``[C, *]``).

    Exactly what changes, per replaced module:

    * ``weight`` and ``bias`` (``[C]``) are copied, with their ``requires_grad``, on the same
      device and in the same dtype; their ``state_dict`` keys (``<name>.weight``,
      ``<name>.bias``) stay the same.
    * ``running_mean``, ``running_var``, ``num_batches_tracked``, ``momentum`` and
      ``track_running_stats`` are dropped: GroupNorm uses the statistics of the current example
      in training and in eval mode alike.
    * The ``training`` flag is kept. Hooks and parametrizations registered on the BatchNorm
      module itself are not carried over.
    * A BatchNorm module registered at several places (shared) becomes one GroupNorm, shared
      the same way.

    Nothing else in the model is touched.

    Args:
        model: the model, an ``nn.Module`` (a BatchNorm module itself is converted too).
        groups: an int: ``G = gcd(groups, C)`` for each module, which always divides ``C``
            (``groups=32`` gives 32 groups for ``C = 64``, 16 for ``C = 48``, 1 for ``C = 3``);
            or a callable ``C -> G``, whose value must divide ``C``.
        copy: convert a deep copy (default) and leave ``model`` as it is. ``copy=False``
            replaces the modules of ``model`` itself, in place, and returns it (for models that
            cannot be deep-copied or are too large to hold twice).

    Returns:
        The converted model (with ``copy=False`` the same object as ``model``, unless ``model``
        is itself a BatchNorm module, for which a new ``nn.GroupNorm`` is returned).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``groups`` is neither an int nor a
            callable.
        ValueError: ``groups`` is not positive, ``groups(C)`` does not divide ``C`` (the message
            names the module), or a lazy module is still uninitialized. Nothing is replaced
            then, also with ``copy=False``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import gradkit
        >>> model = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.ReLU())
        >>> fixed = gradkit.per_example.replace_batchnorm(model)
        >>> type(fixed[1]).__name__, fixed[1].num_groups, fixed[1].num_channels  # gcd(32, 48)
        ('GroupNorm', 16, 48)
        >>> type(model[1]).__name__  # the original is untouched
        'BatchNorm2d'
        >>> with gradkit.per_example.track(fixed, "batch_l2") as stats:
        ...     fixed(torch.randn(4, 3, 8, 8)).square().mean().backward()
        >>> stats.batch_l2().shape
        torch.Size([4])

    References:
        Wu and He 2018, "Group Normalization". Opacus's ``ModuleValidator.fix`` makes the same
        replacement with ``min(32, C)`` groups (an error when that does not divide ``C``) and
        freshly initialized affine parameters.

    Warning:
        This changes the function the model computes; it is not an equivalent rewrite. The
        output differs from BatchNorm's in training mode (other statistics) and in eval mode
        (no running statistics), so a model trained with BatchNorm must be trained (or
        fine-tuned) after conversion. To load a BatchNorm checkpoint into the converted model,
        use ``load_state_dict(sd, strict=False)``: the affine parameters load and the running
        statistics come back as unexpected keys. On ``[N, C]`` inputs (BatchNorm1d after a
        Linear) there are no positions: ``G = C`` then normalizes every entry to 0 and only the
        bias remains, so prefer a small ``G`` there.
    """
    check_module(model, _CALL, "pass the model to convert")
    _check_groups(groups)
    _check_initialized(model)
    if copy:
        try:
            model = _copy.deepcopy(model)
        except Exception as err:
            raise TypeError(
                message(
                    _CALL,
                    "model",
                    "a model that copy.deepcopy can copy (copy=True)",
                    f"{type(err).__name__}: {err}",
                    "pass copy=False to convert the model in place",
                )
            ) from err
    if isinstance(model, _BatchNorm):
        root = _to_group_norm(model, groups, "")
        _log("", model, root)
        logger.info("replace_batchnorm: replaced the model itself (%s)", type(model).__name__)
        return root
    # every replacement is built before any is made: an error leaves the model as it was
    done: dict[int, nn.GroupNorm] = {}
    first: dict[int, tuple[str, nn.Module]] = {}  # where each module was met first
    plan: list[tuple[nn.Module, str, nn.GroupNorm]] = []
    for name, child in model.named_modules(remove_duplicate=False):  # every place of each
        if not isinstance(child, _BatchNorm):
            continue
        parent_name, _, child_name = name.rpartition(".")
        if id(child) not in done:
            done[id(child)] = _to_group_norm(child, groups, name)
            first[id(child)] = (name, child)
        plan.append((model.get_submodule(parent_name), child_name, done[id(child)]))
    for parent, child_name, gn in plan:
        setattr(parent, child_name, gn)
    for key, (name, bn) in first.items():
        _log(name, bn, done[key])
    if done:
        logger.info("replace_batchnorm: replaced %d BatchNorm module(s) by GroupNorm", len(done))
    else:
        logger.info("replace_batchnorm: no BatchNorm module in the model; nothing replaced")
    return model

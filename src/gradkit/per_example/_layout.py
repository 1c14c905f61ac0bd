"""Where the examples are in each tensor of a module call.

The batch dimension of every argument and output comes from the module's documented layout,
never from a size that happens to match the number of examples (an LSTM's state
``[layers * directions, N, H]`` has ``N`` in dimension 1 whatever ``batch_first`` says, and a
layer count of 2 over a micro-batch of 2 examples is no batch dimension):

* ``nn.RNN``/``nn.GRU``/``nn.LSTM``: input and output ``0`` if ``batch_first`` else ``1``; the
  states ``h``/``c`` in ``1``; a ``PackedSequence`` has no batch dimension (its examples are
  found through its ``batch_sizes``);
* ``nn.MultiheadAttention``: query, key, value and the output ``0`` if ``batch_first`` else
  ``1``; ``key_padding_mask`` and the attention weights ``0``; a 2-D ``attn_mask`` is shared by
  all examples;
* ``nn.EmbeddingBag``: the output ``0``; a 2-D input and its ``per_sample_weights`` ``0``; a flat
  input with ``offsets`` (or a nested one) has no batch dimension (the bags are the examples);
* a module inside a ``torch.nn`` transformer block (``TransformerEncoderLayer``,
  ``TransformerDecoderLayer``, their stacks, ``Transformer``): ``0`` if the block is
  ``batch_first`` else ``1`` (its Linear and LayerNorm layers see ``[T, N, E]``);
* every other module: ``batch_dim`` (``track``'s argument) for every tensor with more
  dimensions than that.

"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten

from gradkit._errors import GradkitError

__all__ = ["CallLayout", "call_layout", "inner_batch_dims"]


@dataclass
class CallLayout:
    """The batch dimension of each leaf of one module call, as flat lists aligned with
    ``tree_flatten((args, kwargs))`` and ``tree_flatten(output)``: an ``int``, or ``None`` for
    a leaf shared by every example (or not a tensor)."""

    inputs: list[int | None]
    output: list[int | None]


def _dims(value: Any, dim: int | None) -> list[int | None]:
    """``dim`` for every tensor leaf of ``value`` with more dimensions than ``dim``."""
    if isinstance(value, PackedSequence):  # no batch dimension: see batch_sizes
        return [None] * 4
    if isinstance(value, (tuple, list)) and any(isinstance(v, PackedSequence) for v in value):
        return [d for v in value for d in _dims(v, dim)]
    return [
        dim if dim is not None and isinstance(t, torch.Tensor) and t.dim() > dim else None
        for t in tree_flatten(value)[0]
    ]


def _call(
    args: tuple[Any, ...], kwargs: dict[str, Any], dim_of: Callable[[int | str, Any], Any]
) -> list[int | None]:
    dims = [d for k, a in enumerate(args) for d in dim_of(k, a)]
    return dims + [d for k, v in kwargs.items() for d in dim_of(k, v)]


def _rnn(
    module: nn.RNNBase, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> CallLayout:
    x = args[0] if args else kwargs.get("input")
    batched = isinstance(x, PackedSequence) or (isinstance(x, torch.Tensor) and x.dim() == 3)
    seq = (0 if module.batch_first else 1) if batched else None  # unbatched: one example
    state = 1 if batched else None
    inputs = _call(args, kwargs, lambda k, v: _dims(v, seq if k in (0, "input") else state))
    out, hidden = output
    return CallLayout(inputs, _dims(out, seq) + _dims(hidden, state))


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _attention(
    module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> CallLayout:
    query = args[0] if args else kwargs.get("query")
    batched = isinstance(query, torch.Tensor) and query.dim() == 3
    seq = (0 if module.batch_first else 1) if batched else None

    def dim_of(key: int | str, value: Any) -> list[int | None]:
        name = _MHA_ARGS[key] if isinstance(key, int) and key < len(_MHA_ARGS) else key
        if name in ("query", "key", "value"):
            return _dims(value, seq)
        if name == "key_padding_mask":
            return _dims(value, 0 if batched else None)
        if name == "attn_mask" and isinstance(value, torch.Tensor) and value.dim() == 3:
            raise GradkitError(
                "per_example.track: nn.MultiheadAttention called with a 3-D attn_mask "
                f"{tuple(value.shape)} ([N * num_heads, L, S]); per-example gradients need the "
                "examples separable: pass a 2-D attn_mask shared by all examples and the "
                "per-example padding as key_padding_mask [N, S]"
            )
        return _dims(value, None)  # shared (a 2-D attn_mask) or not a tensor

    out, weights = output
    return CallLayout(
        _call(args, kwargs, dim_of), _dims(out, seq) + _dims(weights, 0 if batched else None)
    )


_BAG_ARGS = ("input", "offsets", "per_sample_weights")


def _bag(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> CallLayout:
    x = args[0] if args else kwargs.get("input")
    rows = 0 if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_nested else None

    def dim_of(key: int | str, value: Any) -> list[int | None]:
        name = _BAG_ARGS[key] if isinstance(key, int) and key < len(_BAG_ARGS) else key
        return _dims(value, rows if name in ("input", "per_sample_weights") else None)

    return CallLayout(_call(args, kwargs, dim_of), _dims(output, 0))


def call_layout(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, batch_dim: int
) -> CallLayout:
    """The batch dimension of every argument and output of ``module(*args, **kwargs)``."""
    if isinstance(module, nn.RNNBase):
        return _rnn(module, args, kwargs, output)
    if isinstance(module, nn.MultiheadAttention):
        return _attention(module, args, kwargs, output)
    if isinstance(module, nn.EmbeddingBag):
        return _bag(args, kwargs, output)
    return CallLayout(_dims((args, kwargs), batch_dim), _dims(output, batch_dim))


def _block_batch_first(module: nn.Module) -> bool | None:
    """``batch_first`` of a torch.nn transformer block, None for any other module."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return bool(module.self_attn.batch_first)
    if isinstance(module, nn.Transformer):
        return bool(module.batch_first)
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(module.layers):
        return _block_batch_first(module.layers[0])
    return None


def inner_batch_dims(modules: dict[str, nn.Module], batch_dim: int) -> dict[str, int]:
    """The batch dimension of the tensors each module (by name, as ``named_modules()``) sees:
    set by the nearest enclosing torch.nn transformer block, else ``batch_dim``."""
    dims: dict[str, int] = {}
    for name, module in modules.items():  # parents come before their children
        first = _block_batch_first(module)
        if first is not None:
            dims[name] = 0 if first else 1
        elif name:
            dims[name] = dims.get(name.rpartition(".")[0], batch_dim)
        else:
            dims[name] = batch_dim
    return dims

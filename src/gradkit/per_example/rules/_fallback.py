"""The generic rule for modules without one: ``vmap`` over examples of a vector-Jacobian
product of the module's forward w.r.t. its own parameters (``torch.func.functional_call``).

Exact for any module that treats examples independently and whose forward is deterministic
(the forward is recomputed per example; dropout inside such a module is refused by ``vmap``).
Each example is re-run as the module saw the batch: every argument, positional or keyword, is
split where its examples are (the module's layout: ``batch_first`` of RNNs and attention, an
RNN's state ``[layers * directions, N, H]``, ``key_padding_mask``; see
:mod:`gradkit.per_example._layout`), given back a batch dimension of size 1 there, and tensors
shared by all examples (a 2-D attention mask, broadcast position tensors) are passed whole.
Outputs that are None or carry no gradient (``need_weights=False``) are not split. Where an
operation has no batching rule (torch's RNN kernels), examples are looped over; a
``PackedSequence`` is unpacked and each example re-run on its own sequence. A module without a
rule is differentiated with its whole subtree (MultiheadAttention uses its ``out_proj``
parameters without calling ``out_proj``).

Each example's re-run is checked against that example's part of the output the module gave the
batch (:func:`_reruns_differ`): where they differ, the module mixes examples or was given a
shared tensor whose size happened to equal ``N`` (split as if it held examples), and the
tracker refuses the statistics when they are read.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradkit._errors import GradkitError, message
from gradkit._precision import autocast_as, without_cudnn_rnn
from gradkit.per_example._batch import Dims
from gradkit.per_example._grads import Materialized, PerExampleGrad
from gradkit.per_example._registry import RuleContext, Use

__all__ = ["vmap_rule"]

logger = logging.getLogger(__name__)

_Grads = tuple[torch.Tensor, ...]


def _batch_first_dims(use: Use) -> Dims:
    """Dims of a use given batch-first (a rule calling the fallback itself): dimension 0 of
    every tensor whose size there is the number of examples."""
    outs = tree_flatten(use.grad_output)[0]
    n = next(g for g in outs if isinstance(g, torch.Tensor)).shape[0]
    leaves = tree_flatten((use.inputs, use.kwargs))[0]
    ins = [
        0 if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else None for t in leaves
    ]
    return Dims(
        ins, [0 if isinstance(g, torch.Tensor) else None for g in outs], [False] * len(outs)
    )


def _reruns_differ(
    dims: Dims, keep: list[int], outs: Sequence[torch.Tensor]
) -> torch.Tensor | None:
    """A 0-dim bool tensor, True where an example's re-run (``outs[j]``: ``[N, ...]`` per kept
    output leaf, the module's output for example ``n`` alone) is not that example's row of the
    output the module gave the batch, beyond rounding (``sqrt(eps)`` of the output's largest
    magnitude). Then the module mixes examples, or a tensor it was given with ``N`` rows where
    the examples would be is shared by all of them (a mask of size ``N``): its per-example
    gradients are not those of the batch's forward. None where nothing can be checked (a leaf
    modified in place since the forward). No host sync: the tracker reads it with the
    statistics."""
    assert dims.values is not None and dims.versions is not None
    parts = []
    for k, got in zip(keep, outs, strict=True):
        seen = dims.values[k]
        d = dims.outputs[k]
        if seen is None or d is None or seen._version != dims.versions[k]:
            continue
        if not dims.added[k]:
            got = got.squeeze(d + 1)  # [N, ..., 1 at d, ...] -> [N, ...]
        want = seen.movedim(d, 0)
        if got.shape != want.shape or not want.is_floating_point():
            continue
        # sqrt(eps); float32 on CUDA: 2^-6, the batch's forward may have run in TF32 (cuDNN's
        # convolutions and RNNs by default: 2^-10 per product) and the re-run not
        cuda32 = want.is_cuda and want.dtype == torch.float32
        tol = 2.0**-6 if cuda32 else torch.finfo(want.dtype).eps ** 0.5
        scale = want.abs().amax() if want.numel() else want.new_zeros(())  # detached already
        # (and the smallest normal number: a difference among subnormals, 1e-45 apart in
        # activations decayed to 1e-43, is no disagreement)
        floor = torch.finfo(want.dtype).tiny
        excess = (got - want).abs() - tol * (scale + want.abs()) - floor
        parts.append(excess.nan_to_num(nan=0.0).amax() > 0)
    return torch.stack(parts).any() if parts else None


def _per_example_vjp(
    module: nn.Module,
    names: list[str],
    params: tuple[torch.Tensor, ...],
    use: Use,
    reruns: list[torch.Tensor] | None = None,
    scratch: dict[str, torch.Tensor] | None = None,
) -> _Grads:
    """``[N, *p.shape]`` per parameter: the vjp of each example's forward with its gradient.
    With ``reruns`` and the batch's output in ``use.dims``, whether the re-runs reproduce it is
    appended there (see :func:`_reruns_differ`). ``scratch``: buffers the re-runs use instead
    of the module's own (see :func:`_scratch_buffers`)."""
    scratch = scratch or {}
    dims = use.dims or _batch_first_dims(use)
    grads = use.grad_output if use.dims is not None else tree_flatten(use.grad_output)[0]
    leaves, spec = tree_flatten((use.inputs, use.kwargs))
    if any(isinstance(v, PackedSequence) for v in (*use.inputs, *use.kwargs.values())):
        return _packed(module, names, params, use, grads, scratch)
    keep = [k for k, g in enumerate(grads) if g is not None]
    for k in keep:
        if dims.outputs[k] is None:
            raise GradkitError(
                message(
                    _by_fallback(module),
                    f"output {k} of {type(module).__name__}",
                    "outputs with a batch dimension, whose gradient can be split by example",
                    f"shape {tuple(grads[k].shape)}, no batch dimension: a quantity of the "
                    "whole batch (a loss computed inside the model, CLIPModel(return_loss=True))",
                    "compute the loss outside the module from outputs of one example each, or "
                    f"{_freeze_own(module, names)} so that the layers inside it are split by "
                    "their rules (a loss mixing examples then gives each example's share "
                    "through its own activations)",
                )
            )
    out_dims = [dims.outputs[k] for k in keep]
    n = grads[keep[0]].shape[out_dims[0]]
    split = [i for i, d in enumerate(dims.inputs) if d is not None]
    in_dims = [dims.inputs[i] for i in split]

    def one(
        batched: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]
    ) -> tuple[_Grads, _Grads]:
        full = list(leaves)
        for i, d, t in zip(split, in_dims, batched, strict=True):
            full[i] = t.unsqueeze(d)  # type: ignore[arg-type]
        args, kwargs = tree_unflatten(full, spec)

        def forward(*ps: torch.Tensor) -> _Grads:
            out = torch.func.functional_call(
                module, {**scratch, **dict(zip(names, ps, strict=True))}, args, kwargs
            )
            out_leaves = tree_flatten(out)[0]
            return tuple(out_leaves[k] for k in keep)

        outs, vjp_fn = torch.func.vjp(forward, *params)[:2]
        cot = tuple(
            g if dims.added[k] else g.unsqueeze(d)  # type: ignore[arg-type]
            for k, d, g in zip(keep, out_dims, cotangents, strict=True)
        )
        for k, o, c in zip(keep, outs, cot, strict=True):
            if o.shape != c.shape:
                raise _pairs_examples(module, names, k, o.shape, c.shape)
        return tuple(vjp_fn(cot)), tuple(o.detach() for o in outs)

    def checked(grads_outs: tuple[_Grads, _Grads]) -> _Grads:
        found, outs = grads_outs
        if reruns is not None and dims.values is not None:
            differ = _reruns_differ(dims, keep, outs)
            if differ is not None:
                reruns.append(differ)
        return found

    batched = tuple(leaves[i] for i in split)
    cotangents = tuple(grads[k] for k in keep)
    try:
        with warnings.catch_warnings():  # torch's note that an op runs unbatched under vmap
            warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
            both = torch.func.vmap(one, in_dims=(tuple(in_dims), tuple(out_dims)))
            result = both(batched, cotangents)
    except RuntimeError as err:
        if "random" in str(err).lower():
            random = _random_layer(module)
            if random is not None:  # vmap refuses randomness (CUDA's RNN kernels batch too)
                raise _random_refusal(module, random) from err
            raise GradkitError(
                f"per_example.track: the vmap fallback cannot re-run {type(module).__name__}"
                f" example by example: its forward is random ({err}); put it in eval mode "
                "or register a rule with @gradkit.per_example.register_rule"
            ) from err
        # some operations have no batching rule (torch's RNN kernels): one example at a time
        logger.debug(
            "vmap fallback on %s failed (%s); looping over examples", type(module).__name__, err
        )
    else:  # checked outside the try: an error of the check is not a batching failure
        return checked(result)
    random = _random_layer(module)
    if random is not None:  # vmap refuses randomness; the loop would draw other masks
        raise _random_refusal(module, random)
    try:
        rows = [
            one(
                [t.select(d, i) for t, d in zip(batched, in_dims, strict=True)],
                [g.select(d, i) for g, d in zip(cotangents, out_dims, strict=True)],
            )
            for i in range(n)
        ]
    except RuntimeError as err:
        raise GradkitError(
            message(
                _by_fallback(module),
                f"a re-run of {type(module).__name__} on one example",
                "the module's forward on one example's slice of each argument",
                f"torch raised {type(err).__name__}: {err}",
                "where an argument holds its examples in another dimension than the one split "
                f"({_dims_text(dims.inputs)}; an RNN state [layers, N, H], a sequence-first "
                "tensor), pass batch_dim={its name: d}; where the forward updates a tensor in "
                "place (a buffer), or mixes examples, register a rule "
                "(@gradkit.per_example.register_rule) or freeze its parameters",
            )
        ) from err
    found = tuple(torch.stack(parts) for parts in zip(*(r[0] for r in rows), strict=True))
    outs = tuple(torch.stack(parts) for parts in zip(*(r[1] for r in rows), strict=True))
    return checked((found, outs))


def _random_refusal(module: nn.Module, random: str) -> GradkitError:
    """The error for a module the fallback cannot re-run: ``random`` (what
    :func:`_random_layer` found) draws other masks on each re-run."""
    return GradkitError(
        message(
            _by_fallback(module),
            "model",
            "a module whose forward the fallback can re-run on each example alone",
            f"{type(module).__name__} with {random} in training mode: each re-run would "
            "draw other random masks than the batch's",
            "put it in eval mode (or its dropout at 0) while tracking, register a rule "
            "(@gradkit.per_example.register_rule), or freeze its parameters",
        )
    )


def _random_layer(module: nn.Module) -> str | None:
    """What in ``module`` draws random numbers in its forward in training mode (an RNN's
    dropout between layers, a dropout layer), or None."""
    for name, m in module.named_modules():
        if not m.training:
            continue
        where = f" ({name})" if name else ""
        if isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1:
            return f"dropout={m.dropout} between its layers{where}"
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"a {type(m).__name__}(p={m.p}){where}"
    return None


def _by_fallback(module: nn.Module) -> str:
    """The call an error of the fallback names."""
    return (
        f"per_example.track: the vmap fallback on {type(module).__name__} (it re-runs the "
        "module example by example)"
    )


def _freeze_own(module: nn.Module, names: list[str]) -> str:
    """``freeze <Class>'s own parameters (a, b, ...)``: the module's own, not its children's."""
    own = [n for n in names if "." not in n] or names
    listed = ", ".join(own[:3]) + (", ..." if len(own) > 3 else "")
    return f"freeze {type(module).__name__}'s own parameters ({listed})"


def _dims_text(dims: list[int | None]) -> str:
    split = [f"argument {k}: {d}" for k, d in enumerate(dims) if d is not None]
    return "split: " + ", ".join(split) if split else "none split"


def _pairs_examples(
    module: nn.Module, names: list[str], k: int, one: torch.Size, row: torch.Size
) -> GradkitError:
    """The error for an output whose row for one example is not what the module gives that
    example alone (CLIP's ``logits_per_image``, ``[N, N]``: one example's row holds its
    similarity to every other)."""
    return GradkitError(
        message(
            _by_fallback(module),
            f"output {k} of {type(module).__name__}",
            "outputs whose row for an example is that example's own output",
            f"{tuple(row)} per example in the gradient, {tuple(one)} from one example alone: "
            "the output pairs examples with each other (a contrastive model's [N, N] "
            "similarities), or an argument was split along a dimension that does not hold its "
            "examples",
            "compute the loss from outputs of one example each (CLIPModel's image_embeds and "
            f"text_embeds), or {_freeze_own(module, names)} so that the layers inside it are "
            "split by their rules; where an argument holds its examples in another dimension (a "
            "sequence-first tensor), pass batch_dim={its name: d}",
        )
    )


def _packed(
    module: nn.Module,
    names: list[str],
    params: tuple[torch.Tensor, ...],
    use: Use,
    grads: list[torch.Tensor | None],
    scratch: dict[str, torch.Tensor],
) -> _Grads:
    """An RNN on a ``PackedSequence``: each example re-run on its own sequence (and state)."""
    if not isinstance(module, nn.RNNBase):
        raise GradkitError(
            f"per_example.track: {type(module).__name__} was given a PackedSequence; the vmap "
            "fallback splits packed sequences for nn.RNN/GRU/LSTM only: register a rule"
        )
    args = dict(zip(("input", "hx"), use.inputs, strict=False)) | use.kwargs
    x: PackedSequence = args["input"]
    hx = args.get("hx")
    padded, lengths = pad_packed_sequence(x, batch_first=True)  # [N, T, F], original order
    n = padded.shape[0]
    g_seq = None
    if grads[0] is not None:  # the output's gradient, padded per example: [N, T, H]
        g_seq = pad_packed_sequence(
            PackedSequence(grads[0], x.batch_sizes, x.sorted_indices, x.unsorted_indices),
            batch_first=True,
        )[0]
    h_leaves, h_spec = tree_flatten(hx)
    h_grads = grads[4:]
    rows = []
    for i in range(n):
        length = int(lengths[i])
        xi = pack_padded_sequence(padded[i : i + 1, :length], [length], batch_first=True)
        hi = None if hx is None else tree_unflatten([h.narrow(1, i, 1) for h in h_leaves], h_spec)

        # plain autograd: torch's packed RNN kernels refuse torch.func's wrapped tensors
        ps = [p.detach().requires_grad_() for p in params]
        tensors = {**scratch, **dict(zip(names, ps, strict=True))}
        out, h = torch.func.functional_call(module, tensors, (xi, hi))
        outs = (out.data, *tree_flatten(h)[0])
        cot = [torch.zeros_like(outs[0]) if g_seq is None else g_seq[i, :length]]
        for g, o in zip(h_grads, outs[1:], strict=True):
            cot.append(torch.zeros_like(o) if g is None else g.narrow(1, i, 1))
        got = torch.autograd.grad(outs, ps, cot, allow_unused=True)
        rows.append(
            tuple(torch.zeros_like(p) if g is None else g for p, g in zip(ps, got, strict=True))
        )
    return tuple(torch.stack(parts) for parts in zip(*rows, strict=True))


@contextlib.contextmanager
def _without_onednn(module: nn.Module) -> Iterator[None]:
    """oneDNN off while the examples of a module holding an RNN are re-run: its float32 CPU
    RNN kernels give wrong bias gradients (or none: "Expected a proper Tensor ... 'workspace'")
    when differentiated from inside a backward pass; the native kernels are exact. Other
    modules keep it: without it a depthwise convolution's backward runs torch's slow reference
    kernel (a ConvNeXt block's re-runs 1.4x slower). (Not ``torch.backends.mkldnn.flags``: it
    warns about TF32 on every use.)"""
    if not any(isinstance(m, nn.RNNBase) for m in module.modules()):
        yield
        return
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _scratch_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the buffers a module in training mode may update as it runs (running
    statistics: ``InstanceNorm(track_running_stats=True)``, an EMA), which the re-runs update
    instead of the module's own: re-run example by example, the module updated them once more
    per example, and its state after a tracked step was not an untracked step's. Boolean
    buffers (masks) are not copied."""
    return {
        f"{prefix}.{name}" if prefix else name: b.detach().clone()
        for prefix, sub in module.named_modules()
        if sub.training
        for name, b in sub._buffers.items()
        if b is not None and b.dtype != torch.bool
    }


def _changed_buffers(module: nn.Module, versions: dict[str, int]) -> list[str]:
    return [name for name, b in module.named_buffers() if b._version != versions.get(name)]


def vmap_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of any example-independent module, by vmap (see module doc)."""
    names = list(ctx.params)
    params = tuple(ctx.params[k].detach() for k in names)
    totals: list[torch.Tensor] | None = None
    scratch = _scratch_buffers(module)
    versions = {name: b._version for name, b in module.named_buffers()}
    with torch.enable_grad(), _without_onednn(module), without_cudnn_rnn(module):
        for u in uses:
            # in the autocast regions the call ran in (the backward runs outside them)
            with autocast_as(u.dims.autocast if u.dims is not None else ()):
                grads = _per_example_vjp(module, names, params, u, ctx.reruns, scratch)
            totals = (
                list(grads)
                if totals is None
                else [t + g for t, g in zip(totals, grads, strict=True)]
            )
    assert totals is not None
    changed = _changed_buffers(module, versions)
    if changed:  # a buffer not copied (a mask, or in eval mode) was changed by the re-runs
        raise GradkitError(
            message(
                _by_fallback(module),
                f"the buffers of {type(module).__name__}",
                "buffers a re-run leaves as they are",
                f"{', '.join(changed)} changed in place by the re-runs (the model's state now "
                "differs from an untracked step's)",
                "register a rule for the module (@gradkit.per_example.register_rule), or keep "
                "its forward from updating buffers while tracked",
            )
        )
    # not owned: a vjp may return views of the cotangent (autograd's own gradient) or of
    # another parameter's gradient (a class token sliced from the positions' gradient)
    return {k: Materialized(t) for k, t in zip(names, totals, strict=True)}

"""``nn.Conv1d/2d/3d`` with stride, padding (numbers, ``"same"``, ``"valid"``, any padding
mode), dilation, groups and bias: exact.

With patches ``A[n, t, g, i]`` (``t`` output position, ``i`` = input channels of group ``g``
times kernel positions) and the output gradient ``G[n, t, g, o]``, the per-example weight
gradient is ``g_n(W) = sum_t G[n, t]^T A[n, t]`` per group and ``g_n(b) = sum_t G[n, t]``.
It is materialized in chunks either by one grouped weight-gradient convolution (examples as
groups) or by a batched product over unfolded patches, whichever was faster for that layer's
shapes when timed on the first tracked steps in this process; squared norms use the Gram form
``<A_n A_n^T, G_n G_n^T>`` over unfolded patches when that is cheaper. The sum over positions is
taken before any power: TensorFlow's ``gradient_moment.py`` takes ``sum_t (.)^p`` instead and
is 31-47 % off.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.grad
from torch import nn

from gradkit.per_example._grads import Materialized, OuterProduct, PerExampleGrad, cat_positions
from gradkit.per_example._registry import RuleContext, Use, register_rule
from gradkit.per_example._stats import as_dtype, statistics_dtype


def _pads(module: nn.modules.conv._ConvNd, spatial: int) -> list[int]:
    """``F.pad`` amounts (last dimension first) that reproduce the module's padding."""
    k, d = module.kernel_size, module.dilation
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return [0] * (2 * spatial)
        pads: list[int] = []
        for i in reversed(range(spatial)):
            total = d[i] * (k[i] - 1)
            pads += [total // 2, total - total // 2]
        return pads
    return [p for i in reversed(range(spatial)) for p in (module.padding[i],) * 2]


def _pad_mode(module: nn.modules.conv._ConvNd) -> str:
    """``F.pad``'s mode for the module's ``padding_mode``."""
    return "constant" if module.padding_mode == "zeros" else module.padding_mode


def unfold_patches(x: torch.Tensor, module: nn.modules.conv._ConvNd) -> torch.Tensor:
    """``[N, C_in * prod(kernel), L]`` patches of ``x`` as the convolution sees them.

    By strided views (``Tensor.unfold``) and one copy, bitwise the same as ``F.unfold``. On the
    CPU 1.1x to 7x faster than its im2col (``3 -> 64`` channels, 5x5 kernel, 32x32 input, batch
    64: 0.68 ms against 4.97 ms); on CUDA one copy kernel where ``F.unfold``'s im2col launches
    one kernel per example (192 launches per step of DeepOBS 3c3d at batch 64, half of the
    tracked step's kernel time on an H200). On the CPU the copy is a permuting one where the
    output rows are long, and a gather by precomputed indices where they are short (see
    :data:`_GATHER_BELOW`)."""
    spatial = x.dim() - 2
    pads = _pads(module, spatial)
    mode = _pad_mode(module)
    if any(pads):
        x = F.pad(x, pads, mode=mode)
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    n, c = x.shape[:2]
    rows = c * math.prod(kernel)
    sizes = [
        (x.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
        for i in range(spatial)
    ]
    if sizes[-1] < _GATHER_BELOW and x.device.type == "cpu" and n > 0 and x.is_contiguous():
        index = _patch_index(tuple(x.shape[1:]), tuple(kernel), tuple(stride), tuple(dilation))
        return x.reshape(n, -1).index_select(1, index).view(n, rows, math.prod(sizes))
    return _patch_view(x, kernel, stride, dilation).reshape(n, rows, math.prod(sizes))


_GATHER_BELOW = 11
"""Output positions along the last spatial dimension under which :func:`unfold_patches`
gathers the patches by index instead of copying the permuted strided view: that copy runs its
inner loop over them, and short rows make it slow. Timed here (CPU, 1 thread) for the gather
over the copy: 0.20 at 4 positions (batch 32, 8 channels, 6x6, 3x3 kernel), 0.07 at 2 (128
channels, 4x4), 0.41-0.43 at 6-7 (2-D, 3-D, stride 2), 0.70 at 10, about 1 at 12-18, 1.8-3.4
at 28-96."""


def _patch_view(
    x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> torch.Tensor:
    """``[N, C, k1..ks, L1..Ls]``: the patches of a padded ``x`` as a strided view."""
    spatial = x.dim() - 2
    for i in range(spatial):
        k, s, d = kernel[i], stride[i], dilation[i]
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    # [N, C, L1..Ls, k1..ks] -> [N, C, k1..ks, L1..Ls]
    return x.permute([0, 1, *range(2 + spatial, 2 + 2 * spatial), *range(2, 2 + spatial)])


@functools.lru_cache(maxsize=64)
def _patch_index(
    shape: tuple[int, ...],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
) -> torch.Tensor:
    """The positions in one example's flattened padded input ``[C, *spatial]`` (``shape``) of
    its patches' entries, in :func:`unfold_patches`' order (a CPU tensor, cached per shape)."""
    positions = torch.arange(math.prod(shape), device="cpu").view(1, *shape)
    return _patch_view(positions, kernel, stride, dilation).reshape(-1)


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    return t * scale if scale != 1.0 else t


_METHODS = ("grouped", "unfold")
_CHOICE: dict[tuple[Any, ...], str] = {}
"""Per convolution and block shape, the faster way to materialize per-example weight gradients
on this machine (see :func:`_choose`)."""
_TRIALS: dict[tuple[Any, ...], _Trial] = {}
"""The shapes not decided yet, in the order first seen: the first is being timed."""
_FORCE: str | None = None  # tests: one method for every block
_RUNS = 4
"""Blocks each method computes in a row while its shape is timed; the first of each run is not
counted (one-time set-up, and the change from the other method's buffers)."""
_WAITING = "unfold"
"""The method of a shape waiting for its turn to be timed (the faster on most small layers)."""
_PATIENCE = 64
"""Blocks of waiting shapes after which the shape being timed, if it has not run since (its
layer no longer runs), gives its turn to the next and starts over behind them."""


class _Trial:
    """The timings of both methods for one block shape, taken on the tracked steps' own
    blocks (each block is computed once, by one method: nothing runs only to be timed)."""

    __slots__ = ("idle", "key", "runs", "times")

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.times: dict[str, list[float]] = {m: [] for m in _METHODS}
        self.runs = 0
        self.idle = 0  # blocks of waiting shapes since this one last ran

    def method(self) -> str:
        """The method that computes the next block."""
        return _METHODS[self.runs // _RUNS]

    def record(self, method: str, took: float) -> None:
        """Add a block's time; once every method has run :data:`_RUNS` blocks, the faster
        becomes the shape's choice and the next shape's timing starts."""
        self.runs += 1
        self.idle = 0
        self.times[method].append(took)
        if self.runs == _RUNS * len(_METHODS):
            best = {m: min(ts[1:]) for m, ts in self.times.items()}
            _CHOICE[self.key] = min(best, key=best.__getitem__)
            del _TRIALS[self.key]


def _choose(pe: ConvWeightGrad, start: int, stop: int) -> tuple[str, _Trial | None]:
    """``"grouped"`` or ``"unfold"`` for this block, with the :class:`_Trial` to report its
    time to while that shape is being timed.

    Neither method wins everywhere on CPU (measured: the grouped convolution is 1.5x faster on
    3 -> 64 channels at 28x28 positions, 3x slower on 96 -> 128 at 7x7), so each shape is timed
    on the blocks of the first tracked steps, where they run amid the backward pass: a run of
    :data:`_RUNS` blocks by each method, each keeping its best time but its first, and the
    faster is kept for the rest of the process. One shape is timed at a time, the others
    computing their blocks by :data:`_WAITING` (or their choice) meanwhile, so that both runs
    of a shape see the same layers around them. Timed back to back on the first block instead,
    the two methods for the demo CNN's second convolution came within the machine's noise of
    each other, and the one picked in a third of the processes made its tracked step 3 to 5 %
    slower. On other devices (no timing without a synchronize) it is ``"unfold"``: cuDNN's
    grouped weight gradient was measured 2e-3 off on an H200."""
    if _FORCE is not None:
        return _FORCE, None
    x, g = pe.uses[0]
    if x.device.type != "cpu":
        # cuDNN's grouped weight gradient with one group per example came out 2e-3 off the
        # reference on an H200 (DeepOBS 3c3d, TF32 off: its algorithm choice), where unfolded
        # patches and a cuBLAS product agree to float32's rounding
        return "unfold", None
    m = pe.module
    key = (
        stop - start,
        tuple(x.shape[1:]),
        tuple(g.shape[1:]),
        len(pe.uses),
        m.kernel_size,
        m.stride,
        m.dilation,
        m.groups,
        tuple(pe._pads),
        m.padding_mode,
        x.dtype,
        torch.get_num_threads(),
    )
    choice = _CHOICE.get(key)
    if choice is not None:
        return choice, None
    trial = _TRIALS.get(key)
    if trial is None:
        trial = _TRIALS[key] = _Trial(key)
    timed = next(iter(_TRIALS.values()))
    if timed is not trial:
        timed.idle += 1
        if timed.idle <= _PATIENCE:
            return _WAITING, None
        del _TRIALS[timed.key]  # its layer stopped running: the next shape's turn
        _TRIALS[timed.key] = _Trial(timed.key)
        if next(iter(_TRIALS.values())) is not trial:
            return _WAITING, None
    return trial.method(), trial


_WEIGHT_GRAD = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}


class ConvWeightGrad(PerExampleGrad):
    """Per-example convolution weight gradients, materialized in chunks (by a grouped
    weight-gradient convolution or a batched product over patches, see :func:`_choose`), with
    norms in Gram form over unfolded patches when the cost model prefers it.

    Args:
        module: the convolution.
        uses: ``(input, grad_output)`` per use, batch first, in the accumulation dtype.
    """

    def __init__(
        self, module: nn.modules.conv._ConvNd, uses: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.module, self.uses = module, uses
        self.num_examples = uses[0][1].shape[0]
        self.shape = module.weight.shape
        self.positions = sum(g.shape[2:].numel() for _, g in uses)  # output positions, all uses
        spatial = module.weight.dim() - 2
        self._wgrad = _WEIGHT_GRAD[spatial]
        self._pads = _pads(module, spatial)
        self._padded_inputs: list[torch.Tensor] | None = None  # see _padded

    def _block(self, start: int, stop: int, scale: float = 1.0) -> torch.Tensor:
        method, trial = _choose(self, start, stop)
        run = self._grouped if method == "grouped" else self._unfolded
        if trial is None:
            return run(start, stop, scale)
        begin = time.perf_counter()  # on the CPU: the block is computed when run returns
        block = run(start, stop, scale)
        trial.record(method, time.perf_counter() - begin)
        return block

    def _padded(self) -> list[torch.Tensor]:
        """The inputs padded as the convolution pads them, for the grouped method (made on its
        first block: a copy of the inputs the unfolded patches do not need)."""
        if self._padded_inputs is None:
            pads, mode = self._pads, _pad_mode(self.module)
            self._padded_inputs = [
                F.pad(x, pads, mode=mode) if any(pads) else x for x, _ in self.uses
            ]
        return self._padded_inputs

    def _unfolded(self, start: int, stop: int, scale: float = 1.0) -> torch.Tensor:
        """``sum_t G[n, t]^T A[n, t]`` per group by a batched product over unfolded patches
        (``G`` times ``scale``)."""
        m, n = self.module, stop - start
        o = m.out_channels // m.groups
        total: torch.Tensor | None = None
        whole = start == 0 and stop == self.num_examples  # no slicing (an op per tensor)
        for x, g in self.uses:
            a = unfold_patches(x if whole else x[start:stop], m)  # [n, C_in * K, L]
            gs = _scaled(g if whole else g[start:stop], scale)
            if m.groups == 1:  # bmm itself: matmul's 4-D broadcasting costs 6 more ops
                w = torch.bmm(gs.reshape(n, o, -1), a.transpose(1, 2))  # [n, o, i]
            else:
                a = a.reshape(n, m.groups, -1, a.shape[-1])  # [n, groups, i, L]
                w = gs.reshape(n, m.groups, o, -1) @ a.transpose(-1, -2)  # [n, groups, o, i]
            total = w if total is None else total.add_(w)
        assert total is not None
        return total.reshape(n, *self.shape)

    def _grouped(self, start: int, stop: int, scale: float = 1.0) -> torch.Tensor:
        """The same by one weight-gradient convolution with the examples as groups."""
        m, n = self.module, stop - start
        total: torch.Tensor | None = None
        for x, (_, g) in zip(self._padded(), self.uses, strict=True):
            xs, gs = x[start:stop], _scaled(g[start:stop], scale)
            w = self._wgrad(
                xs.reshape(1, -1, *xs.shape[2:]),
                (n * self.shape[0], *self.shape[1:]),
                gs.reshape(1, -1, *gs.shape[2:]),
                stride=m.stride,
                padding=0,
                dilation=m.dilation,
                groups=n * m.groups,
            )
            total = w if total is None else total.add_(w)
        assert total is not None
        return total.reshape(n, *self.shape)

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        for start in range(0, self.num_examples, size):
            yield self._block(start, min(start + size, self.num_examples))

    def scaled_chunks(
        self, size: int, scale: float, out: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """The blocks of ``scale * g_n``, the scale on the output gradients where they are
        smaller than the block (few positions, as in a small network's last convolutions)."""
        on_g = scale != 1.0 and self.positions < self.shape[1:].numel()
        for start in range(0, self.num_examples, size):
            stop = min(start + size, self.num_examples)
            yield self._block(start, stop, scale if on_g else 1.0), on_g

    def _patches(self) -> OuterProduct:
        n, m = self.num_examples, self.module
        a_parts, g_parts = [], []
        for x, g in self.uses:
            p = unfold_patches(x, m)  # [N, C_in*K, L]
            a_parts.append(p.reshape(n, m.groups, -1, p.shape[-1]).permute(0, 3, 1, 2))
            g_parts.append(
                g.reshape(n, m.groups, m.out_channels // m.groups, -1).permute(0, 3, 1, 2)
            )
        return OuterProduct(cat_positions(a_parts), cat_positions(g_parts), self.shape)

    def sq_norms(self) -> torch.Tensor | None:
        m = self.module
        i = self.shape[1:].numel()
        o = m.out_channels // m.groups
        if self.positions * (i + o) >= i * o:  # Gram form not cheaper: materialize
            return None
        return self._patches().sq_norms()


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_rule(module: nn.Module, uses: list[Use], ctx: RuleContext) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.ConvNd`` (see the module docstring)."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    n = uses[0].grad_output.shape[0]
    dtype = statistics_dtype(uses[0].grad_output.dtype)
    pairs = [(as_dtype(u.inputs[0], dtype), as_dtype(u.grad_output, dtype)) for u in uses]
    out: dict[str, PerExampleGrad] = {}
    if "weight" in ctx.params:
        pe = ConvWeightGrad(module, pairs)
        one_position = len(pairs) == 1 and math.prod(pairs[0][1].shape[2:]) == 1
        out["weight"] = pe._patches() if one_position else pe  # closed forms for 1 position
    if "bias" in ctx.params:
        sums = [g.reshape(n, module.out_channels, -1).sum(-1) for _, g in pairs]
        out["bias"] = Materialized(torch.stack(sums).sum(0) if len(sums) > 1 else sums[0])
    return out


conv_rule.weight_sums = "conv"  # type: ignore[attr-defined]  # see _fused

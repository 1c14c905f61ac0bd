"""Standard torch.nn blocks and broadcast inputs, against the one-example-at-a-time loop in
float64 (rtol 1e-10), with a float32 run that must agree to float32 tolerance.

Each case is ``(make_model, make_batch, losses)`` where ``losses(model, batch, rows)`` gives the
per-example losses of the examples ``rows`` (a slice) of the batch: the oracle differentiates
them one example at a time, ``track`` sees them all in one (or two) backward passes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import gradkit
from gradkit import GradkitError
from gradkit.per_example import _fused, track
from gradkit.testing import assert_close

from ._grads_check import same_grads

D = torch.float64
QUANTITIES = ("mean", "second_moment", "variance", "batch_l2", "batch_grad")


@dataclass
class Case:
    id: str
    model: Callable[[], nn.Module]
    batch: Callable[[int], Any]  # n -> batch (any structure); examples selected by losses()
    losses: Callable[[nn.Module, Any, slice], torch.Tensor]  # [rows] per-example losses
    batch_dim: int = 0


def loop_oracle(case: Case, model: nn.Module, batch: Any, n: int) -> dict[str, torch.Tensor]:
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {k: [] for k, _ in named}
    for i in range(n):
        loss = case.losses(model, batch, slice(i, i + 1)).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (k, p), g in zip(named, grads, strict=True):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(r) for k, r in rows.items()}


def tracked(case: Case, model: nn.Module, batch: Any, splits: list[int], reduction: str):
    with track(
        model, *QUANTITIES, moments=(3,), loss_reduction=reduction, batch_dim=case.batch_dim
    ) as stats:
        start = 0
        for size in splits:
            losses = case.losses(model, batch, slice(start, start + size))
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
            start += size
    return stats


def compare(stats, ref: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    got, want = {}, {}
    for name, g in ref.items():
        s = stats[name]
        got[name] = [s.mean, s.variance, s.moment(3), s.batch_l2, s.batch_grad]
        want[name] = [
            g.mean(0),
            g.var(0, unbiased=False),
            (g**3).mean(0),
            g.flatten(1).square().sum(1),
            g,
        ]
    assert_close(got, want, rtol=rtol, atol=atol)


def seq_batch(t: int = 5, d: int = 8) -> Callable[[int], Any]:
    def make(n: int) -> Any:
        g = torch.Generator(torch.get_default_device()).manual_seed(n)
        return torch.randn(n, t, d, generator=g, dtype=D), torch.randn(
            n, t, d, generator=g, dtype=D
        )

    return make


def sq(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out * y + 0.3 * out**3).flatten(1).sum(1)


class Encoder(nn.Module):
    """TransformerEncoderLayer with a key padding mask; batch-first or sequence-first inside."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        if not self.batch_first:
            return self.layer(x.transpose(0, 1), src_key_padding_mask=pad).transpose(0, 1)
        return self.layer(x, src_key_padding_mask=pad)


def padding(n: int, t: int = 5) -> torch.Tensor:
    lengths = torch.arange(n) % (t - 1) + 2
    return torch.arange(t)[None, :] >= lengths[:, None]  # True = padding


class Attention(nn.Module):
    def __init__(self, batch_first: bool, weights: bool) -> None:
        super().__init__()
        self.batch_first, self.weights = batch_first, weights
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q = x if self.batch_first else x.transpose(0, 1)
        out, w = self.attn(q, q, q, key_padding_mask=pad, need_weights=self.weights)
        out = out if self.batch_first else out.transpose(0, 1)
        return out if w is None else out + w.sum(-1, keepdim=True)


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.Module], batch_first: bool, **kw: Any) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = kind(8, 3, batch_first=batch_first, **kw)
        self.head = nn.Linear(3 * (2 if kw.get("bidirectional") else 1), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out)


class PackedLM(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = kind(8, 3, batch_first=True, num_layers=2)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.rnn(packed)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(h[-1])


class SeqFirstMix(nn.Module):
    """A sequence-first module without a rule that mixes along time: [T, N, d]."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(torch.tanh(x * self.w), dim=0)


class Positions(nn.Module):
    """Learned positions looked up with [1, T] ids (Hugging Face) or [T] ids (nanoGPT)."""

    def __init__(self, batched_ids: bool) -> None:
        super().__init__()
        self.batched_ids = batched_ids
        self.tok = nn.Embedding(11, 8)
        self.pos = nn.Embedding(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(idx.shape[1])
        return self.out(self.tok(idx) + self.pos(ids[None] if self.batched_ids else ids))


class PosParam(nn.Module):
    """A parameter used directly in forward (no rule: the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(1, 5, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.pos_embedding)


class Latents(nn.Module):
    """A Linear applied to a learned [1, T, d] tensor (a gradient-carrying broadcast input)."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(1, 5, 8))
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.q(self.latents) * self.k(x))


class PatchEmbed(nn.Module):
    """ViT's embeddings: a projection child and a class token and positions used directly."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.pos = nn.Parameter(torch.randn(1, 6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], 1)
        return tokens + self.pos


def vit() -> nn.Module:
    return nn.Sequential(PatchEmbed(), nn.LayerNorm(8), nn.Linear(8, 8))


class Block(nn.Module):
    """A residual block: conv-GroupNorm-ReLU-conv-GroupNorm plus a strided 1x1 shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(2, cout)
        self.short = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.short(x))


def resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        Block(4, 4, 1),
        Block(4, 8, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def ids_batch(n: int) -> Any:
    g = torch.Generator(torch.get_default_device()).manual_seed(n)
    return torch.randint(0, 11, (n, 5), generator=g), torch.randn(n, 5, 3, generator=g, dtype=D)


def with_mask(n: int) -> Any:
    x, y = seq_batch()(n)
    return x, padding(n), y


CASES = [
    Case(
        f"encoder_layer_batch_first_{bf}",
        lambda bf=bf: Encoder(bf),
        with_mask,
        lambda m, b, r: sq(m(b[0][r], b[1][r]), b[2][r]),
    )
    for bf in (True, False)
]
CASES += [
    Case(
        f"mha_batch_first_{bf}_weights_{w}",
        lambda bf=bf, w=w: Attention(bf, w),
        with_mask,
        lambda m, b, r: sq(m(b[0][r], b[1][r]), b[2][r]),
    )
    for bf in (True, False)
    for w in (True, False)
]
CASES += [
    Case(
        f"{kind.__name__.lower()}_bf{bf}_layers{layers}_bi{bi}",
        lambda kind=kind, bf=bf, layers=layers, bi=bi: Recurrent(
            kind, bf, num_layers=layers, bidirectional=bi
        ),
        seq_batch(),
        lambda m, b, r: sq(m(b[0][r]), b[1][r][..., :2]),
    )
    for kind, bf, layers, bi in [
        (nn.LSTM, True, 2, False),
        (nn.LSTM, False, 1, True),
        (nn.GRU, True, 2, True),
        (nn.GRU, False, 2, False),
        (nn.RNN, True, 1, True),
    ]
]
CASES += [
    Case(
        f"packed_{kind.__name__.lower()}",
        lambda kind=kind: PackedLM(kind),
        lambda n: (*seq_batch()(n), torch.arange(n) % 4 + 2),
        lambda m, b, r: sq(m(b[0][r], b[2][r]), b[1][r][:, 0, :2]),
    )
    for kind in (nn.LSTM, nn.GRU)
]
CASES += [
    Case(
        "sequence_first_custom_module",
        SeqFirstMix,
        lambda n: tuple(t.transpose(0, 1) for t in seq_batch()(n)),
        lambda m, b, r: sq(m(b[0][:, r]).transpose(0, 1), b[1][:, r].transpose(0, 1)),
        batch_dim=1,
    ),
    Case(
        "positions_ids_1xT",
        lambda: Positions(True),
        ids_batch,
        lambda m, b, r: sq(m(b[0][r]), b[1][r]),
    ),
    Case(
        "positions_ids_T_no_batch_dim",
        lambda: Positions(False),
        ids_batch,
        lambda m, b, r: sq(m(b[0][r]), b[1][r]),
    ),
    Case("parameter_in_forward", PosParam, seq_batch(), lambda m, b, r: sq(m(b[0][r]), b[1][r])),
    Case(
        "vit_embeddings_params_in_forward",
        vit,
        lambda n: (seq_batch()(n)[0], torch.randn(n, 6, 8, dtype=D)),
        lambda m, b, r: sq(m(b[0][r]), b[1][r]),
    ),
    Case(
        "resnet_groupnorm",
        resnet,
        lambda n: (torch.randn(n, 3, 8, 8, dtype=D), torch.randn(n, 3, dtype=D)),
        lambda m, b, r: sq(m(b[0][r]), b[1][r]),
    ),
    Case(
        "sequence_linear_inplace_relu",
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)),
        seq_batch(),
        lambda m, b, r: sq(m(b[0][r]), b[1][r]),
    ),
    Case("learned_latents_1xT", Latents, seq_batch(), lambda m, b, r: sq(m(b[0][r]), b[1][r])),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float64_matches_loop(case: Case, reduction: str) -> None:
    torch.manual_seed(0)
    model = case.model().double()
    n, splits = (5, [3, 2]) if reduction == "sum" else (3, [3])
    batch = case.batch(n)
    ref = loop_oracle(case, model, batch, n)
    stats = tracked(case, model, batch, splits, reduction)
    assert stats.num_examples == n
    compare(stats, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_float32_agrees_and_grad_untouched(case: Case) -> None:
    torch.manual_seed(0)
    model64 = case.model().double()
    model = copy.deepcopy(model64).float()
    batch64 = case.batch(4)
    batch = tuple(t.float() if t.is_floating_point() else t for t in batch64)
    ref = loop_oracle(case, model64, batch64, 4)
    case.losses(model, batch, slice(0, 4)).mean().backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    stats = tracked(case, model, batch, [4], "mean")
    assert same_grads({k: p.grad for k, p in model.named_parameters()}, plain) == []
    # cuDNN's float32 RNN sums in another order than the CPU's (3.1e-5 off, seen on an H200)
    cudnn_rnn = torch.get_default_device().type == "cuda" and any(
        isinstance(m, nn.RNNBase) for m in model.modules()
    )
    compare(stats, ref, rtol=1e-4, atol=5e-5 if cudnn_rnn else 1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_batch_size_equal_to_layer_sequence_and_feature_sizes(layers: int) -> None:
    """N = layer count, = sequence length, = feature size: the layout decides, not a size."""
    for n, t, d in [(2, 5, 8), (5, 5, 8), (8, 5, 8), (3, 3, 3)]:
        model = nn.LSTM(d, 3, num_layers=layers, batch_first=True).double()
        g = torch.Generator(torch.get_default_device()).manual_seed(n)
        x = torch.randn(n, t, d, generator=g, dtype=D)
        case = Case("lstm", nn.Identity, torch.zeros, lambda m, b, r: m(b[r])[0].pow(2).sum((1, 2)))
        ref = loop_oracle(case, model, x, n)
        compare(tracked(case, model, x, [n], "mean"), ref, rtol=1e-10, atol=1e-12)


class Flattening(nn.Module):
    """Layers on the positions merged into rows, as OPT's MLP: ``[N, T, d] -> [N * T, d]``
    (``time_major``: ``[T, N, d] -> [T * N, d]``, rows that cannot be split by example)."""

    def __init__(self, time_major: bool = False) -> None:
        super().__init__()
        self.time_major = time_major
        self.inp = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h.transpose(0, 1) if self.time_major else h
        rows = self.fc2(torch.relu(self.fc1(self.norm(h.reshape(-1, 8)))))
        out = rows.view(h.shape[0], h.shape[1], 2)
        return out.transpose(0, 1) if self.time_major else out


def test_layers_on_merged_rows_are_split_by_example() -> None:
    model = Flattening().double()
    x, y = torch.randn(3, 5, 8, dtype=D), torch.randn(3, 5, 2, dtype=D)
    case = Case("merged", Flattening, lambda n: (x, y), lambda m, b, r: sq(m(b[0][r]), b[1][r]))
    ref = loop_oracle(case, model, (x, y), 3)
    compare(tracked(case, model, (x, y), [2, 1], "sum"), ref, rtol=1e-10, atol=1e-12)


class GatedRows(nn.Module):
    """A gated MLP on the positions merged into rows (Qwen2-MoE's shared expert): the last
    layer's input is a product of two layers' outputs on those rows."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x).reshape(-1, 8)
        h = torch.nn.functional.silu(self.gate(z)) * self.up(z) + self.up(z)
        return self.down(h).view(x.shape[0], x.shape[1], 2)


def test_a_product_of_merged_rows_is_split_by_example() -> None:
    """The product was not followed (a two-input node): the model was refused, pointing to
    batch_dim, which could not help."""
    model = GatedRows().double()
    x, y = torch.randn(3, 5, 8, dtype=D), torch.randn(3, 5, 2, dtype=D)
    case = Case("gated", GatedRows, lambda n: (x, y), lambda m, b, r: sq(m(b[0][r]), b[1][r]))
    ref = loop_oracle(case, model, (x, y), 3)
    compare(tracked(case, model, (x, y), [2, 1], "sum"), ref, rtol=1e-10, atol=1e-12)


def test_rows_that_cannot_be_split_by_example_raise() -> None:
    model = Flattening(time_major=True).double()
    x = torch.randn(3, 5, 8, dtype=D)
    with (
        pytest.raises(GradkitError, match=r"fc2 \(Linear\).*15.*3 examples.*\[T \* N, d\]"),
        track(model, "variance"),
    ):
        model(x).pow(2).sum((1, 2)).mean().backward()


def test_a_refusal_of_many_layers_names_the_rest_briefly() -> None:
    """Every layer's problem in full made a 16 kB message on MobileViT (examples times patches
    in 60 layers): the first three are stated, the others named."""

    class TimeMajorRows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x.transpose(0, 1).reshape(-1, 4))

    model = TimeMajorRows().double()
    with pytest.raises(GradkitError) as err, track(model, "variance"):
        model(torch.randn(3, 5, 4, dtype=D)).pow(2).sum().backward()
    text = str(err.value)
    assert text.count("returned outputs of shapes") == 3, text
    assert "and 5 more layers alike: layers.3 (Linear), layers.4 (Linear)" in text, text
    assert len(text) < 1500, text


class NotBroadcast(nn.Module):
    """A position table whose output is permuted before it is added (T5's relative bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(9, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, 2, T, T]
        t = x.shape[-1]
        rel = torch.arange(t)[:, None] - torch.arange(t)[None, :] + 4
        return x + self.bias(rel).permute(2, 0, 1).unsqueeze(0)


def test_output_without_batch_that_is_not_one_example_raises() -> None:
    """[T, T] relative positions are not shaped like one example ([2, T, T]): not reshaped, and
    its gradient, summed over the batch by broadcasting, cannot be split: a clear error."""
    model = NotBroadcast().double()
    x = torch.randn(3, 2, 4, 4, dtype=D)
    plain = model(x)
    with (
        pytest.raises(GradkitError, match=r"bias \(Embedding\).*\(4, 4, 2\).*3 examples"),
        track(model, "variance"),
    ):
        out = model(x)
        assert torch.equal(out, plain)  # the forward is untouched
        out.pow(2).sum().backward()


class Codebook(nn.Module):
    """A module called with no tensor input whose output [K, d] is broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))

    def forward(self, k: int) -> torch.Tensor:
        return self.table[:k] * 2.0


class UsesCodebook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.codes = Codebook()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x) + self.codes(x.shape[1])


def test_module_without_tensor_inputs_broadcast_over_the_batch() -> None:
    model = UsesCodebook().double()
    x, y = torch.randn(5, 4, 8, dtype=D), torch.randn(5, 4, 8, dtype=D)
    case = Case("codebook", UsesCodebook, lambda n: None, lambda m, b, r: sq(m(x[r]), y[r]))
    ref = loop_oracle(case, model, None, 5)
    compare(tracked(case, model, None, [2, 3], "sum"), ref, rtol=1e-10, atol=1e-12)


class PositionsFirst(nn.Module):
    """Positions looked up before the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 8)
        self.tok = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(idx.shape[1])[None])
        return self.out(self.tok(idx) + p)


def test_broadcast_layer_called_before_the_batched_ones() -> None:
    model = PositionsFirst().double()
    idx, y = ids_batch(3)
    case = Case("first", PositionsFirst, ids_batch, lambda m, b, r: sq(m(b[0][r]), b[1][r]))
    ref = loop_oracle(case, model, (idx, y), 3)
    compare(tracked(case, model, (idx, y), [3], "mean"), ref, rtol=1e-10, atol=1e-12)


def test_flat_bag_input_is_not_taken_for_the_batch() -> None:
    """model(text, offsets): the first input is a flat list of indices, not the batch."""
    model = nn.Sequential()
    bag = nn.EmbeddingBag(10, 4, mode="sum").double()
    text, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2])
    plain = bag(text, offsets)
    with track(bag, "batch_grad") as stats:
        out = bag(text, offsets)
        assert torch.equal(out, plain)
        out.pow(2).sum().backward()
    assert stats["weight"].batch_grad.shape == (2, 10, 4)
    del model


def test_broadcast_output_is_a_view_with_the_same_values() -> None:
    model = Positions(True).double()
    idx, _ = ids_batch(4)
    plain = model(idx)
    with track(model, "variance"):
        assert torch.equal(model(idx), plain)
    assert gradkit.per_example.find_rule(model.pos) is not None


@pytest.mark.parametrize("backward", [True, False])
def test_tracker_of_a_broadcast_model_is_freed(backward: bool) -> None:
    """The expanded output holds the hook that holds the tracker: released with the graph."""
    import gc
    import weakref

    model = Positions(True).double()
    idx, _ = ids_batch(4)
    with track(model, "variance", "batch_l2") as stats:
        out = model(idx).pow(2).sum()
        if backward:
            out.backward()
    ref = weakref.ref(stats)
    del stats, out
    gc.collect()
    assert ref() is None


class TiedLM(nn.Module):
    """A tied embedding and output layer with a vocabulary large enough for the Gram-form
    norms of the output layer (the norms' cross term between the two uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 40, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(idx))))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tied_embedding_norms_by_the_cross_term(reduction: str) -> None:
    model = TiedLM().double()
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    idx = torch.randint(0, 40, (5, 4), generator=g)
    idx[:, 1] = idx[:, 0]  # a repeated token
    y = torch.randn(5, 4, 40, generator=g, dtype=D)
    case = Case("tied", TiedLM, lambda n: (idx, y), lambda m, b, r: sq(m(b[0][r]), b[1][r]))
    ref = loop_oracle(case, model, (idx, y), 5)
    compare(tracked(case, model, (idx, y), [2, 3], reduction), ref, rtol=1e-10, atol=1e-12)


def test_sequence_linear_weight_gradient_is_summed_from_the_statistics(monkeypatch) -> None:
    """fuse=True: the layer's output goes through LinearWithSums (no second product), where
    that product is large enough to pay for it."""
    model = nn.Linear(8, 3).double()
    x = torch.randn(4, 5, 8, dtype=D)
    with track(model, "variance"):  # 480 multiply-adds: not worth a custom function
        assert type(model(x).grad_fn).__name__ != "LinearWithSumsBackward"
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 4 * 5 * 8 * 3)
    with track(model, "variance"):
        assert type(model(x).grad_fn).__name__ == "LinearWithSumsBackward"
    with track(model, "variance", fuse=False):
        assert type(model(x).grad_fn).__name__ != "LinearWithSumsBackward"
    with track(model, "batch_l2"):  # Gram-form norms materialize nothing: autograd's product
        assert type(model(x).grad_fn).__name__ != "LinearWithSumsBackward"


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_fused_bias_gradient_is_the_sum_of_the_per_example_ones(monkeypatch, layer) -> None:
    """A fused layer's bias gradient adds the N per-example bias gradients the rule summed over
    the positions (no second pass over the N * T output gradient rows): bit for bit their sum,
    and equal to autograd's to float rounding."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    torch.manual_seed(0)
    if layer == "linear":
        model: nn.Module = nn.Linear(16, 8)
        x = torch.randn(6, 50, 16)
    else:
        model = nn.Conv1d(4, 8, 3)
        x = torch.randn(6, 4, 50)
    model(x).square().sum().backward()
    plain = model.bias.grad.clone()
    model.zero_grad(set_to_none=True)
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        out = model(x)
        assert type(out.grad_fn).__name__.endswith("WithSumsBackward")
        out.square().sum().backward()
    assert torch.equal(model.bias.grad, stats["bias"].batch_grad.sum(0))
    assert_close(model.bias.grad, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))


def _conv_net(**conv: Any) -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, **conv), nn.Tanh(), nn.Conv2d(4, 3, 3)).double()


@pytest.mark.parametrize(
    "conv",
    [{}, {"padding": 1, "stride": 2}, {"padding": "same", "dilation": 2}, {"groups": 2}],
    ids=["plain", "padded_strided", "same_dilated", "grouped"],
)
@pytest.mark.parametrize("quantity", ["variance", "batch_grad"])
def test_convolution_gradients_are_summed_from_the_statistics(monkeypatch, conv, quantity):
    """A convolution's weight and bias gradients come from the per-example blocks the
    statistics materialize (ConvWithSums, no weight product in its backward): the statistics
    are the loop's, p.grad autograd's to float rounding."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    torch.manual_seed(0)
    model = _conv_net(**conv)
    x = torch.randn(5, 2, 9, 9, dtype=D)
    y = torch.randn_like(model(x))
    loss = lambda o, t: (o - t).square().sum()
    loss(model(x), y).backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    with track(model, quantity, loss_reduction="sum") as stats:
        out = model(x)
        assert type(model[0](x).grad_fn).__name__ == "ConvWithSumsBackward"
        loss(out, y).backward()
    ref = gradkit.testing.per_example_grads(model, loss, x, y)
    for name, g in ref.items():
        got = stats[name].batch_grad if quantity == "batch_grad" else stats[name].variance
        want = g if quantity == "batch_grad" else g.var(0, unbiased=False)
        assert_close(got, want, rtol=1e-10, atol=1e-12, name=name)
    assert same_grads({k: p.grad for k, p in model.named_parameters()}, plain) == []


@pytest.mark.parametrize(
    "conv,why",
    [
        ({"padding_mode": "reflect", "padding": 1}, "padding other than zeros"),
        ({"padding": "same", "dilation": 1, "kernel_size": 2}, "asymmetric 'same' padding"),
    ],
)
def test_convolutions_not_fused_keep_autograd(monkeypatch, conv, why):
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    k = conv.pop("kernel_size", 3)
    model = nn.Conv2d(2, 4, k, **conv).double()
    with track(model, "variance"):
        assert type(model(torch.randn(3, 2, 6, 6, dtype=D)).grad_fn).__name__ != (
            "ConvWithSumsBackward"
        ), why


def test_small_convolutions_keep_autograd_by_default():
    """Under MIN_PRODUCT multiply-adds a custom function costs more than it saves."""
    model = _conv_net()
    with track(model, "variance"):
        assert type(model[0](torch.randn(3, 2, 9, 9, dtype=D)).grad_fn).__name__ != (
            "ConvWithSumsBackward"
        )


def test_double_backward_through_a_fused_convolution(monkeypatch) -> None:
    """A penalty on a gradient taken with create_graph through a fused convolution: its weight
    gradient is multiplied (differentiable), and the second derivative is autograd's. A pass
    that differentiates it w.r.t. a weight the gradient's graph uses again is refused (its
    per-example gradients would leave that use out)."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    torch.manual_seed(0)
    model = _conv_net(padding=1)
    x = torch.randn(3, 2, 7, 7, dtype=D)

    def penalty() -> torch.Tensor:
        out = model(x).square().sum()
        (gw,) = torch.autograd.grad(out, [model[0].weight], create_graph=True)
        return gw.square().sum()

    want = torch.autograd.grad(penalty(), [model[0].bias])
    with track(model, "variance"):
        got = torch.autograd.grad(penalty(), [model[0].bias])
        with pytest.raises(GradkitError, match="'2.weight' used on the examples outside"):
            torch.autograd.grad(penalty(), [model[2].weight])
    assert_close(list(got), list(want), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("quantity", ["mean", "variance", "batch_l2"])
def test_sequence_linear_then_an_in_place_activation_is_exact(monkeypatch, fuse, quantity):
    """A Linear on [N, T, d] returns a view of its [N * T, o] product; relu_ on that view takes
    the view's node out of the graph (its hooks never fire): the tracker reads the gradient at
    the base. It used to be missed (refused, or zero without the outside-use check)."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)).double()
    x, y = torch.randn(4, 5, 8, dtype=D), torch.randn(4, 5, 8, dtype=D)
    loss = lambda o, t: (o - t).square().sum()
    with track(model, quantity, loss_reduction="sum", fuse=fuse) as stats:
        loss(model(x), y).backward()
    ref = gradkit.testing.per_example_grads(model, loss, x, y)
    if quantity == "batch_l2":
        want = sum(g.flatten(1).square().sum(1) for g in ref.values())
        assert_close(stats.batch_l2(), want, rtol=1e-10, atol=1e-12)
    for name, g in ref.items():
        want = g.mean(0) if quantity == "mean" else g.var(0, unbiased=False)
        if quantity != "batch_l2":
            assert_close(getattr(stats[name], quantity), want, rtol=1e-10, atol=1e-12)


class _FirstColumns(nn.Module):
    """Returns a view of part of its product (no rule: the vmap fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight)[:, :2]


@pytest.mark.parametrize("head", [False, True], ids=["alone", "before_a_linear"])
def test_an_in_place_operation_on_a_partial_view_output_is_refused(head):
    """The view's gradient cannot be read once relu_ took its node out of the graph: refused,
    rather than zero per-example gradients; before any gradient where the pass reaches another
    tracked layer first, else at the view's base."""
    layers = [_FirstColumns(), nn.ReLU(inplace=True)] + ([nn.Linear(2, 2).double()] * head)
    model = nn.Sequential(*layers)
    with track(model, "variance"):
        out = model(torch.randn(5, 3, dtype=D))
        with pytest.raises(GradkitError, match="modified in place"):
            out.sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_double_backward_through_a_fused_layer(monkeypatch) -> None:
    """A gradient penalty (create_graph) through a tracked sequence Linear: the weight's
    gradient is multiplied (differentiable), and the second derivative is autograd's."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(3, 5, 8, dtype=D)
    with track(model, "variance"):
        assert type(model(x).grad_fn).__name__ == "LinearWithSumsBackward"

    def penalty() -> torch.Tensor:
        out = model(x).sum()
        (gw,) = torch.autograd.grad(out, [model[0].weight], create_graph=True)
        return gw.square().sum()

    want = torch.autograd.grad(penalty(), [model[2].weight])[0]
    with track(model, "variance"):
        got = torch.autograd.grad(penalty(), [model[2].weight])[0]
    assert_close(got, want, rtol=1e-12, atol=1e-14)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    """The forward re-run inside the backward is not a new use, and nothing it captured is
    kept after the backward."""
    model = Checkpointed(reentrant).double()
    x = torch.randn(4, 5, 8, dtype=D, requires_grad=reentrant)  # reentrant needs an input grad
    y = torch.randn(4, 5, 3, dtype=D)
    case = Case("ckpt", nn.Identity, torch.zeros, lambda m, b, r: sq(m(b[0][r]), b[1][r]))
    plain = copy.deepcopy(model)
    plain.reentrant = False  # the loop's autograd.grad is wrong through reentrant checkpoints
    ref = loop_oracle(case, plain, (x, y), 4)
    with track(model, *QUANTITIES, moments=(3,), loss_reduction="sum") as stats:
        for rows in (slice(0, 3), slice(3, 4)):
            case.losses(model, (x, y), rows).sum().backward()
            assert stats._records == []
    compare(stats, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layers", ["linear", "conv"])
def test_layers_under_bf16_autocast(monkeypatch, device, layers) -> None:
    """Under autocast a layer runs in bf16 with a float32 weight. Its weight gradient is
    autograd's own (not fused, whatever `fuse` says): `p.grad` is bit for bit the untracked
    one. Every statistic comes from the float32 per-example gradients: the mean is their mean
    (not the bf16 batch product, rounded at 4e-3), so the variance is theirs too, where
    E[g^2] - mean^2 from the two mixed came out 3.9x off at an SNR of 500."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
    torch.manual_seed(0)
    if layers == "linear":
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        x = torch.randn(16, 5, 8) + 3.0
    else:
        model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 1, 3))
        x = torch.randn(16, 2, 8, 8) + 3.0

    def loss() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x)
        return (out.float() - 5.0).pow(2).sum()

    model.zero_grad()
    loss().backward()
    untracked = {k: p.grad.clone() for k, p in model.named_parameters()}
    for fuse in (False, True):
        model.zero_grad()
        with track(model, "mean", "variance", "batch_grad", loss_reduction="sum", fuse=fuse) as st:
            loss().backward()
        for k, p in model.named_parameters():
            assert torch.equal(p.grad, untracked[k]), k
            g = st[k].batch_grad.double()
            assert_close(st[k].mean, g.mean(0).float(), rtol=1e-5, atol=1e-6 * g.abs().max())
            want = g.var(0, unbiased=False)
            scale = g.square().mean(0).max()  # the variance's float32 rounding scales with it
            assert_close(st[k].variance.double(), want, rtol=1e-4, atol=1e-5 * scale)


class _LastStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.rnn, self.head = (
            nn.Linear(3, 4),
            nn.GRU(4, 4, batch_first=True),
            nn.Linear(4, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.inp(x))[0][:, -1])


@pytest.mark.parametrize("kind", ["prelu", "gru"])
def test_fallback_modules_under_bf16_autocast(device, kind) -> None:
    """A module under the vmap fallback (PReLU, GRU) whose input is bf16 (a Linear's output
    under autocast) is re-run per example in the backward pass, outside the autocast region:
    the re-run raised torch's dtype errors (wrapped in advice about batch_dim). It is re-run in
    the regions the call ran in."""
    torch.manual_seed(0)
    if kind == "prelu":
        model: nn.Module = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 1))
        x = torch.randn(6, 3)
    else:
        model = _LastStep()
        x = torch.randn(6, 5, 3)
    y = torch.randn(6, 1)

    def loss(rows: slice) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x[rows])
        return (out.float() - y[rows]).pow(2).sum()

    want: dict[str, list[torch.Tensor]] = {}
    for i in range(6):  # each example alone, under the same autocast
        grads = torch.autograd.grad(loss(slice(i, i + 1)), list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads, strict=True):
            want.setdefault(name, []).append(g)
    with track(model, "variance", "batch_grad", loss_reduction="sum") as stats:
        loss(slice(0, 6)).backward()
    for name, gs in want.items():
        g = torch.stack(gs).double()
        scale = float(g.abs().max())  # bf16 products, batched or one example at a time
        assert_close(stats[name].batch_grad.double(), g, rtol=3e-2, atol=3e-2 * scale, name=name)


class TiedHead(nn.Module):
    """An embedding tied to the output layer, as GPT-2's ``wte`` and ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def test_a_weight_tied_across_a_float32_and_a_bf16_use(device) -> None:
    """Under autocast the embedding runs in float32 (its mean read at its edges) and the tied
    head in bf16 (its mean from the per-example gradients): summing the combined per-example
    gradients added the embedding's share a second time (the mean 0.67 off; HF Trainer's
    bf16=True on GPT-2: the noise scale 38 % off)."""
    torch.manual_seed(0)
    model = TiedHead()
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    ids = torch.randint(0, 20, (6, 5), generator=gen)
    with track(model, "mean", "variance", "batch_grad", loss_reduction="sum") as st:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids)
        loss = torch.nn.functional.cross_entropy
        loss(logits.float().flatten(0, 1), ids.flatten(), reduction="sum").backward()
    g = st["emb.weight"].batch_grad.double()
    grad = model.emb.weight.grad.double()
    assert_close(g.sum(0), grad, rtol=1e-2, atol=1e-2 * grad.abs().max())  # bf16 products
    assert_close(st["emb.weight"].mean.double(), g.mean(0), rtol=1e-5, atol=1e-6 * g.abs().max())


class TakesRow(nn.Module):
    """Positions looked up with [1, T] ids, then taken along the batch dimension."""

    def __init__(self, take: str) -> None:
        super().__init__()
        self.take = take
        self.tok = nn.Embedding(11, 8)
        self.pos = nn.Embedding(6, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pe = self.pos(torch.arange(idx.shape[1])[None])  # [1, T, d]
        pe = pe[0] if self.take == "select" else pe.sum(0)  # [T, d]: fine untracked
        return self.tok(idx) + pe


@pytest.mark.parametrize("take", ["select", "sum"])
def test_broadcast_output_taken_along_the_batch_raises(take: str) -> None:
    model = TakesRow(take).double()
    idx, _ = ids_batch(3)
    plain = model(idx)
    with (
        pytest.raises(GradkitError, match=r"pos \(Embedding\).*along the batch dimension"),
        track(model, "variance"),
    ):
        out = model(idx)
        assert torch.equal(out, plain) if take == "select" else True
        out.pow(2).sum().backward()


def test_fuse_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"fuse: expected a bool, got 1"):
        track(nn.Linear(2, 2), "variance", fuse=1)  # type: ignore[arg-type]


class TransposesPositions(nn.Module):
    """A [T] lookup (shaped like one example) whose output is transposed, not broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, T, 8]
        table = self.pos(torch.arange(x.shape[1]))  # [T, 8]
        return x @ table.transpose(0, 1)  # [N, T, T]


def test_the_note_names_the_module_given_a_batch_dimension() -> None:
    """[T] ids are shaped like one example of the [N, T] input: the output gets a batch
    dimension, which this model cannot take; the forward's error says which module."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = TransposesPositions()

        def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + ids.unsqueeze(-1)

    model = Wrapper().double()
    ids = torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(RuntimeError) as err, track(model, "variance"):
        model(ids, torch.randn(3, 5, 8, dtype=D))
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "inner.pos (Embedding)" in notes and "batch dimension of 3 examples" in notes


class WindowBias(nn.Module):
    """A learned [1, d] bias, as Swin's relative position bias: the model adds it to rows that
    are examples times windows, so its [N, d] expansion no longer broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(8))

    def forward(self) -> torch.Tensor:
        return self.table.unsqueeze(0)


def test_the_note_names_a_size_one_output_that_was_expanded() -> None:
    class Windows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = WindowBias()

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, 2, 8], two windows
            return x.reshape(-1, 8) + self.bias()

    model = Windows().double()
    with pytest.raises(RuntimeError) as err, track(model, "variance"):
        model(torch.randn(3, 2, 8, dtype=D))
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "bias (WindowBias) (a batch dimension of 1)" in notes and "3 examples" in notes


# -- layers whose weight is computed from other parameters at each call ---------------------------


_REPARAMETRIZED = {
    "weight_norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(3, 4)),
    "weight_norm_no_bias": lambda: nn.utils.parametrizations.weight_norm(
        nn.Linear(3, 4, bias=False)
    ),
    "orthogonal": lambda: nn.utils.parametrizations.orthogonal(nn.Linear(3, 4)),
    "spectral_norm_eval": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4)).eval(),
    "hook_weight_norm": lambda: nn.utils.weight_norm(nn.Linear(3, 4)),
    "hook_spectral_norm_eval": lambda: nn.utils.spectral_norm(nn.Linear(3, 4)).eval(),
    "pruned": lambda: _pruned(nn.Linear(3, 4)),
}


def _pruned(layer: nn.Module) -> nn.Module:
    from torch.nn.utils import prune

    prune.l1_unstructured(layer, "weight", amount=0.5)  # weight = weight_orig * weight_mask
    prune.random_unstructured(layer, "bias", amount=0.5)
    return layer


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("layer", list(_REPARAMETRIZED))
def test_reparametrized_layers_are_exact(layer):
    """A Linear whose weight is computed from other parameters at each call: the Linear rule
    would read the weight as a parameter (a parametrized one failed with an error from torch,
    a hook-based weight_norm with one blaming the rule); the fallback differentiates the whole
    layer."""
    torch.manual_seed(0)
    batch = (torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D))
    case = Case(
        layer,
        lambda: nn.Sequential(_REPARAMETRIZED[layer](), nn.Tanh(), nn.Linear(4, 2)).double(),
        lambda n: batch,
        lambda m, b, r: sq(m(b[0][r]), b[1][r]),
    )
    model = case.model()
    # the loop runs on the model itself: the hook-based norms cannot be deep-copied
    ref = loop_oracle(case, model, batch, 5)
    stats = tracked(case, model, batch, [2, 3], "sum")
    assert set(stats) == set(ref)
    compare(stats, ref, rtol=1e-10, atol=1e-12)


def test_a_parametrized_layer_inside_parametrize_cached_is_refused():
    """``parametrize.cached()`` computes the weight once for every call in its block: the
    fallback's re-run of one example did not recompute it (per-example gradients of 0) and two
    calls shared its graph (each read the other's gradient: the mean 2x), silently. Refused at
    the call; outside ``cached()`` the same layer is exact (test above)."""
    from torch.nn.utils import parametrize

    layer = nn.Linear(4, 4).double()
    nn.utils.parametrizations.orthogonal(layer)
    with track(layer, "variance"), parametrize.cached(), pytest.raises(GradkitError) as err:
        layer(torch.randn(5, 4, dtype=D))
    text = str(err.value)
    assert "parametrize.cached()" in text and "model (ParametrizedLinear)" in text, text
    assert layer.parametrizations.weight.original.grad is None


def test_the_parametrization_check_agrees_with_torch():
    """The tracker reads a module's parametrizations where torch puts them (a cheaper lookup
    than ``is_parametrized``'s): the same answer on and after parametrizing, after removing
    it, and for modules around and inside a parametrized one."""
    from torch.nn.utils import parametrize

    from gradkit.per_example._registry import _parametrized

    layer = nn.Linear(3, 4)
    model = nn.Sequential(layer, nn.ReLU())
    before = [*model.modules()]
    nn.utils.parametrizations.orthogonal(layer)
    after = [*model.modules()]
    answers = [_parametrized(m) for m in after]
    assert answers == [parametrize.is_parametrized(m) for m in after]
    assert answers.count(True) == 1 and _parametrized(layer)
    parametrize.remove_parametrizations(layer, "weight")
    assert not _parametrized(layer)
    assert [_parametrized(m) for m in before] == [parametrize.is_parametrized(m) for m in before]


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.spectral_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("hooked", [False, True], ids=["parametrization", "hook"])
def test_a_spectral_norm_in_training_mode_is_refused(hooked):
    """Its power iteration updates the layer at each call: re-running it for per-example
    gradients would change the layer and the weight it differentiates."""
    norm = nn.utils.spectral_norm if hooked else nn.utils.parametrizations.spectral_norm
    model = nn.Sequential(norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(GradkitError, match=r"spectral norm in training mode.*0\.eval\(\)"):
        track(model, "variance")

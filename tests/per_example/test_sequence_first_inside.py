"""A model that is batch-first outside and sequence-first inside a block (Longformer's attention
runs its q/k/v Linear layers on ``hidden_states.transpose(0, 1)``, ``[T, N, d]``).

Where ``T != N`` the sizes refuse the split; where ``T == N`` they cannot tell, and reading
dimension 0 as the examples gave the per-position gradients as per-example ones, silently
(Longformer's query weight: per-example gradients 1.3x off, variance 1.6x). The examples'
dimension is now followed through the graph from the output of a batched layer: refused with
the dimension to give, and exact once ``batch_dim`` says it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradkit
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64


class SequenceFirstInside(nn.Module):
    """``[N, T, d]`` in and out; ``inner`` sees ``[T, N, d]`` (by ``how``)."""

    def __init__(self, how: str, back: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.how, self.back = how, back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        if self.how == "transpose":
            h = h.transpose(0, 1)
        elif self.how == "permute":
            h = h.permute(1, 0, 2).contiguous()
        elif self.how == "movedim":
            h = torch.relu(h.movedim(1, 0))
        if self.back:  # and back to batch-first before the layer: the examples in dimension 0
            h = h.transpose(0, 1)
        z = self.inner(h)
        if self.how != "none" and not self.back:
            z = z.transpose(0, 1)
        return self.head(z).sum(1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _data(n: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    return torch.randn(n, t, 4, generator=g, dtype=D), torch.randint(0, 2, (n,), generator=g)


@pytest.mark.parametrize("how", ["transpose", "permute", "movedim"])
def test_a_layer_on_a_transposed_batch_of_as_many_positions_is_refused(how: str) -> None:
    torch.manual_seed(0)
    model = SequenceFirstInside(how).double()
    x, y = _data(3, 3)  # T == N
    with pytest.raises(gradkit.GradkitError) as raised, track(model, "variance"):
        _loss(model(x), y).backward()
    text = str(raised.value)
    assert "inner (Linear) reads its examples in dimension 0" in text, text
    assert "they are in dimension 1" in text and "batch_dim={<its name or its block's>: 1}" in text
    assert model.inner.weight.grad is None  # refused before any gradient


@pytest.mark.parametrize("how", ["transpose", "permute", "movedim"])
def test_the_batch_dim_it_names_gives_the_oracles_gradients(how: str) -> None:
    torch.manual_seed(0)
    model = SequenceFirstInside(how).double()
    x, y = _data(3, 3)
    want = per_example_grads(model, _loss, x, y)
    with track(model, "variance", "batch_grad", batch_dim={"": 0, "inner": 1}) as stats:
        _loss(model(x), y).backward()
    for name, g in want.items():
        torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


def test_a_transpose_back_to_batch_first_is_not_refused() -> None:
    torch.manual_seed(0)
    model = SequenceFirstInside("transpose", back=True).double()
    x, y = _data(3, 3)
    want = per_example_grads(model, _loss, x, y)
    with track(model, "batch_grad") as stats:
        _loss(model(x), y).backward()
    for name, g in want.items():
        torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


class InputTransposed(nn.Module):
    """The model's own input (no graph) transposed to ``[T, N, d]`` for its first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.transpose(0, 1)).sum(0)


def test_a_layer_on_the_models_transposed_input_is_refused_too() -> None:
    torch.manual_seed(0)
    model = InputTransposed().double()
    x, y = _data(3, 3)
    refused = "inner \\(Linear\\) reads its examples"
    with pytest.raises(gradkit.GradkitError, match=refused), track(model, "variance"):
        _loss(model(x), y).backward()
    want = per_example_grads(model, _loss, x, y)
    with track(model, "batch_grad", batch_dim={"": 0, "inner": 1}) as stats:
        _loss(model(x), y).backward()
    for name, g in want.items():
        torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


def test_other_sizes_are_refused_by_the_sizes_as_before() -> None:
    torch.manual_seed(0)
    model = SequenceFirstInside("transpose").double()
    x, y = _data(3, 5)
    refused = "inner \\(Linear\\) returned outputs"
    with pytest.raises(gradkit.GradkitError, match=refused), track(model, "variance"):
        _loss(model(x), y).backward()


def test_longformer_with_as_many_positions_as_examples() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LongformerConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=24,
        attention_window=4,
        pad_token_id=1,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.LongformerForSequenceClassification(config).double()
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    ids = torch.randint(4, 60, (4, 4), generator=g)  # N == T == the attention window
    kwargs = {"attention_mask": torch.ones(4, 4, dtype=torch.long)}
    kwargs["global_attention_mask"] = torch.zeros(4, 4, dtype=torch.long)
    y = torch.tensor([0, 2, 1, 2])

    def loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, labels)

    def logits(ids: torch.Tensor, index: slice) -> torch.Tensor:
        return model(input_ids=ids, **{k: v[index] for k, v in kwargs.items()}).logits

    refused = "attention.self.query \\(Linear\\) reads"
    with pytest.raises(gradkit.GradkitError, match=refused), track(model, "variance"):
        loss(logits(ids, slice(None)), y).backward()
    model.zero_grad(set_to_none=True)
    inner = {"": 0, "longformer.encoder.layer.0.attention.self": 1}
    with track(model, "batch_grad", batch_dim=inner) as stats:
        loss(logits(ids, slice(None)), y).backward()
    key = "longformer.encoder.layer.0.attention.self.query.weight"
    rows = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        loss(logits(ids[i : i + 1], slice(i, i + 1)), y[i : i + 1]).backward()
        rows.append(model.get_parameter(key).grad.clone())
    torch.testing.assert_close(stats[key].batch_grad, torch.stack(rows), rtol=1e-10, atol=1e-12)


class PreNormHead(nn.Module):
    """A sequence-first pre-norm encoder layer (its output is a residual sum) and a head."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, norm_first=norm_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N, E]
        return self.head(self.enc(x))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_a_head_on_a_sequence_first_encoder_with_as_many_positions(norm_first: bool) -> None:
    """The head reads [T, N, E] as [N, T, E] by default. Post-norm, the encoder's output is its
    last LayerNorm's (refused since the graph is followed); pre-norm, it is a residual sum, which
    the walk did not pass: the head's statistics were silently those of positions."""
    torch.manual_seed(0)
    model = PreNormHead(norm_first).double()
    x, y = torch.randn(5, 5, 8, dtype=D), torch.randn(5, 5, 3, dtype=D)  # y: [N, T, 3]

    def losses(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out.transpose(0, 1) * target).sum((1, 2))

    refused = "head \\(Linear\\) reads its examples"
    with pytest.raises(gradkit.GradkitError, match=refused), track(model, "variance"):
        losses(model(x), y).mean().backward()
    want = per_example_grads(model, lambda o, t: losses(o, t).sum(), x, y, batch_dim=1)
    with track(model, "variance", "batch_grad", batch_dim=1) as stats:
        losses(model(x), y).mean().backward()
    for name, g in want.items():
        torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


class _SequenceFirstGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.rnn, self.head = nn.Linear(3, 5), nn.GRU(5, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N, 3] -> [T, N]
        return self.head(self.rnn(torch.tanh(self.inp(x)))[0]).squeeze(-1)


def test_a_layer_read_by_its_own_layout_advises_the_model_s_batch_dim() -> None:
    """A sequence-first GRU after a Linear on [T, N, d] with T == N: the GRU reads the examples
    in dimension 1 whatever batch_dim says, so naming it in batch_dim cannot help (the advice
    said to, and gave the same error again); the Linear before it took dimension 0. The
    advice is the model's batch_dim=1, which gives the oracle's gradients."""
    torch.manual_seed(0)
    model = _SequenceFirstGRU().double()
    x = torch.randn(4, 4, 3, dtype=D)  # T == N

    def loss_fn(out: torch.Tensor, _: object) -> torch.Tensor:
        return out.pow(2).sum()

    with pytest.raises(gradkit.GradkitError) as raised, track(model, "variance"):
        model(x).pow(2).sum(0).mean().backward()
    text = str(raised.value)
    assert "rnn (GRU) reads its examples in dimension 1" in text, text
    assert "Pass batch_dim=1 if the model's input holds its examples in dimension 1" in text
    with track(model, "batch_grad", loss_reduction="sum", batch_dim=1) as stats:
        model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        want = torch.stack(
            [torch.autograd.grad(loss_fn(model(x[:, i : i + 1]), None), p)[0] for i in range(4)]
        )
        assert_close(stats[name].batch_grad, want)


def test_an_unbatched_input_is_named_in_the_refusal() -> None:
    """torch's RNNs take [T, F] as one example without a batch dimension: the refusal said the
    outputs held "[] examples" only; it names the unbatched input and the fix."""
    model = nn.GRU(3, 4).double()
    refused = pytest.raises(gradkit.GradkitError, match=r"without a batch dimension \(an RNN")
    with refused, track(model, "variance"):
        model(torch.randn(5, 3, dtype=D))[0].sum().backward()

"""Per-example statistics on Hugging Face ``transformers`` models built from small configs (no
download), used exactly as a user would (the model's own ``position_ids``, attention masks,
tied weights), against a float64 loop that calls the model on one example at a time.

Models: GPT-2 (HF ``Conv1D``, tied ``lm_head``, learned positions ``[1, T]``), BERT (padding
mask, ``token_type_ids``), Llama (RMSNorm, rotary, gated MLP, grouped KV heads), BART (scaled
word and learned positional embeddings, tied ``lm_head``), T5 (relative attention bias: frozen
in the model table; a separate test asks that tracking it is exact or refused). Every model is in
``.train()`` mode with every dropout probability 0, eager attention, padded examples of unequal
lengths.

Every parameter and quantity (mean, second moment, variance, third moment, ``batch_l2``,
``batch_grad``) at rtol 1e-10, loss reduction "mean" and "sum", one pass and unequal
micro-batches; ``p.grad`` untouched; float32 against the float64 oracle at rtol 1e-4.

Llama and T5 normalize in float32 even in a float64 model (``LlamaRMSNorm`` casts to float32,
``T5LayerNorm`` takes the variance in float32), so the gradient the backward of a mean over
``N`` examples carries, ``l_i' / N``, is rounded in float32 there and the batched gradient
itself (``p.grad``) differs from the mean of the individual ones by ~1e-7 unless ``N`` is a
power of two. Their "mean" cases use micro-batches of 4 and 2; "sum" cases take any size.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradkit
from gradkit import GradkitError
from gradkit.per_example import _fused, find_rule, track
from gradkit.per_example.rules._thirdparty import (
    conv1d_rule,
    learned_positions_rule,
    register_available,
    scaled_embedding_rule,
)

from ._grads_check import same_grads

transformers = pytest.importorskip("transformers")

D = torch.float64


@pytest.fixture(autouse=True)
def fuse_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """These configs are small: fuse every layer call that can be (its weight gradient summed
    from the per-example gradients), the path real-sized models take."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)


V, T, N_MAX = 30, 7, 6
LENGTHS = (7, 4, 6, 2, 7, 5)  # real tokens per example; the rest is padding
QUANTITIES = ("mean", "second_moment", "variance", "batch_l2", "batch_grad")
Tensors = dict[str, torch.Tensor]


# -- the oracle ----------------------------------------------------------------------------------


def per_example_oracle(
    model: nn.Module,
    inputs: Tensors,
    loss_fn: Callable[[Any, Tensors], torch.Tensor],
    targets: Tensors | None = None,
) -> Tensors:
    """``g_i = d l_i / d theta`` with a float64 copy of ``model`` called on example ``i`` alone:
    every input and target sliced ``[i:i+1]`` along dimension 0; ``loss_fn(output, targets_i)``
    gives the per-example losses. Returns ``{name: [N, *param.shape]}``."""
    m = copy.deepcopy(model).to(D)
    targets = targets or {}
    named = [(k, p) for k, p in m.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {k: [] for k, _ in named}
    n = next(iter(inputs.values())).shape[0]
    for i in range(n):
        one = {
            k: v[i : i + 1].to(D) if v.is_floating_point() else v[i : i + 1]
            for k, v in inputs.items()
        }
        loss = loss_fn(m(**one), {k: v[i : i + 1] for k, v in targets.items()}).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (k, p), g in zip(named, grads, strict=True):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(r) for k, r in rows.items()}


# -- models and batches --------------------------------------------------------------------------


def _padded(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [n, T]`` (pad id 0 after each example's length) and ``attention_mask``."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    ids = torch.randint(3, V, (N_MAX, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return (ids * mask)[:n], mask[:n]


def lm_batch(n: int) -> tuple[Tensors, Tensors]:
    ids, mask = _padded(n)
    return {"input_ids": ids, "attention_mask": mask}, {"labels": ids.masked_fill(mask == 0, -100)}


def causal_lm_loss(out: Any, t: Tensors) -> torch.Tensor:
    """Mean cross entropy over each example's predicted tokens (token ``s`` predicts ``s+1``)."""
    logits, labels = out.logits[:, :-1], t["labels"][:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return tokens.sum(1) / (labels != -100).sum(1)


def classify_batch(n: int) -> tuple[Tensors, Tensors]:
    ids, mask = _padded(n, seed=1)
    segment = (torch.arange(T)[None] >= torch.tensor(LENGTHS)[:n, None] // 2).long() * mask
    gen = torch.Generator(torch.get_default_device()).manual_seed(2)
    labels = torch.randint(0, 3, (N_MAX,), generator=gen)[:n]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": segment}, {"y": labels}


def classify_loss(out: Any, t: Tensors) -> torch.Tensor:
    return F.cross_entropy(out.logits, t["y"], reduction="none")


def seq2seq_batch(n: int) -> tuple[Tensors, Tensors]:
    ids, mask = _padded(n, seed=3)
    g = torch.Generator(torch.get_default_device()).manual_seed(4)
    dec = torch.randint(3, V, (N_MAX, 5), generator=g)[:n]
    labels = torch.randint(3, V, (N_MAX, 5), generator=g)[:n]
    dec_mask = torch.ones_like(dec)
    if n > 2:
        labels[2, 3:], dec_mask[2, 3:] = -100, 0
    inputs = {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder_input_ids": dec,
        "decoder_attention_mask": dec_mask,
    }
    return inputs, {"labels": labels}


def seq2seq_loss(out: Any, t: Tensors) -> torch.Tensor:
    labels = t["labels"]
    tokens = F.cross_entropy(
        out.logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
    )
    return tokens.sum(1) / (labels != -100).sum(1)


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def opt() -> nn.Module:
    """OPT: its MLP and final LayerNorm run on the positions merged into rows, [N * T, d]."""
    cfg = transformers.OPTConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
        max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )  # fmt: skip
    return transformers.OPTForCausalLM(cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
        pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def bart() -> nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        scale_embedding=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None, attn_implementation="eager",
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def t5_frozen_bias() -> nn.Module:
    """T5 with its relative attention bias frozen (what track's error asks for)."""
    model = t5()
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            p.requires_grad_(False)
    return model


@dataclass(frozen=True)
class HFCase:
    id: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[Tensors, Tensors]]  # n -> (model inputs, targets)
    loss: Callable[[Any, Tensors], torch.Tensor]  # (output, targets) -> [n] losses
    float32_inside: bool = False  # norms in float32: "mean" only over powers of two


MODELS = {
    c.id: c
    for c in [
        HFCase("gpt2", gpt2, lm_batch, causal_lm_loss),
        HFCase("opt", opt, lm_batch, causal_lm_loss, float32_inside=True),  # softmax in float32
        HFCase("bert", bert, classify_batch, classify_loss),
        HFCase("llama", llama, lm_batch, causal_lm_loss, float32_inside=True),
        HFCase("bart", bart, seq2seq_batch, seq2seq_loss),
        HFCase("t5_frozen_bias", t5_frozen_bias, seq2seq_batch, seq2seq_loss, float32_inside=True),
    ]
}
SPLITS = [("mean", (4,)), ("sum", (5,)), ("mean", (4, 2)), ("sum", (3, 2)), ("mean", (3, 2))]


def build(case: HFCase, dtype: torch.dtype = D) -> nn.Module:
    torch.manual_seed(0)
    model = case.build().to(dtype).train()
    register_available()  # as track() does; after the build, which imports the modeling module
    return model


@functools.cache
def oracle(case_id: str) -> Tensors:
    """The individual gradients of all ``N_MAX`` examples (computed once per model)."""
    case = MODELS[case_id]
    inputs, targets = case.batch(N_MAX)
    return per_example_oracle(build(case), inputs, case.loss, targets)


def run_tracked(case: HFCase, model: nn.Module, reduction: str, splits: tuple[int, ...]) -> Any:
    inputs, targets = case.batch(sum(splits))
    with track(model, *QUANTITIES, moments=(3,), loss_reduction=reduction) as stats:
        start = 0
        for size in splits:
            rows = slice(start, start + size)
            out = model(**{k: v[rows] for k, v in inputs.items()})
            losses = case.loss(out, {k: v[rows] for k, v in targets.items()})
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
            start += size
    return stats


def mismatches(stats: Any, ref: Tensors, rtol: float, floor: float) -> list[str]:
    """Every (parameter, quantity) where the tracked statistic differs from the oracle's.

    Elementwise ``|got - want| <= atol + rtol |want|`` with ``atol = rtol * scale``, ``scale``
    the largest entry of that quantity for that parameter (of the second moment for the
    variance, whose cancellation error scales with it), at least ``floor`` times the largest
    over all parameters: parameters whose gradient is zero in exact arithmetic (attention key
    biases: softmax ignores a shift shared by a row) hold rounding noise only.
    """
    names = ("mean", "second_moment", "variance", "moment(3)", "batch_l2", "batch_grad")
    want: dict[str, dict[str, torch.Tensor]] = {}
    for name, g in ref.items():
        want[name] = {
            "mean": g.mean(0),
            "second_moment": (g**2).mean(0),
            "variance": g.var(0, unbiased=False),
            "moment(3)": (g**3).mean(0),
            "batch_l2": g.flatten(1).square().sum(1),
            "batch_grad": g,
        }
    scale_of = {"variance": "second_moment"}
    top = {q: max(float(w[scale_of.get(q, q)].abs().max()) for w in want.values()) for q in names}
    bad = []
    for name, quantities in want.items():
        s = stats[name]
        got = {
            "mean": s.mean,
            "second_moment": s.second_moment,
            "variance": s.variance,
            "moment(3)": s.moment(3),
            "batch_l2": s.batch_l2,
            "batch_grad": s.batch_grad,
        }
        for q, w in quantities.items():
            g = got[q]
            if g.shape != w.shape:
                bad.append(f"{name} {q}: shape {tuple(g.shape)}, expected {tuple(w.shape)}")
                continue
            scale = max(float(quantities[scale_of.get(q, q)].abs().max()), floor * top[q])
            err = (g.to(D) - w).abs() - rtol * w.abs()
            if bool((err > rtol * scale).any()):
                rel = float(((g.to(D) - w).abs().max()) / max(scale, 1e-300))
                bad.append(f"{name} {q}: off by {rel:.1e} of its scale")
    return bad


# -- HF Conv1D: the rule itself -----------------------------------------------------------------


class Conv1DNet(nn.Module):
    """Two HF Conv1D layers, the second used twice, and a Linear tied to the first's weight."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.up, self.mid = Conv1D(h, d), Conv1D(h, h)
        self.back = nn.Linear(h, d, bias=False)
        self.back.weight = self.up.weight  # [d, h] as Conv1D ([in, out]) and as Linear ([out, in])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.mid(torch.tanh(self.mid(torch.tanh(self.up(x))))))
        return self.back(z)


@pytest.mark.parametrize("positions", [(), (3,), (2, 40)], ids=["T1", "T3", "T80"])
def test_conv1d_closed_forms_equal_materialized(positions: tuple[int, ...]) -> None:
    """``power_sum``, ``sq_norms`` and ``chunks`` of the Conv1D rule's weight against an einsum
    ``g_n = sum_t a[n, t]^T G[n, t]`` ``[i, o]`` (one position: closed forms; 3 positions:
    Gram norms; 80: materialized norms)."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    i, o = 10, 12
    m = Conv1D(o, i).to(D)  # weight [i, o]
    x, g = torch.randn(4, *positions, i, dtype=D), torch.randn(4, *positions, o, dtype=D)
    ctx = gradkit.per_example.RuleContext(dict(m.named_parameters()))
    pe = conv1d_rule(m, [gradkit.per_example.Use((x,), g)], ctx)
    w = torch.einsum("nti,nto->nio", x.reshape(4, -1, i), g.reshape(4, -1, o))
    b = g.reshape(4, -1, o).sum(1)
    assert pe["weight"].shape == m.weight.shape == (i, o)
    assert torch.allclose(torch.cat(list(pe["weight"].chunks(3))), w, rtol=1e-12, atol=0)
    assert torch.allclose(next(pe["bias"].chunks(4)), b, rtol=1e-12, atol=0)
    norms = pe["weight"].sq_norms()
    assert (norms is None) == (positions == (2, 40))  # closed form or Gram form, else None
    if norms is not None:
        assert torch.allclose(norms, w.flatten(1).square().sum(1), rtol=1e-12, atol=0)
    for p in (1, 2, 3, 4):
        s = pe["weight"].power_sum(p, scale=0.5)
        assert (s is not None) == (positions == ())
        if s is not None:
            assert torch.allclose(s, (0.5 * w).pow(p).sum(0), rtol=1e-12, atol=0)


@pytest.mark.parametrize(("reduction", "splits"), [("mean", (5,)), ("sum", (2, 3))])
@pytest.mark.parametrize("chunk_size", [None, 1])
@pytest.mark.parametrize("positions", [(), (3,)], ids=["T1", "T3"])
def test_conv1d_shared_and_tied_with_linear(
    reduction: str, splits: tuple[int, ...], chunk_size: int | None, positions: tuple[int, ...]
) -> None:
    """A Conv1D used twice and a weight tied between a Conv1D and a Linear, through track."""
    register_available()
    torch.manual_seed(0)
    model = Conv1DNet(4, 6).to(D)
    x, y = torch.randn(5, *positions, 4, dtype=D), torch.randn(5, *positions, 4, dtype=D)

    def loss(out: torch.Tensor, t: Tensors) -> torch.Tensor:
        return ((out - t["y"]) ** 2 + 0.3 * out**3).flatten(1).sum(1)

    ref = per_example_oracle(model, {"x": x}, loss, {"y": y})
    with track(
        model, *QUANTITIES, moments=(3,), loss_reduction=reduction, chunk_size=chunk_size
    ) as stats:
        start = 0
        for size in splits:
            losses = loss(model(x[start : start + size]), {"y": y[start : start + size]})
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
            start += size
    assert find_rule(model.up) is conv1d_rule
    assert mismatches(stats, ref, rtol=1e-10, floor=0.0) == []


# -- registration --------------------------------------------------------------------------------


def _python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_import_gradkit_does_not_import_transformers() -> None:
    _python(
        "import sys, gradkit, gradkit.per_example\n"
        "from gradkit.per_example.rules._thirdparty import register_available\n"
        "register_available()\n"
        "assert 'transformers' not in sys.modules, 'import gradkit imported transformers'\n"
    )


def test_register_available_is_idempotent_and_keeps_a_users_rule() -> None:
    _python(
        "import transformers.pytorch_utils as pu\n"
        "from gradkit.per_example import find_rule, register_rule, Materialized\n"
        "from gradkit.per_example.rules._thirdparty import register_available, conv1d_rule\n"
        "@register_rule(pu.Conv1D)\n"
        "def mine(module, uses, ctx):\n"
        "    raise NotImplementedError\n"
        "register_available(); register_available()\n"
        "assert find_rule(pu.Conv1D(3, 2)) is mine\n"
    )


def test_rules_found_for_gpt2_and_bart_modules() -> None:
    from transformers.pytorch_utils import Conv1D

    found = {
        type(m).__name__: find_rule(m)
        for case in (MODELS["gpt2"], MODELS["bart"])
        for m in build(case).modules()
    }
    assert found["Conv1D"] is conv1d_rule
    assert found["BartScaledWordEmbedding"] is scaled_embedding_rule
    assert found["BartLearnedPositionalEmbedding"] is learned_positions_rule
    n_conv = sum(isinstance(m, Conv1D) for m in build(MODELS["gpt2"]).modules())
    assert n_conv == 8  # c_attn, c_proj, c_fc, mlp.c_proj in each of 2 blocks


# -- whole models against the oracle -------------------------------------------------------------


CASES = [
    pytest.param(c, reduction, splits, id=f"{c.id}-{reduction}-{'+'.join(map(str, splits))}")
    for c in MODELS.values()
    for reduction, splits in SPLITS
    if not (c.float32_inside and reduction == "mean" and splits == (3, 2))
]


@pytest.mark.parametrize(("case", "reduction", "splits"), CASES)
def test_matches_one_example_at_a_time(
    case: HFCase, reduction: str, splits: tuple[int, ...]
) -> None:
    n = sum(splits)
    ref = {k: g[:n] for k, g in oracle(case.id).items()}
    stats = run_tracked(case, build(case), reduction, splits)
    assert stats.num_examples == n
    assert mismatches(stats, ref, rtol=1e-10, floor=1e-4) == []


@pytest.mark.parametrize("case", MODELS.values(), ids=lambda c: c.id)
def test_float32_agrees_with_float64_oracle(case: HFCase) -> None:
    ref = {k: g[:5] for k, g in oracle(case.id).items()}
    stats = run_tracked(case, build(case, torch.float32), "sum", (3, 2))
    assert mismatches(stats, ref, rtol=1e-4, floor=1e-2) == []


@pytest.mark.parametrize("case", MODELS.values(), ids=lambda c: c.id)
def test_grad_is_untouched(case: HFCase) -> None:
    model = build(case)
    inputs, targets = case.batch(5)
    case.loss(model(**inputs), targets).mean().backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with track(model, "variance", "batch_l2", "batch_grad"):
        case.loss(model(**inputs), targets).mean().backward()
    after = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert plain.keys() == after.keys()
    assert same_grads(after, plain) == []


def t5_encoder_bias_frozen() -> nn.Module:
    """T5 with only the encoder's relative attention bias frozen (the module track names first)."""
    model = t5()
    model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.requires_grad_(False)
    return model


@pytest.mark.parametrize("build_t5", [t5, t5_encoder_bias_frozen], ids=["as_is", "enc_frozen"])
@pytest.mark.parametrize("splits", [(3, 2), (5,)], ids=["3+2", "5"])
def test_t5_relative_bias_exact_or_refused(
    build_t5: Callable[[], nn.Module], splits: tuple[int, ...]
) -> None:
    """T5's ``relative_attention_bias`` is an Embedding called on ``[q, k]`` buckets (no batch
    dimension); its output ``[q, k, heads]`` is permuted to ``[1, heads, q, k]`` and broadcast
    over the batch, so its gradient arrives summed over the examples. Tracking must refuse it,
    never return wrong statistics, also when the decoder's length (5) equals the batch size."""
    case = HFCase("t5", build_t5, seq2seq_batch, seq2seq_loss, float32_inside=True)
    inputs, targets = case.batch(sum(splits))
    ref = per_example_oracle(build(case), inputs, case.loss, targets)
    try:
        stats = run_tracked(case, build(case), "sum", splits)
    except GradkitError as err:
        assert "relative_attention_bias" in str(err)
        return
    assert mismatches(stats, ref, rtol=1e-10, floor=1e-4) == []


@pytest.mark.parametrize("case_id", ["gpt2", "llama"])
def test_gradient_checkpointing(case_id: str) -> None:
    """Activation checkpointing (the forward re-run inside the backward) changes nothing: the
    re-run layers are not counted as new uses."""
    case = MODELS[case_id]
    model = build(case)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    stats = run_tracked(case, model, "sum", (3, 2))
    ref = {k: g[:5] for k, g in oracle(case_id).items()}
    assert mismatches(stats, ref, rtol=1e-10, floor=1e-4) == []


FINAL_NORMS = {
    "gpt2": "transformer.ln_f",
    "opt": "model.decoder.final_layer_norm",
    "llama": "model.norm",
}


@pytest.mark.parametrize("case_id", sorted(FINAL_NORMS))
def test_only_the_final_norm_trained(case_id: str) -> None:
    """Everything before the final norm frozen (a fine-tuning setup): the norm's input is made
    inside the model without a graph, and HF's full slice of the hidden states before the head
    (``hidden_states[:, -0:]``, an alias) was refused as moving the rows (GPT-2)."""
    case = MODELS[case_id]
    model = build(case)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(FINAL_NORMS[case_id]))
    inputs, targets = case.batch(4)
    ref = per_example_oracle(model, inputs, case.loss, targets)
    assert ref and all(k.startswith(FINAL_NORMS[case_id]) for k in ref)
    with track(model, *QUANTITIES, moments=(3,), loss_reduction="sum") as stats:
        case.loss(model(**inputs), targets).sum().backward()
    assert mismatches(stats, ref, rtol=1e-10, floor=1e-4) == []

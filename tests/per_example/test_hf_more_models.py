"""More Hugging Face architectures, built from small configs (no download): per-example
gradients of every parameter against the one-example-at-a-time loop in float64.

A lighter check than ``test_hf_models.py`` (one quantity, one pass, ``loss_reduction="sum"``)
over families that differ in how they embed positions (learned and broadcast, rotary, a ViT's
class token and position parameter) and in their attention and normalization layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.per_example import _fused, track

transformers = pytest.importorskip("transformers")

D = torch.float64


@pytest.fixture(autouse=True)
def fuse_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """These configs are small: fuse every layer call that can be (its weight gradient summed
    from the per-example gradients), the path real-sized models take."""
    monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)


V, T, N = 40, 6, 3


def _ids() -> dict[str, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[1, 4:] = 0
    return {"input_ids": torch.randint(4, V, (N, T), generator=g), "attention_mask": mask}


def _lm_loss(out: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = out.logits[:, :-1]
    return F.cross_entropy(
        logits.transpose(1, 2), inputs["input_ids"][:, 1:], reduction="none"
    ).sum(1)


def _cls_loss(out: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    first = next(iter(inputs.values()))  # a label each example carries with it
    if first.dtype == torch.long:
        labels = first[:, 0].remainder(2)
    else:
        labels = (first.flatten(1).sum(1) > 0).long()
    return F.cross_entropy(out.logits, labels, reduction="none")


SMALL = dict(
    vocab_size=V,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
C = transformers

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, torch.Tensor]], Any]] = {
    "distilbert": (
        lambda: C.DistilBertForSequenceClassification(
            C.DistilBertConfig(
                vocab_size=V,
                dim=16,
                n_layers=2,
                n_heads=2,
                hidden_dim=32,
                max_position_embeddings=16,
                dropout=0.0,
                attention_dropout=0.0,
                seq_classif_dropout=0.0,
            )
        ),
        _ids,
        _cls_loss,
    ),
    "roberta": (
        lambda: C.RobertaForSequenceClassification(
            C.RobertaConfig(**SMALL, **NO_DROP, pad_token_id=1)
        ),
        _ids,
        _cls_loss,
    ),
    "electra": (
        lambda: C.ElectraForSequenceClassification(
            C.ElectraConfig(**SMALL, **NO_DROP, embedding_size=16)
        ),
        _ids,
        _cls_loss,
    ),
    "gpt_neo": (
        lambda: C.GPTNeoForCausalLM(
            C.GPTNeoConfig(
                vocab_size=V,
                hidden_size=16,
                num_layers=2,
                num_heads=2,
                attention_types=[[["global", "local"], 1]],
                max_position_embeddings=16,
                embed_dropout=0.0,
                attention_dropout=0.0,
                resid_dropout=0.0,
            )
        ),
        lambda: {"input_ids": _ids()["input_ids"]},
        _lm_loss,
    ),
    "gpt_neox": (lambda: C.GPTNeoXForCausalLM(C.GPTNeoXConfig(**SMALL)), _ids, _lm_loss),
    "mistral": (
        lambda: C.MistralForCausalLM(C.MistralConfig(**SMALL, num_key_value_heads=1)),
        _ids,
        _lm_loss,
    ),
    "qwen2": (
        lambda: C.Qwen2ForCausalLM(C.Qwen2Config(**SMALL, num_key_value_heads=1)),
        _ids,
        _lm_loss,
    ),
    "vit": (
        lambda: C.ViTForImageClassification(
            C.ViTConfig(
                image_size=8,
                patch_size=4,
                num_channels=3,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                num_labels=2,
                **NO_DROP,
            )
        ),
        lambda: {
            "pixel_values": torch.randn(
                N, 3, 8, 8, generator=torch.Generator(torch.get_default_device()).manual_seed(1)
            )
        },
        _cls_loss,
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_example_gradients_match_the_loop(name: str) -> None:
    build, batch, loss = MODELS[name]
    torch.manual_seed(0)
    model = build().to(D).train()
    inputs = {k: v.to(D) if v.is_floating_point() else v for k, v in batch().items()}
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {k: [] for k, _ in named}
    for i in range(N):
        one = {k: v[i : i + 1] for k, v in inputs.items()}
        grads = torch.autograd.grad(
            loss(model(**one), one).sum(), [p for _, p in named], allow_unused=True
        )
        for (k, p), g in zip(named, grads, strict=True):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        loss(model(**inputs), inputs).sum().backward()
    scale = max(float(torch.stack(r).abs().max()) for r in rows.values())
    off = []
    for k, r in rows.items():  # attention key biases have zero gradient: rounding noise only
        want, got = torch.stack(r), stats[k].batch_grad
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-10, atol=1e-12 * scale):
            off.append(k)
    assert off == []

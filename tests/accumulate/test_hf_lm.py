"""Gradient accumulation on a Hugging Face GPT-2 (small config, float64, no download): padded
sequences of unequal lengths, labels -100 on padding, four unequal micro-batches.

``Accumulator(normalize="tokens")`` gives the gradient of the full batch's token-mean loss
``(1/N_tokens) sum_{valid tokens} CE``; the recipe "mean loss of each micro-batch / k, summed"
(what the 2024 transformers gradient-accumulation bug did) weights a token of a micro-batch with
``n_j`` valid tokens by ``1/(k n_j)`` and is visibly off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.accumulate import Accumulator

transformers = pytest.importorskip("transformers")

D = torch.float64
V, T = 30, 8
LENGTHS = (8, 2, 3, 8, 7, 1, 5, 8)  # real tokens per example
MICRO = ((0, 1), (1, 4), (4, 6), (6, 8))  # 1, 3, 2 and 2 examples: 7, 18, 7 and 12 targets


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(D).train()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(3, V, (len(LENGTHS), T), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def token_losses(model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The summed cross entropy of every valid target (token ``s`` predicts ``s+1``, as the
    model's own ``labels=`` loss shifts) and their number, computed in the model's dtype."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    labels = b["labels"][:, 1:]
    total = F.cross_entropy(
        logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="sum"
    )
    return total, int((labels != -100).sum())


def rows(b: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in b.items()}


class Capture(torch.optim.SGD):
    """SGD with lr=0 that records the gradients it is asked to apply."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.0)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def full_batch_grads(model: nn.Module, b: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    total, count = token_losses(model, b)
    (total / count).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - w).reshape(-1) for g, w in zip(got, want, strict=True)])
    ref = torch.cat([w.reshape(-1) for w in want])
    return float(diff.norm() / ref.norm())


def test_own_loss_is_the_models_labels_loss() -> None:
    """The summed token loss divided by the count is the model's own ``labels=`` loss (which
    computes in float32, hence the tolerance)."""
    model, b = gpt2(), batch()
    total, count = token_losses(model, b)
    assert count == sum(n - 1 for n in LENGTHS)
    own = model(**b).loss
    torch.testing.assert_close(total / count, own.to(D), rtol=1e-6, atol=0)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_tokens_normalization_gives_the_full_batch_gradient(skip_nonfinite: bool) -> None:
    """With and without the inf/NaN check (which changes how ``step`` divides by the count)."""
    model, b = gpt2(), batch()
    want = full_batch_grads(model, b)
    opt = Capture(model.parameters())
    acc = Accumulator(model, opt, normalize="tokens", skip_nonfinite=skip_nonfinite)
    counts = []
    for start, stop in MICRO:
        micro = rows(b, start, stop)
        count = int((micro["labels"][:, 1:] != -100).sum())
        counts.append(count)
        with acc.micro_step(count=count):
            total, _ = token_losses(model, micro)
            acc.backward(total)  # a SUM over the micro-batch's valid tokens
    result = acc.step()
    assert len(set(counts)) > 2  # the micro-batches hold very different numbers of tokens
    assert result.stepped and result.micro_steps == 4 and result.count == sum(counts)
    got = opt.seen[0]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9 * float(w.abs().max()) + 1e-300)
    assert relative_error(got, want) < 1e-9


def test_mean_per_micro_batch_over_k_is_not_the_full_batch_gradient() -> None:
    """The recipe of the 2024 gradient-accumulation bug: each micro-batch's token mean / k."""
    model, b = gpt2(), batch()
    want = full_batch_grads(model, b)
    for start, stop in MICRO:
        total, count = token_losses(model, rows(b, start, stop))
        (total / count / len(MICRO)).backward()
    naive = [p.grad.clone() for p in model.parameters()]
    assert relative_error(naive, want) > 1e-3

"""A layer called on a tensor of batch size 1 has its output expanded to the model's examples
(``_batch``'s "broadcast" calls): exact where the model broadcasts that output over its
examples, and refused wherever the model takes it through anything else.

Found by a probe: a learned ``[1, d]`` query projected by a tracked Linear and scored against
the examples by ``h @ q.T`` gave ``[N, N]`` scores instead of ``[N, 1]`` inside ``track()`` and
put all of the Linear's per-example gradient on example 0, silently; only indexing and
reductions along the batch were refused, and a reduction along dimension -1 of a 3-D output was
taken for one along the batch (torch keeps -1 as 2**64 - 1, and 2**64 - 1 = 0 mod 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64
N, DIM, K = 4, 6, 3


class Anchored(nn.Module):
    """A Linear on a fixed ``[1, d]`` anchor, combined with the examples' features by
    ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.enc = nn.Linear(DIM, K)
        self.q_proj = nn.Linear(DIM, K)
        self.norm = nn.LayerNorm(K)
        self.register_buffer("anchor", torch.linspace(-1.0, 1.0, DIM)[None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))  # [N, K]
        q = self.q_proj(self.anchor)  # [1, K]: expanded to [N, K] inside track()
        n = x.shape[0]
        if self.how == "matmul_transposed":
            return (h @ q.T)[:, 0]
        if self.how == "einsum":
            return torch.einsum("nk,jk->nj", h, q)[:, 0]
        if self.how == "softmax_over_batch":
            return (h * q.softmax(0)).sum(-1)
        if self.how == "norm_over_batch":
            return h.sum(-1) * q.norm(dim=0).sum()
        if self.how == "linear_as_weight":
            return nn.functional.linear(h, q)[:, 0]
        # the broadcasting uses, exact
        if self.how == "product":
            return (h * q).sum(-1)
        if self.how == "negative_dims":  # reductions and a softmax along the last dimension
            return (h + q.softmax(-1)).amax(-1) + q.unsqueeze(-1).sum((-1, -2))
        if self.how == "positions_last_dim":  # [1, 2, K] summed along dim -1 (= 2, not 0)
            q3 = self.q_proj(self.anchor[:, None].expand(1, 2, DIM))
            return h.sum(-1) * q3.sum(-1).prod(-1)
        if self.how == "concatenated":
            rows = torch.cat([q.expand(n, -1)[:, None], h[:, None]], dim=1)  # [N, 2, K]
            return rows.view(n, -1).square().sum(-1)
        if self.how == "normalized":  # a tracked layer on the expanded rows
            return (self.norm(q) * h).sum(-1)
        if self.how == "chunked_features":  # FiLM: a scale and a shift split along features
            scale, shift = self.q_proj(self.anchor).repeat(1, 2).chunk(2, -1)
            return (h * scale + shift).sum(-1)
        if self.how == "split_unbound":  # pieces by split(sizes), then unbind of a later dim
            first, rest = q.split([1, K - 1], -1)
            return h[:, 0] * first[:, 0] + sum(r for r in rest.unbind(1))
        if self.how == "transposed_queries":  # [1, 2, K] queries, transposed into a product
            q3 = self.q_proj(self.anchor[:, None].expand(1, 2, DIM))
            return (h[:, None] @ q3.transpose(1, 2)).sum((1, 2))
        if self.how == "permuted_queries":
            q3 = self.q_proj(self.anchor[:, None].expand(1, 2, DIM))
            return (h[:, None] @ q3.permute(0, 2, 1)).sum((1, 2))
        if self.how == "transpose_across_batch":  # the examples' dimension swapped: refused
            q3 = self.q_proj(self.anchor[:, None].expand(1, 2, DIM))
            return h.sum(-1) * q3.transpose(0, 1).reshape(2, -1)[0, :1].sum()
        raise AssertionError(self.how)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    return torch.randn(N, DIM, dtype=D, generator=gen), torch.randn(N, dtype=D, generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


@pytest.mark.parametrize(
    "how",
    [
        "matmul_transposed",
        "einsum",
        "softmax_over_batch",
        "norm_over_batch",
        "linear_as_weight",
        "transpose_across_batch",
    ],
)
def test_an_expanded_output_taken_across_the_examples_is_refused(how: str) -> None:
    torch.manual_seed(0)
    model = Anchored(how).to(D)
    x, y = _batch()
    with (
        pytest.raises(GradkitError, match=r"q_proj \(Linear\).*does not keep the examples apart"),
        track(model, "variance", loss_reduction="sum"),
    ):
        _loss(model(x), y).backward()


@pytest.mark.parametrize(
    "how",
    [
        "product",
        "negative_dims",
        "positions_last_dim",
        "concatenated",
        "normalized",
        "chunked_features",
        "split_unbound",
        "transposed_queries",
        "permuted_queries",
    ],
)
def test_an_expanded_output_that_is_broadcast_is_exact(how: str) -> None:
    torch.manual_seed(0)
    model = Anchored(how).to(D)
    x, y = _batch()
    want = per_example_grads(model, _loss, x, y)
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        _loss(model(x), y).backward()
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)


class Latents(nn.Module):
    """Learned latents ``[1, L, d]`` (a module of their own, so expanded by the tracker)."""

    def __init__(self) -> None:
        super().__init__()
        self.lat = nn.Parameter(torch.linspace(-1.0, 1.0, 3 * 8).reshape(1, 3, 8))

    def forward(self) -> torch.Tensor:
        return self.lat


class CrossAttends(nn.Module):
    """Latent queries attending to each example's features through ``nn.MultiheadAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.latents = Latents()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.inp(x)
        q = self.latents().expand(x.shape[0], -1, -1)
        return self.head(self.mha(q, f, f)[0]).mean(1)


def test_expanded_latents_through_a_fallback_module_are_exact() -> None:
    """The consumer walk steps over a tracked call: the transposes inside torch's attention
    were taken for the model's own (a false refusal)."""
    torch.manual_seed(0)
    model = CrossAttends().to(D)
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    x = torch.randn(N, 6, 5, dtype=D, generator=gen)
    y = torch.randn(N, 2, dtype=D, generator=gen)
    want = per_example_grads(model, _loss, x, y)
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        _loss(model(x), y).backward()
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-9, atol=1e-12)

"""``nn.Embedding``: per-example gradients without a ``[N, V, d]`` tensor.

Example ``n`` looks up rows ``idx[n, t]``; its gradient is ``g_n[v] = sum_{t: idx[n,t]=v} G[n, t]``
(repeated indices within one example are summed before any power; ``padding_idx`` rows get no
gradient, as in PyTorch). The nonzero rows of all examples are formed once by summing over equal
``(n, v)`` pairs (:func:`sum_by_key`, which never waits for the device); powers and norms then
cost ``O(#lookups * d)``.

``max_norm`` is exact: the forward renormalizes the rows it looks up in place, under no_grad,
before the lookup; a row's renormalization depends on that row only and leaves it within
``max_norm``, so the rows example ``n`` sees are the same whether it runs alone or in a batch,
and the lookup's gradient does not depend on the weight. ``scale_grad_by_freq`` is refused (a
:class:`~gradkit.GradkitError` says why): the batch gradient divides each row by its count in
the whole batch, so it is no sum of per-example gradients.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from gradkit._errors import GradkitError, message
from gradkit.per_example._grads import PerExampleGrad, powered
from gradkit.per_example._registry import RuleContext, Use, register_rule
from gradkit.per_example._stats import statistics_dtype


def sum_by_key(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of ``values`` (``[M, d]``) that have equal ``keys`` (``[M]``, int64).

    Returns ``(key, summed)``, both of length ``M``: the first ``U`` entries hold the distinct
    keys in ascending order and their sums, the other ``M - U`` hold key 0 and zero rows, which
    add nothing to any power sum, norm or scatter. Unlike ``torch.unique``, whose output size
    depends on the data (so it waits for the device to finish and reads it), every size here
    follows from ``M``: nothing synchronizes with the host.
    """
    sorted_keys, order = torch.sort(keys, stable=True)
    new = torch.ones_like(sorted_keys, dtype=torch.bool)
    new[1:] = sorted_keys[1:] != sorted_keys[:-1]
    segment = torch.cumsum(new, 0) - 1
    summed = values.new_zeros(values.shape).index_add_(0, segment, values[order])
    key = torch.zeros_like(sorted_keys).scatter_(0, segment, sorted_keys)
    return key, summed


class EmbeddingGrad(PerExampleGrad):
    """Per-example embedding gradients as sparse rows ``(example, row, value)``.

    ``tokens`` keeps the lookups ``(idx [N, S], grads [N, S, d])`` they were summed from (for the
    norms of a weight tied to an output layer), None where they are not kept.
    """

    tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, idx: torch.Tensor, grads: torch.Tensor, num_rows: int) -> None:
        self.tokens = (idx, grads)
        n, _, d = grads.shape
        self.num_examples, self.shape = n, torch.Size((num_rows, d))
        keys = idx + torch.arange(n, device=idx.device)[:, None] * num_rows  # [N, T]
        key, self.rows = sum_by_key(keys.reshape(-1), grads.reshape(-1, d))
        self.example = key // num_rows
        self.row = key % num_rows

    sums_into = True

    def power_sum(
        self, p: int, scale: float = 1.0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        vals, alpha = powered(self.rows, p, scale)
        if out is None or out.dtype != vals.dtype:
            out = vals.new_zeros(self.shape)
        else:
            out.zero_()
        return out.index_add_(0, self.row, vals, alpha=alpha)

    def sq_norms(self) -> torch.Tensor:
        return self.rows.new_zeros(self.num_examples).index_add_(
            0, self.example, self.rows.square().sum(1)
        )

    def scatter_into(self, block: torch.Tensor, start: int, stop: int) -> None:
        """Add examples ``start..stop`` into ``block`` (``[stop - start, *shape]``), in place."""
        # every row, those of other examples as zeros: a boolean selection would wait for the
        # device to learn how many rows it keeps
        example = self.example - start
        inside = ((example >= 0) & (example < stop - start))[:, None]
        rows = torch.where(inside, self.rows, 0).to(block.dtype)
        index = (example.clamp(0, stop - start - 1), self.row)
        block.index_put_(index, rows, accumulate=True)

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        for start in range(0, self.num_examples, size):
            stop = min(start + size, self.num_examples)
            block = self.rows.new_zeros(stop - start, *self.shape)
            self.scatter_into(block, start, stop)
            yield block


@register_rule(nn.Embedding)
def embedding_rule(
    module: nn.Module, uses: list[Use], ctx: RuleContext
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``nn.Embedding`` (see the module docstring)."""
    assert isinstance(module, nn.Embedding)
    if module.scale_grad_by_freq:
        raise GradkitError(
            message(
                "per_example.track(model, ...)",
                f"Embedding({module.num_embeddings}, {module.embedding_dim}).scale_grad_by_freq",
                "False (it divides each row's gradient by the row's count in the whole batch, "
                "so an example's gradient depends on the other examples and the batch gradient "
                "is no sum of per-example gradients)",
                "True",
                "construct the Embedding with scale_grad_by_freq=False",
            )
        )
    n = uses[0].grad_output.shape[0]
    d = module.embedding_dim
    idx = torch.cat([u.inputs[0].reshape(n, -1) for u in uses], 1)
    g = torch.cat([u.grad_output.reshape(n, -1, d) for u in uses], 1)
    g = g.to(statistics_dtype(g.dtype))
    if module.padding_idx is not None:
        g = g.masked_fill((idx == module.padding_idx)[..., None], 0.0)
    return {"weight": EmbeddingGrad(idx, g, module.num_embeddings)}

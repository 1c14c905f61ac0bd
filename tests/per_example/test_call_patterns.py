"""Less common ways of calling tracked layers, found by probing: a normalization layer shared
by inputs of different ranks, and a forward hook put before the tracker's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64


class SharedNorm(nn.Module):
    """One normalization layer called on ``[N, C, ...]`` and on a higher-rank view of it."""

    def __init__(self, norm: nn.Module, channels_first: bool) -> None:
        super().__init__()
        self.norm = norm
        self.channels_first = channels_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 6]
        once = self.norm(x).sum(-1)
        more = x.unsqueeze(-1 if self.channels_first else 1).repeat(
            (1, 1, 3) if self.channels_first else (1, 2, 1)
        )
        twice = self.norm(torch.tanh(more)).sum((1, 2))
        return once * twice


def _norms() -> list[tuple[nn.Module, bool]]:
    layers = [(nn.LayerNorm(6), False), (nn.GroupNorm(2, 6), True)]
    if hasattr(nn, "RMSNorm"):
        layers.append((nn.RMSNorm(6), False))
    return layers


@pytest.mark.parametrize("index", range(len(_norms())))
def test_a_normalization_shared_by_inputs_of_different_ranks(index: int) -> None:
    """Its rule summed every use over the first use's positions: torch's bare ``stack expects
    each tensor to be equal size``."""
    torch.manual_seed(0)
    norm, channels_first = _norms()[index]
    model = SharedNorm(norm, channels_first).to(D)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) / 4)  # away from the initial ones and zeros
    x, y = torch.randn(5, 6, dtype=D), torch.randn(5, dtype=D)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).sum()

    want = per_example_grads(model, loss, x, y)
    with track(model, "batch_grad", "variance", loss_reduction="sum") as stats:
        loss(model(x), y).backward()
    for name, g in want.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-8, atol=1e-12)


def test_a_hook_prepended_inside_the_block_is_refused() -> None:
    """Registered with ``prepend=True`` inside the block, a hook returning ``2 * output`` ran
    before the tracker's, which read its output for the layer's: per-example gradients half
    what they are, silently."""
    layer = nn.Linear(3, 2).to(D)
    x = torch.randn(4, 3, dtype=D)
    with track(layer, "batch_grad") as stats:
        handle = layer.register_forward_hook(lambda m, i, o: o * 2, prepend=True)
        with pytest.raises(GradkitError, match=r"forward hooks of model \(Linear\).*prepend=True"):
            layer(x)
        handle.remove()
        layer(x).sum().backward()  # the tracker's hook is first again
    assert stats["bias"].batch_grad.shape == (4, 2)


def test_a_hook_registered_before_the_block_runs_after_the_tracker() -> None:
    """The tracker's hook goes first: a hook registered before ``track()`` may replace the
    output, and the statistics are those of the model with the hook, as the oracle sees it."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).to(D)
    layer.register_forward_hook(lambda m, i, o: o * 2, prepend=True)
    x = torch.randn(4, 3, dtype=D)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    want = per_example_grads(layer, loss, x, torch.zeros(4, dtype=D))
    with track(layer, "batch_grad", loss_reduction="sum") as stats:
        loss(layer(x), None).backward()
    assert_close(stats["bias"].batch_grad, want["bias"], rtol=1e-10, atol=1e-12)


def test_a_pre_hook_on_a_fallback_module_is_named_when_its_reruns_differ() -> None:
    """The fallback re-runs the module with the inputs its pre-hook already changed, so the
    hook runs twice: refused (it was), and now the refusal names that cause too."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(5, 5, batch_first=True)
            self.head = nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.gru(x)[0].mean(1))

    torch.manual_seed(0)
    model = Recurrent().to(D)
    model.gru.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with track(model, "variance") as stats:
        model(torch.randn(3, 4, 5, dtype=D)).pow(2).sum().backward()
    with pytest.raises(GradkitError, match=r"gru \(GRU\).*a forward pre-hook on it changes"):
        _ = stats["head.weight"].variance


def test_the_refusal_names_the_argument_the_examples_are_counted_in() -> None:
    """``N`` is read from the model's first tensor argument; a shared ``[1, k]`` scale passed
    first was refused with advice about ``batch_dim`` only."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * scale

    model = Scaled()
    scale, x = torch.tensor([[1.5, 0.5]]), torch.randn(5, 3)
    with (
        pytest.raises(GradkitError, match=r"first tensor argument, of shape \(1, 2\).*first"),
        track(model, "variance"),
    ):
        model(scale, x).sum().backward()


def test_a_model_cast_inside_the_block_before_its_first_backward() -> None:
    """``model.double()`` inside the block: the statistics were kept in float32, 3e-8 off the
    float64 per-example gradients, silently; they take the new precision now."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(6, 4, dtype=D)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    want = per_example_grads(layer.double(), loss, x, torch.zeros(6, dtype=D))
    layer.float()
    with track(layer, "variance", "batch_grad", loss_reduction="sum") as stats:
        layer.double()
        loss(layer(x), None).backward()
    assert stats["weight"].variance.dtype == D
    assert_close(stats["weight"].batch_grad, want["weight"], rtol=1e-12, atol=0)
    assert_close(
        stats["weight"].variance, want["weight"].var(0, unbiased=False), rtol=1e-10, atol=0
    )


def test_a_cast_after_statistics_began_is_refused() -> None:
    layer = nn.Linear(4, 3)
    with track(layer, "variance") as stats:
        layer(torch.randn(5, 4)).sum().backward()
        layer.double()
        with pytest.raises(GradkitError, match=r"parameter 'weight'.*torch.float32.*cast"):
            layer(torch.randn(5, 4, dtype=D))
        layer.float()
    assert stats["weight"].variance.dtype == torch.float32

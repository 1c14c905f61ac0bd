"""The settings table shared by the per-example tests and benchmarks:
``{id, module_fn, input_fn, loss_fn}`` where ``loss_fn(output, target) -> [N]`` gives the
per-example losses ``l_i``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

D = torch.float64


@dataclass
class Setting:
    id: str
    module_fn: Callable[[], nn.Module]
    input_fn: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).flatten(1).sum(1) * 0.5


def cubic_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # asymmetric in the output so odd moments are not trivially symmetric
    return (out * y + 0.3 * out**3).flatten(1).sum(1)


def ce_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def xy(x_shape: tuple[int, ...], y_shape: tuple[int, ...]):
    def make(n: int, g: torch.Generator):
        return (
            torch.randn((n, *x_shape), generator=g, dtype=D),
            torch.randn((n, *y_shape), generator=g, dtype=D),
        )

    return make


def tokens(vocab: int, length: int, d_out: int):
    def make(n: int, g: torch.Generator):
        idx = torch.randint(0, vocab, (n, length), generator=g)
        idx[:, 0] = idx[:, 1]  # a repeated index within each example
        if length > 3:
            idx[:, 3] = 0  # padding_idx
        return idx, torch.randn((n, length, d_out), generator=g, dtype=D)

    return make


def classes(x_shape: tuple[int, ...], k: int):
    def make(n: int, g: torch.Generator):
        return (
            torch.randn((n, *x_shape), generator=g, dtype=D),
            torch.randint(0, k, (n,), generator=g),
        )

    return make


class Twice(nn.Module):
    """A layer used twice in one forward (recurrent use / weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Tied(nn.Module):
    """One parameter shared by an Embedding and the output Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.out = nn.Linear(3, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(idx)))


class ScaleShift(nn.Module):
    """A module without a rule: goes through the vmap fallback."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.shift = nn.Parameter(torch.zeros(d) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * self.scale) + self.shift * x.pow(2)


class Recurrent(nn.Module):
    """An RNN/GRU/LSTM (output and state: several outputs, no batching rule) with a head."""

    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = kind(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Attention(nn.Module):
    """MultiheadAttention: uses its out_proj parameters without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def batch_norm_eval(kind: type[nn.Module], channels: int) -> Callable[[], nn.Module]:
    """A BatchNorm in eval mode with running statistics far from (0, 1) and affine
    parameters that are not (1, 0)."""

    def make() -> nn.Module:
        bn = kind(channels)
        with torch.no_grad():
            bn.running_mean.copy_(torch.linspace(-0.7, 0.9, channels))
            bn.running_var.copy_(torch.linspace(0.3, 2.5, channels))
            bn.weight.copy_(torch.linspace(0.5, 1.5, channels))
            bn.bias.copy_(torch.linspace(-0.2, 0.4, channels))
        return bn.eval()

    return make


def seq(*mods: nn.Module) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(*mods)


SETTINGS = [
    Setting("linear2d", lambda: nn.Linear(5, 3), xy((5,), (3,)), cubic_loss),
    Setting("linear2d_nobias", lambda: nn.Linear(5, 3, bias=False), xy((5,), (3,)), sq_loss),
    Setting("linear3d", lambda: nn.Linear(4, 3), xy((6, 4), (6, 3)), cubic_loss),
    Setting("linear4d", lambda: nn.Linear(3, 2), xy((2, 3, 3), (2, 3, 2)), sq_loss),
    Setting(
        "mlp_inplace_relu",
        lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)),
        classes((6,), 4),
        ce_loss,
    ),
    Setting(
        "conv1d_stride_pad",
        lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1),
        xy((3, 9), (4, 5)),
        cubic_loss,
    ),
    Setting(
        "conv2d_dilation_groups",
        lambda: nn.Conv2d(4, 6, 3, dilation=2, groups=2, padding=2),
        xy((4, 7, 6), (6, 7, 6)),
        cubic_loss,
    ),
    Setting(
        "conv2d_same_even_kernel",
        lambda: nn.Conv2d(2, 3, (2, 4), padding="same"),
        xy((2, 5, 6), (3, 5, 6)),
        sq_loss,
    ),
    Setting(
        "conv2d_reflect_stride",
        lambda: nn.Conv2d(2, 3, 3, stride=(2, 1), padding=1, padding_mode="reflect"),
        xy((2, 6, 5), (3, 3, 5)),
        cubic_loss,
    ),
    Setting("conv2d_1x1_output", lambda: nn.Conv2d(2, 3, 4), xy((2, 4, 4), (3, 1, 1)), cubic_loss),
    Setting(
        "conv3d",
        lambda: nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1)),
        xy((2, 3, 5, 3), (3, 4, 2, 4)),
        cubic_loss,
    ),
    Setting(
        "embedding_padding_repeats",
        lambda: nn.Embedding(6, 3, padding_idx=0),
        tokens(6, 5, 3),
        cubic_loss,
    ),
    Setting("layernorm", lambda: nn.LayerNorm((3, 4)), xy((2, 3, 4), (2, 3, 4)), cubic_loss),
    Setting("groupnorm", lambda: nn.GroupNorm(2, 4), xy((4, 3, 2), (4, 3, 2)), cubic_loss),
    Setting(
        "instancenorm_fallback",
        lambda: nn.InstanceNorm1d(3, affine=True),
        xy((3, 5), (3, 5)),
        cubic_loss,
    ),
    Setting("batchnorm1d_eval", batch_norm_eval(nn.BatchNorm1d, 3), xy((3,), (3,)), cubic_loss),
    Setting(
        "batchnorm1d_eval_sequence",
        batch_norm_eval(nn.BatchNorm1d, 3),
        xy((3, 4), (3, 4)),
        cubic_loss,
    ),
    Setting(
        "batchnorm2d_eval", batch_norm_eval(nn.BatchNorm2d, 3), xy((3, 2, 4), (3, 2, 4)), cubic_loss
    ),
    Setting(
        "batchnorm3d_eval",
        batch_norm_eval(nn.BatchNorm3d, 2),
        xy((2, 2, 3, 2), (2, 2, 3, 2)),
        cubic_loss,
    ),
    Setting(
        "convtranspose_fallback",
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2),
        xy((2, 3, 3), (3, 7, 7)),
        sq_loss,
    ),
    Setting("custom_fallback", lambda: ScaleShift(4), xy((4,), (4,)), cubic_loss),
    Setting("module_used_twice", Twice, xy((4,), (4,)), cubic_loss),
    Setting(
        "tied_embedding_output",
        Tied,
        lambda n, g: (
            torch.randint(0, 7, (n, 3), generator=g),
            torch.randint(0, 7, (n,), generator=g),
        ),
        lambda out, y: (
            nn.functional.cross_entropy(out[:, -1], y, reduction="none")
            + 0.1 * out.pow(2).sum((1, 2))
        ),
    ),
]
SETTINGS += [
    Setting("rnn", lambda: Recurrent(nn.RNN), xy((5, 3), (2,)), cubic_loss),
    Setting("gru", lambda: Recurrent(nn.GRU), xy((4, 3), (2,)), cubic_loss),
    Setting("lstm", lambda: Recurrent(nn.LSTM), xy((4, 3), (2,)), cubic_loss),
    Setting("multihead_attention", Attention, xy((3, 4), (3, 4)), cubic_loss),
]
if hasattr(nn, "RMSNorm"):
    SETTINGS.append(Setting("rmsnorm", lambda: nn.RMSNorm(4), xy((3, 4), (3, 4)), cubic_loss))

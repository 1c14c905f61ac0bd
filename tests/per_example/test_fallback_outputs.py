"""A module under the vmap fallback that returns, beside its result, tensors the result was
computed from (Hugging Face's CLIPModel returns its towers' outputs next to the embeddings it
projects from them; a Whisper classifier with a weighted layer sum, every layer's hidden state).

The gradient hooked on such an intermediate output included the path through the result, and
the fallback, re-running the module with every output's gradient, counted that path again: the
per-example gradients of the layers inside were 2x and 3x the oracle's, silently (their sum 3x
``p.grad``). Each output is now hooked through a view of its own, whose gradient is only what
reaches it from outside the module.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.per_example import track

D = torch.float64


class Chained(nn.Module):
    """A parameter of its own (so no rule: the fallback), and outputs computed one from another."""

    def __init__(self, returns: tuple[str, ...]) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))
        self.enc, self.proj = nn.Linear(4, 4), nn.Linear(4, 3)
        self.returns = returns

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.enc(x)
        p = self.proj(torch.tanh(h))
        e = p / p.norm(dim=-1, keepdim=True)
        outputs = {"e": e, "p": p, "h": h, "scaled": self.s * e}
        return {k: outputs[k] for k in self.returns}


def _losses(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    total = (out["scaled"] * target).sum(1)
    if "h" in out:  # the loss may read an intermediate output too
        total = total + out["h"].pow(2).sum(1)
    return total


def _oracle(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, _ in model.named_parameters()]
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(
            _losses(model(x[i : i + 1]), target[i : i + 1]).sum(), list(model.parameters())
        )
        for n, g in zip(names, grads, strict=True):
            rows[n].append(g)
    return {n: torch.stack(r) for n, r in rows.items()}


@pytest.mark.parametrize(
    "returns", [("e", "scaled"), ("e", "p", "scaled"), ("e", "p", "h", "scaled")]
)
def test_intermediate_outputs_are_not_counted_twice(returns: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    model = Chained(returns).double()
    x, target = torch.randn(3, 4, dtype=D), torch.randn(3, 3, dtype=D)
    want = _oracle(model, x, target)
    untracked = torch.autograd.grad(_losses(model(x), target).sum(), list(model.parameters()))
    with track(model, "batch_grad", "variance", loss_reduction="sum") as stats:
        _losses(model(x), target).sum().backward()
    for (name, g), grad in zip(want.items(), untracked, strict=True):
        torch.testing.assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(stats[name].variance, g.var(0, unbiased=False))
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=0, atol=0)


def test_clip_both_towers_with_a_per_example_loss() -> None:
    transformers = pytest.importorskip("transformers")
    n, length = 3, 6
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    ids = torch.randint(3, 40, (n, length), generator=g)
    ids[:, -1] = 2
    pixels = torch.randn(n, 3, 16, 16, dtype=D, generator=g)
    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16, attention_dropout=0.0,
                dropout=0.0, eos_token_id=2, bos_token_id=1, pad_token_id=0)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=4, attention_dropout=0.0,
                  dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    model = transformers.CLIPModel(config).double()

    def losses(ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, pixel_values=pixels)
        return -F.cosine_similarity(out.image_embeds, out.text_embeds, dim=1)

    names = [k for k, _ in model.named_parameters()]
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for i in range(n):
        grads = torch.autograd.grad(
            losses(ids[i : i + 1], pixels[i : i + 1]).sum(),
            list(model.parameters()),
            allow_unused=True,
        )
        for k, p, grad in zip(names, model.parameters(), grads, strict=True):
            rows[k].append(torch.zeros_like(p) if grad is None else grad)
    with track(model, "batch_grad") as stats:
        losses(ids, pixels).mean().backward()
    for k in ("text_model.encoder.layers.0.mlp.fc1.weight", "visual_projection.weight"):
        torch.testing.assert_close(stats[k].batch_grad, torch.stack(rows[k]), rtol=1e-9, atol=0)


class Pairwise(nn.Module):
    """A parameter of its own and an output pairing examples: ``[N, N]`` similarities."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.a(x) @ self.b(x).T


def test_an_output_pairing_examples_is_refused_naming_the_fix() -> None:
    """The per-example loss on the diagonal of [N, N] similarities raised torch's bare
    "Mismatch in shape" from inside the fallback's re-run (CLIPModel's logits_per_image)."""
    torch.manual_seed(0)
    model = Pairwise().double()
    with pytest.raises(GradkitError) as raised, track(model, "variance"):
        model(torch.randn(3, 4, dtype=D)).diagonal().sum().backward()
    text = str(raised.value)
    for words in ("vmap fallback on Pairwise", "(1, 3) per example", "(1, 1) from one example",
                  "freeze Pairwise's own parameters (scale)"):  # fmt: skip
        assert words in text, text
    model.scale.requires_grad_(False)  # the layers inside, by their rules: exact
    x = torch.randn(3, 4, dtype=D)
    rows = [
        torch.autograd.grad(model(x)[i, i], [model.a.weight])[0] for i in range(3)
    ]  # example i's loss reads only example i
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        model(x).diagonal().sum().backward()
    torch.testing.assert_close(stats["a.weight"].batch_grad, torch.stack(rows))


class TwoOutputs(nn.Module):
    """The fallback's module (a parameter of its own), returning its loss or two outputs."""

    def __init__(self, with_loss: bool) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(3, 2)
        self.with_loss = with_loss

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.s * self.lin(x)
        return (z.pow(2).sum(), z) if self.with_loss else (z, torch.tanh(z))


def test_a_loss_the_module_returns_is_refused_at_its_own_backward() -> None:
    """``out.loss.backward()`` from a loss the fallback's module computed: the backward's root
    is that output, which torch's all-gradients hook never counted, so nothing was recorded
    and reading said no backward pass had reached the model. Refused now, saying why."""
    torch.manual_seed(0)
    model = TwoOutputs(with_loss=True).double()
    with pytest.raises(GradkitError) as raised, track(model, "variance"):
        model(torch.randn(4, 3, dtype=D))[0].backward()
    text = str(raised.value)
    assert "output 0 of TwoOutputs" in text and "compute the loss outside the module" in text


def test_a_backward_from_an_output_itself_is_tracked() -> None:
    """``out[0].backward(gradient)``: the root is one of the module's outputs."""
    torch.manual_seed(0)
    model = TwoOutputs(with_loss=False).double()
    x, w = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    rows = [
        torch.autograd.grad(model(x[i : i + 1])[0], [model.lin.weight], w[i : i + 1])[0]
        for i in range(4)
    ]
    with track(model, "batch_grad", loss_reduction="sum") as stats:
        model(x)[0].backward(w)
    torch.testing.assert_close(stats["lin.weight"].batch_grad, torch.stack(rows))


def test_running_statistics_updated_once_per_step() -> None:
    """InstanceNorm(track_running_stats=True) in training mode goes through the fallback, whose
    re-runs updated the running statistics again (once per example): after a tracked step they
    were not an untracked step's (running_mean -0.231 for -0.050), silently."""
    import copy

    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    ).double()
    x, y = torch.randn(5, 2, 6, dtype=D), torch.randn(5, 3, 5, dtype=D)
    plain, tracked = copy.deepcopy(base), copy.deepcopy(base)
    (plain(x) * y).sum((1, 2)).mean().backward()
    rows = []
    for i in range(5):
        one = copy.deepcopy(base)
        (one(x[i : i + 1]) * y[i : i + 1]).sum().backward()
        rows.append(one[1].weight.grad)
    with track(tracked, "variance", "batch_grad") as stats:
        (tracked(x) * y).sum((1, 2)).mean().backward()
    torch.testing.assert_close(stats["1.weight"].batch_grad, torch.stack(rows))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(tracked[1], name), getattr(plain[1], name)), name


class StateArgument(nn.Module):
    """A parameter of its own (the fallback) and an LSTM state [layers, N, H] as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.h0 = nn.Parameter(torch.zeros(2, 1, 4))
        self.rnn = nn.LSTM(3, 4, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        h0 = self.h0.expand(-1, x.shape[0], -1).contiguous()
        return self.rnn(x, (h0, c0))[0]


def test_a_re_run_that_fails_is_refused_naming_the_module_and_fixes() -> None:
    """Split along dimension 0, the state [layers, N, H] gave torch's "Expected hidden[1] size"
    from inside the backward, naming neither the module nor what to do."""
    torch.manual_seed(0)
    model = StateArgument().double()
    x, c0 = torch.randn(5, 4, 3, dtype=D), torch.zeros(2, 5, 4, dtype=D)
    with pytest.raises(GradkitError) as raised, track(model, "variance"):
        model(x, c0).sum().backward()
    text = str(raised.value)
    for words in ("a re-run of StateArgument on one example", "Expected hidden[1] size",
                  "pass batch_dim={its name: d}", "register a rule"):  # fmt: skip
        assert words in text, text


@pytest.mark.parametrize("kind", ["rnn_dropout", "dropout_layer", "vmapped"])
def test_a_random_forward_the_loop_re_runs_is_refused_naming_its_dropout(kind: str) -> None:
    """An RNN (no vmap batching rule on the CPU: re-run in a loop) with dropout between its
    layers in training mode drew other masks on each re-run: reading raised that the re-runs did
    not reproduce the batch's output, without the cause. It is refused naming the dropout; in eval
    mode the same model is tracked. Where vmap batches the module (``vmapped``; CUDA's RNN
    kernels too) its refusal of randomness names the dropout as well."""
    torch.manual_seed(0)

    class WithDropout(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers = 2 if kind == "rnn_dropout" else 1
            self.rnn = (
                nn.Sequential(nn.Linear(4, 5), nn.Tanh())  # batched by vmap: no loop
                if kind == "vmapped"
                else nn.GRU(4, 5, num_layers=layers, dropout=0.5 if layers > 1 else 0.0)
            )
            self.drop = nn.Dropout(0.0 if kind == "rnn_dropout" else 0.3)
            self.scale = nn.Parameter(torch.ones(5))  # its own: re-run whole by the fallback

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.rnn(x.transpose(0, 1))
            h = h if kind == "vmapped" else h[0]
            return self.drop(h * self.scale).transpose(0, 1)

    model = nn.Sequential(WithDropout(), nn.Flatten(), nn.Linear(15, 1)).double().train()
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    want = "dropout=0.5 between its layers" if kind == "rnn_dropout" else r"Dropout\(p=0.3\)"
    with pytest.raises(GradkitError, match=want), track(model, "variance"):
        model(x).pow(2).sum().backward()
    model.eval()
    # cuDNN's RNN has no backward in eval mode (torch raises, tracked or not): its native kernel
    with torch.backends.cudnn.flags(enabled=False), track(model, "variance") as stats:
        model(x).pow(2).sum().backward()
    assert stats.num_examples == 4


class _TwoLayouts(nn.Module):
    """Outputs ``[N, T, H]`` and a ``[1, N, H]`` state (as Opacus's ``DPLSTM`` returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))  # its own: read by the vmap fallback

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(F.linear(x, self.weight))
        return h, h[:, -1].unsqueeze(0)


class _UsesTwoLayouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = _TwoLayouts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        return out.sum(1) + state[0]


def test_outputs_holding_the_examples_in_different_dimensions_name_the_way_out():
    # found by a probe: Opacus's DPLSTM was refused with the advice to pass batch_dim, which no
    # value can satisfy (its output holds the examples in dimension 0, its state in 1)
    model = _UsesTwoLayouts().double()
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    words = r"outputs hold the examples in different dimensions \(output 1 along dimension 1\)"
    with pytest.raises(GradkitError, match=words), track(model, "variance"):
        model(x).sum().backward()


def test_a_rerun_differing_among_subnormals_is_not_a_disagreement() -> None:
    """Activations decayed to 1e-43 (an EfficientNet's BatchNorm in float32) re-ran one
    subnormal step (1.4e-45) off the batch's: no tolerance relative to them could pass, and a
    valid model was refused. Differences below float's smallest normal number are rounding."""
    from gradkit.per_example._batch import Dims
    from gradkit.per_example.rules._fallback import _reruns_differ

    want = torch.tensor([[1.55544e-43, 4.18e-43], [2.0e-43, 3.0e-43]], dtype=torch.float32)
    got = (want + torch.tensor(1.4e-45))[:, :, None].movedim(2, 1)  # [N, 1, ...] per example
    dims = Dims([0], [0], [False], values=[want], versions=[want._version])
    assert not bool(_reruns_differ(dims, [0], [got]))
    normal = want * 1e30  # a real disagreement is still found
    dims = Dims([0], [0], [False], values=[normal], versions=[normal._version])
    off = normal[:, None].clone()
    off[0, 0, 1] *= 1.1
    assert bool(_reruns_differ(dims, [0], [off]))
    assert not bool(_reruns_differ(dims, [0], [normal[:, None]]))


class _Records(nn.Module):
    """A fallback module that records whether oneDNN is on at each call; with an RNN inside
    or not."""

    def __init__(self, rnn: bool) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 3, batch_first=True) if rnn else None
        self.w = nn.Parameter(torch.ones(3))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch._C._get_mkldnn_enabled())
        h = self.rnn(x)[0] if self.rnn is not None else x
        return h * self.w


@pytest.mark.parametrize("rnn", [False, True], ids=["plain", "with-rnn"])
def test_onednn_is_switched_off_only_for_re_runs_of_modules_holding_an_rnn(rnn: bool) -> None:
    """Its RNN kernels are wrong when differentiated inside a backward; for anything else,
    switching it off sent depthwise convolutions to torch's slow reference kernel."""
    torch.manual_seed(0)
    model = _Records(rnn)
    x = torch.randn(4, 2, 3)
    with track(model, "variance") as stats:
        model(x).square().sum().backward()
    _ = stats["w"].variance
    assert model.seen[0] == torch._C._get_mkldnn_enabled()  # the forward: as the user set it
    reruns = model.seen[1:]
    assert reruns and all(on is (not rnn and model.seen[0]) for on in reruns)

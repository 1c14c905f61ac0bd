"""track(): the contracts around the numbers: traps of the originals, loss terms outside
modules, autograd.grad, layouts, dtypes, errors, hook hygiene."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradkit
from gradkit import GradkitError
from gradkit.per_example import track
from gradkit.testing import assert_close, per_example_grads

D = torch.float64


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(72, 10),
    ).double()


def ce_data(n: int = 16):
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=D), torch.randint(0, 10, (n,), generator=g)


def tf_moment(pname: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, p: int, fix_scale):
    """TensorFlow gradient_moment.py's formulas re-expressed (n * sum_t (x g)^p)."""
    acts, grads = {}, {}
    layer = dict(model.named_children())[pname.split(".")[0]]

    def keep(module, args, out):
        acts["a"] = args[0]
        out.register_hook(lambda g: grads.update(g=g))

    layer.register_forward_hook(keep)
    F.cross_entropy(model(x), y).backward()
    a, g, n = acts["a"], grads["g"], x.shape[0]
    scale = n ** (p - 1) if fix_scale else n
    if pname.endswith("bias"):
        return scale * g.pow(p).sum((0, 2, 3))
    return scale * torch.nn.grad.conv2d_weight(
        a.pow(p), layer.weight.shape, g.pow(p), stride=layer.stride, padding=layer.padding
    )


@pytest.mark.parametrize("pname", ["0.weight", "0.bias", "2.weight", "2.bias"])
@pytest.mark.parametrize("p", [2, 3])
def test_conv_cross_terms_tf_trap(pname, p):
    model = conv_net()
    x, y = ce_data()
    ref = per_example_grads(model, lambda o, t: F.cross_entropy(o, t), x, y)[pname]
    exact = (ref**p).mean(0)
    with track(model, moments=(p,)) as stats:
        F.cross_entropy(model(x), y).backward()
    assert_close(stats[pname].moment(p), exact)
    wrong = tf_moment(pname, conv_net(), x, y, p, fix_scale=True)
    assert ((wrong - exact).norm() / exact.norm()) > 0.1  # the trap is real on these shapes


def test_conv_1x1_output_control_is_where_tf_formula_holds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 8)).double()  # output 1x1: no positions to sum
    x = torch.randn(6, 3, 8, 8, dtype=D)
    ref = per_example_grads(model, lambda o, t: (o**3).sum(), x, None)["0.weight"]
    with track(model, "second_moment") as stats:
        (model(x) ** 3).sum(-1).sum(-1).sum(-1).mean().backward()
    assert_close(stats["0.weight"].second_moment, (ref**2).mean(0))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_moment_scaling_for_every_p(p, reduction):
    # TF's MatMul moment is n * (A^p)^T G^p: right only for p = 2 (p = 1 gives n x the mean)
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(9, 4, dtype=D), torch.randn(9, 3, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)["weight"]
    with track(model, moments=(p,), loss_reduction=reduction) as stats:
        per = ((model(x) - y) ** 2).sum(1)
        (per.mean() if reduction == "mean" else per.sum()).backward()
    assert_close(stats["weight"].moment(p), (ref**p).mean(0))
    if p == 1:
        assert_close(stats["weight"].moment(1), stats["weight"].moment(1))


def test_sequence_linear_and_broadcast_bias_cross_terms():
    # the sum over positions must be inside the power, for the weight and the bias
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(5, 7, 3, dtype=D), torch.randn(5, 7, 2, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 3).sum(), x, y)
    with track(model, "second_moment", moments=(3,)) as stats:
        ((model(x) - y) ** 3).sum((1, 2)).mean().backward()
    for name in ("weight", "bias"):
        assert_close(stats[name].second_moment, (ref[name] ** 2).mean(0))
        assert_close(stats[name].moment(3), (ref[name] ** 3).mean(0))


def test_mean_ignores_loss_terms_outside_modules():
    # an explicit weight-decay term is not a per-example loss: the mean stays (1/N) sum g_i
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    with track(model, "mean", "variance") as stats:
        loss = ((model(x) - y) ** 2).sum(1).mean() + 0.7 * model.weight.square().sum()
        loss.backward()
    assert_close(stats["weight"].mean, ref["weight"].mean(0))
    assert_close(stats["weight"].variance, ref["weight"].var(0, unbiased=False))


@pytest.mark.parametrize("inputs", ["params", "input_only"])
def test_autograd_grad_instead_of_backward(inputs):
    """A pass counts for the parameters whose gradient it computes: all of them through
    torch.autograd.grad, none through a gradient w.r.t. the input alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=D, requires_grad=True)
    ref = per_example_grads(model, lambda o, t: (o**2).sum(), x.detach(), None)
    with track(model, "mean", "variance") as stats:
        loss = (model(x) ** 2).sum(1).mean()
        targets = list(model.parameters()) if inputs == "params" else [x]
        torch.autograd.grad(loss, targets)
    assert all(p.grad is None for p in model.parameters())
    if inputs == "input_only":
        assert stats.num_examples == 0
        return
    for name, g in ref.items():
        assert_close([stats[name].mean, stats[name].variance], [g.mean(0), g.var(0, False)])


def test_batch_dim_one():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 5, 3, dtype=D)  # [T, N, d]
    ref = per_example_grads(model, lambda o, t: (o**3).sum(), x, None, batch_dim=1)
    with track(model, "variance", "batch_l2", batch_dim=1) as stats:
        (model(x) ** 3).sum((0, 2)).mean().backward()
    assert stats.num_examples == 5
    assert_close(stats["weight"].variance, ref["weight"].var(0, unbiased=False))
    assert_close(stats["weight"].batch_l2, ref["weight"].flatten(1).square().sum(1))


def test_frozen_parameters_are_skipped():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    with track(model, "variance") as stats:
        model(torch.randn(4, 3)).sum().backward()
    assert sorted(stats) == ["0.bias", "1.bias", "1.weight"]


def test_bf16_model_statistics_in_fp32():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    ref = per_example_grads(model.to(torch.bfloat16), lambda o, t: ((o - t) ** 2).sum(), x, y)
    with track(model, "variance", "batch_l2") as stats:
        ((model(x.bfloat16()) - y.bfloat16()) ** 2).sum(1).mean().backward()
    s = stats["weight"]
    assert s.variance.dtype == torch.float32 and s.batch_l2.dtype == torch.float32
    assert_close(s.variance.double(), ref["weight"].var(0, unbiased=False), rtol=5e-2, atol=5e-2)


def test_variance_never_negative_with_large_mean_small_spread():
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    x = 1000.0 + 1e-3 * torch.randn(64, 4)  # nearly identical examples
    with track(model, "variance", "second_moment") as stats:
        model(x).sum(1).mean().backward()
    assert (stats["weight"].variance >= 0).all()


def test_unbiased_option():
    model = nn.Linear(2, 1).double()
    x = torch.randn(5, 2, dtype=D)
    with track(model, "variance", unbiased=True) as stats:
        model(x).pow(2).sum(1).mean().backward()
    ref = per_example_grads(model, lambda o, t: (o**2).sum(), x, None)["weight"]
    assert_close(stats["weight"].variance, ref.var(0, unbiased=True))


@pytest.mark.parametrize("same_loss", [True, False], ids=["same_loss", "two_tasks"])
def test_a_second_backward_through_counted_calls_is_refused(same_loss):
    """Two losses of one forward backpropagated one after the other (retain_graph=True) would
    count each example twice, and the two losses' gradients as two examples: the mean came out
    half of p.grad / N. Refused at the second pass, before it reaches a parameter."""
    model = nn.Linear(2, 2).double()
    x = torch.randn(3, 2, dtype=D)
    with track(model, "mean", "variance") as stats:
        out = model(x)
        out[:, 0].pow(2).mean().backward(retain_graph=True)
        first = model.weight.grad.clone()
        second = out[:, 0 if same_loss else 1].pow(2).mean()
        with pytest.raises(GradkitError, match=r"second pass through a call of model \(Linear\)"):
            second.backward()
    assert_close(model.weight.grad, first)  # refused before the parameters
    want = per_example_grads(model, lambda o, t: (o[:, 0] ** 2).sum(), x, None)["weight"]
    assert stats.num_examples == 3
    assert_close(stats["weight"].mean, want.mean(0))


def test_passes_that_leave_the_parameters_out_may_go_through_counted_calls():
    """An input's gradient before or after the parameters' pass (adversarial training, a
    saliency map) adds no example: retained graphs may serve it."""
    model = nn.Linear(2, 2).double()
    x = torch.randn(3, 2, dtype=D, requires_grad=True)
    with track(model, "mean", "variance") as stats:
        loss = model(x).pow(2).sum(1).mean()
        torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward(retain_graph=True)
        torch.autograd.grad(loss, x)
    ref = per_example_grads(model, lambda o, t: (o**2).sum(), x.detach(), None)["weight"]
    assert stats.num_examples == 3
    assert_close(
        [stats["weight"].mean, stats["weight"].variance], [ref.mean(0), ref.var(0, unbiased=False)]
    )


def test_batchnorm_training_mode_refused_with_explanation():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with (
        track(model, "variance"),
        pytest.raises(GradkitError, match=r"1 \(BatchNorm1d\) in training mode.*model.eval"),
    ):
        model(torch.randn(4, 3))
    model.eval()
    with track(model, "variance") as stats:
        model(torch.randn(4, 3)).sum().backward()
    assert stats.num_examples == 4


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batchnorm_without_running_statistics_refused_in_either_mode(training):
    """Without running statistics BatchNorm normalizes with the batch's own statistics in eval
    mode too: each example's output depends on the others (a BatchNorm's weight read per
    example had a batch_grad whose mean was 30 % off its mean)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, track_running_stats=False))
    model.train(training)
    with (
        track(model, "variance"),
        pytest.raises(GradkitError, match=r"BatchNorm1d\) (in training mode|without running stat)"),
    ):
        model(torch.randn(4, 3))


class _Odd(nn.Module):
    """A layer without a rule: the fallback differentiates it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


@pytest.mark.parametrize("layer", ["linear", "fallback"])
def test_a_forward_hook_that_replaces_a_layers_output_is_exact(layer):
    """The user's forward hook, registered before track(), returns a new output: a rule must
    read the layer's own output (its hook used to run after the user's and read the replaced
    one: 2.3 off on the Linear's weight), the fallback the output the hooks leave, as its
    re-run of the module calls them too."""
    torch.manual_seed(0)
    first = nn.Linear(3, 4) if layer == "linear" else nn.Sequential(nn.Linear(3, 4), _Odd())
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 2)).double()
    hooked = model[0] if layer == "linear" else model[0][1]
    hooked.register_forward_hook(lambda module, args, out: 2.0 * out + 0.5)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    with track(model, "batch_grad", "variance", loss_reduction="sum") as stats:
        ((model(x) - y) ** 2).sum().backward()
    for name, g in ref.items():
        assert_close(stats[name].batch_grad, g, rtol=1e-10, atol=1e-12)
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-10, atol=1e-12)


class _Pair(nn.Module):
    """A layer without a rule and with two outputs: the fallback reads both gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x * self.w), x * self.w.square()


class _HookedInside(nn.Module):
    """A forward that hooks a tracked layer's output, changing the gradient that reaches the
    layer's backward (as gradient scaling or reversal by a hook does)."""

    def __init__(self, pair: bool) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4).double()
        self.pair = _Pair() if pair else None
        self.last = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.pair is None:
            if h.requires_grad:
                h.register_hook(lambda g: -2.0 * g)
            return self.last(torch.tanh(h))
        a, b = self.pair(h)
        if a.requires_grad:
            a.register_hook(lambda g: -2.0 * g)
        return self.last(a + b)


@pytest.mark.parametrize("pair", [False, True])
def test_a_hook_on_a_layers_output_inside_the_forward_is_exact(pair):
    """The model hooks a layer's output after the call: the gradient its backward gets, and so
    ``p.grad`` and the mean, are the hook's. The tracker read the gradient before that hook
    (its own ran first): the second moment 0.35 off the loop's, silently. It now reads what the
    layer's node receives, after every hook on the output, for a rule and for the fallback's
    several outputs."""
    torch.manual_seed(0)
    model = _HookedInside(pair)
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    ref = per_example_grads(model, F.cross_entropy, x, y)
    with track(model, "variance", "batch_l2", loss_reduction="sum") as stats:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    for name, g in ref.items():
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-10, atol=1e-14)
        assert_close(model.get_parameter(name).grad, g.sum(0), rtol=1e-10, atol=1e-14)
    norms = sum(g.flatten(1).square().sum(1) for g in ref.values())
    assert_close(stats.batch_l2(), norms, rtol=1e-10, atol=1e-14)


def test_a_hook_on_a_parameter_changes_p_grad_not_the_statistics():
    """A parameter's own hook scales what autograd adds to ``p.grad``, not the derivative: the
    statistics are those of ``d l_i / d theta``, as the one-example loop's, the documented
    definition (the mean is then not ``p.grad / N``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].weight.register_hook(lambda g: 3.0 * g)
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    ref = per_example_grads(model, F.cross_entropy, x, y)
    with track(model, "variance", loss_reduction="sum") as stats:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    for name, g in ref.items():
        assert_close(stats[name].mean, g.mean(0), rtol=1e-10, atol=1e-14)
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-10, atol=1e-14)
    assert_close(model[0].weight.grad, 3.0 * ref["0.weight"].sum(0), rtol=1e-10, atol=1e-14)


def test_a_zero_dim_parameter_has_norms():
    """A 0-dim parameter (CLIP's logit_scale, a learned temperature): its per-example gradients
    are [N]; their norms used to fail with an IndexError in the middle of the backward."""
    torch.manual_seed(0)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 2)
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * self.scale

    model = Scaled().double()
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    with track(model, "batch_l2", "variance", loss_reduction="sum") as stats:
        ((model(x) - y) ** 2).sum().backward()
    assert_close(stats["scale"].batch_l2, ref["scale"] ** 2, rtol=1e-10, atol=1e-12)
    total = sum(g.reshape(5, -1).square().sum(1) for g in ref.values())
    assert_close(stats.batch_l2(), total, rtol=1e-10, atol=1e-12)


class _Masked(nn.Module):
    """A fallback module (a parameter used directly) given a [T, T] causal mask shared by every
    example."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=D))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: [N, T, 3]
        scores = (x @ x.transpose(1, 2)).masked_fill(~mask, -1e9).softmax(-1)
        return (scores @ x) * self.gamma


class _CausalModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Masked()
        self.head = nn.Linear(3, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self.head(self.block(x, torch.ones(t, t, dtype=torch.bool).tril())).sum((1, 2))


@pytest.mark.parametrize("n", [3, 4])
def test_a_shared_tensor_with_n_rows_is_refused_not_split(n):
    """The fallback splits a tensor where its size equals the number of examples: a causal mask
    [T, T] with T = N was split as if it held examples, and every statistic of the block but
    the mean came out wrong (0.3-0.9 off). Re-running each example must reproduce its row of
    the batch's output; when it does not, reading the statistics raises."""
    torch.manual_seed(0)
    model, x = _CausalModel(), torch.randn(n, 4, 3, dtype=D)
    with track(model, "variance", "batch_l2", loss_reduction="sum") as stats:
        model(x).sum().backward()
    if n == 4:  # T = N: the mask is split
        with pytest.raises(GradkitError, match=r"block \(_Masked\): re-run on each example"):
            stats.batch_l2()
        with pytest.raises(GradkitError, match="shared by every example"):
            _ = stats["block.gamma"].variance
        return
    ref = per_example_grads(model, lambda o, t: o.sum(), x, None)
    for name, g in ref.items():
        assert_close(stats[name].variance, g.var(0, unbiased=False), rtol=1e-10, atol=1e-12)


def test_a_fallback_module_that_mixes_examples_is_refused():
    """A module whose output for one example depends on the others (centred on the batch
    mean) has no per-example gradients: its re-runs cannot reproduce the batch's output."""

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, dtype=D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - x.mean(0)) * self.w

    model = nn.Sequential(Centred(), nn.Linear(3, 1).double())
    with track(model, "variance") as stats:
        model(torch.randn(5, 3, dtype=D)).pow(2).mean().backward()
    with pytest.raises(GradkitError, match=r"0 \(Centred\): re-run on each example"):
        _ = stats["0.w"].variance


def test_a_fallback_output_modified_in_place_is_not_mistaken_for_a_mismatch():
    """The batch's output is checked only while it is as the module returned it: an in-place
    activation afterwards leaves the statistics exact and readable."""
    torch.manual_seed(0)

    class Scale(nn.Module):  # its output is not saved for its backward: ReLU may change it
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 4, dtype=D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    model = nn.Sequential(Scale(), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 4, dtype=D), torch.randn(5, 2, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    with track(model, "variance", loss_reduction="sum") as stats:
        ((model(x) - y) ** 2).sum().backward()
    assert_close(stats["0.w"].variance, ref["0.w"].var(0, unbiased=False), rtol=1e-10, atol=1e-12)


def test_hooks_removed_on_exit_and_on_error():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(RuntimeError, match="boom"), track(model, "variance"):
        raise RuntimeError("boom")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # a graph built inside but backwarded after exit is ignored, not an error
    with track(model.eval(), "mean") as stats:
        out = model(torch.randn(2, 3)).sum()
    out.backward()
    assert stats.num_examples == 0


def test_fallback_modes():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    model = Odd()
    with pytest.raises(GradkitError, match=r"fallback: expected a rule for every tracked module"):
        track(model, "mean", fallback="error")
    with pytest.warns(UserWarning, match="using the vmap fallback"):
        track(model, "mean", fallback="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        track(model, "mean")


def test_arguments_equal_to_valid_ones_are_still_refused():
    """The checked arguments are kept per value for the next call: a value equal to a valid
    one (True == 1, 2.0 == 2) or unhashable is checked again, not taken for it."""
    model = nn.Linear(2, 1)
    for _ in range(2):
        track(model, moments=(1, 2))
        track(model, "variance")
        with pytest.raises(ValueError, match="moments: expected positive integers"):
            track(model, moments=(True, 2))
        with pytest.raises(ValueError, match="moments: expected positive integers"):
            track(model, moments=(1, 2.0))
        with pytest.raises(ValueError, match="pass them as separate arguments"):
            track(model, ["variance"])
    assert track(model, "variance")._want is track(model, "variance")._want


def test_bad_arguments():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="quantities: expected one of 'mean'"):
        track(model, "varaince")
    with pytest.raises(ValueError, match="at least one of"):
        track(model)
    with pytest.raises(ValueError, match="moments: expected positive integers"):
        track(model, moments=(0,))
    with pytest.raises(ValueError, match="loss_reduction: expected one of 'mean', 'sum'"):
        track(model, "mean", loss_reduction="avg")
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        track("model", "mean")
    with track(model, "mean") as stats:
        model(torch.randn(2, 2)).sum().backward()
    with pytest.raises(
        GradkitError,
        match=r"stats\['weight'\].variance: not tracked; pass "
        r"'variance'",
    ):
        _ = stats["weight"].variance
    with pytest.raises(GradkitError, match=r"moment\(3\): not tracked"):
        stats["weight"].moment(3)
    with pytest.raises(KeyError, match="no tracked parameter 'nope'"):
        stats["nope"]


def test_micro_batches_called_before_one_backward_must_match_in_size():
    model = nn.Linear(2, 1)
    with track(model, "variance"), pytest.raises(GradkitError, match="sizes \\[2, 3\\]"):
        (model(torch.randn(2, 2)).sum() + model(torch.randn(3, 2)).sum()).backward()


def test_register_rule_mro_and_double_registration():
    class MyLinear(nn.Linear):
        pass

    assert gradkit.per_example.find_rule(MyLinear(2, 2)) is gradkit.per_example.find_rule(
        nn.Linear(2, 2)
    )
    with pytest.raises(ValueError, match="already has"):
        gradkit.per_example.register_rule(nn.Linear)(lambda m, u, c: {})


def test_a_forward_replaced_on_the_instance_is_not_its_class_s():
    """``layer.forward = ...`` (as Accelerate's hooks do) runs another function than the one
    the class's rule was written for: the exact fallback differentiates it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].forward = types.MethodType(
        lambda self, x: 2 * F.linear(x, self.weight, self.bias), model[0]
    )
    assert gradkit.per_example.find_rule(model[0]) is None
    assert gradkit.per_example.find_rule(model[2]) is not None
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    ref = per_example_grads(model, F.cross_entropy, x, y)
    with track(model, "second_moment", "batch_l2") as stats:
        F.cross_entropy(model(x), y).backward()
    for name, g in ref.items():
        torch.testing.assert_close(
            stats[name].second_moment, g.square().mean(0), rtol=1e-10, atol=0
        )
    norms = sum(g.flatten(1).square().sum(1) for g in ref.values())
    torch.testing.assert_close(stats.batch_l2(), norms, rtol=1e-10, atol=0)


def test_a_forward_replaced_on_the_class_after_its_rule_is_not_the_rule_s(monkeypatch):
    """``nn.Linear.forward = ...`` after gradkit registered the Linear rule: every Linear runs
    that function now, not the one the rule reads; the exact fallback differentiates it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    original = nn.Linear.forward
    monkeypatch.setattr(
        nn.Linear, "forward", lambda self, x: 2 * F.linear(x, self.weight, self.bias)
    )
    assert gradkit.per_example.find_rule(model[0]) is None
    ref = per_example_grads(model, F.cross_entropy, x, y)
    with track(model, "second_moment") as stats:
        F.cross_entropy(model(x), y).backward()
    for name, g in ref.items():
        torch.testing.assert_close(
            stats[name].second_moment, g.square().mean(0), rtol=1e-10, atol=0
        )
    monkeypatch.setattr(nn.Linear, "forward", original)
    assert gradkit.per_example.find_rule(model[0]) is not None


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.stateless.functional_call` is deprecated")
@pytest.mark.parametrize("how", ["functional_call", "stateless"])
def test_a_call_with_substituted_parameters_is_refused(how):
    """``functional_call(model, {"2.weight": 2 * w}, x)`` runs the layer with another tensor:
    its rule would give the per-example gradients of that tensor (the second moment 4x too
    large, silently). The same call with the model's own parameters is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    call = (
        torch.func.functional_call
        if how == "functional_call"
        else torch.nn.utils.stateless.functional_call
    )
    refused = pytest.raises(GradkitError, match=r"parameter '2.weight'.*functional_call")
    with track(model, "second_moment"), refused:
        call(model, {"2.weight": 2 * model[2].weight}, (x,))
    ref = per_example_grads(model, F.cross_entropy, x, y)
    with track(model, "second_moment") as stats:
        F.cross_entropy(call(model, dict(model.named_parameters()), (x,)), y).backward()
    for name, g in ref.items():
        torch.testing.assert_close(
            stats[name].second_moment, g.square().mean(0), rtol=1e-10, atol=0
        )


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_replaced_torch_functional_gets_the_fallback(monkeypatch, layer):
    """``torch.nn.functional.linear = ...`` (DeepSpeed's ZeRO-3 does it) changes what every
    ``nn.Linear`` computes: the Linear rule would read its input and output gradient as if the
    layer computed ``x W^T + b`` (4.3 off for a replacement that doubles the weight). The layer
    takes the exact fallback instead, also where a decision kept from before the replacement
    exists, and gets its rule back when the original returns."""
    torch.manual_seed(0)
    if layer == "linear":
        first, x = nn.Linear(3, 4), torch.randn(6, 3, dtype=D)
        name, original = "linear", F.linear
    else:
        first, x = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()), torch.randn(6, 1, 4, 4, dtype=D)
        name, original = "conv2d", F.conv2d
    model = nn.Sequential(first, nn.Tanh(), nn.LazyLinear(2)).double()
    model(x)
    y = torch.randint(0, 2, (6,))

    def second_moments() -> dict[str, torch.Tensor]:
        with track(model, "second_moment") as stats:
            F.cross_entropy(model(x), y).backward()
        return {name: s.second_moment for name, s in stats.items()}

    second_moments()  # a kept decision from before the replacement

    def doubled(x, weight, *args, **kwargs):
        return original(x, 2.0 * weight, *args, **kwargs)

    monkeypatch.setattr(F, name, doubled)
    layer_of = model[0] if layer == "linear" else model[0][0]
    assert gradkit.per_example.find_rule(layer_of) is None
    ref = per_example_grads(model, F.cross_entropy, x, y)
    got = second_moments()
    for key, g in ref.items():
        assert_close(got[key], g.square().mean(0), rtol=1e-10, atol=1e-14)
    monkeypatch.setattr(F, name, original)
    assert gradkit.per_example.find_rule(layer_of) is not None


@pytest.mark.parametrize("kwargs", [False, True])
def test_a_global_forward_hook_that_replaces_a_layers_output_is_refused(kwargs):
    """A global forward hook runs before the module's own hooks, the tracker's among them: a
    replaced output of a layer that a rule reads would be what the tracker differentiates (the
    Linear rule's second moment 3.7 off). It is refused, by the hook's and the layer's name;
    a global hook that returns None, or replaces the output of a module the fallback re-runs,
    keeps the statistics exact; the hooks are given back unwrapped after the block."""
    from torch.nn.modules.module import (
        _global_forward_hooks,
        _global_forward_hooks_with_kwargs,
        register_module_forward_hook,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Odd(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))

    def doubling(module, *rest):
        return 2.0 * rest[-1] if isinstance(module, nn.Linear) else None

    def observer(module, *rest):
        return None

    handle = register_module_forward_hook(doubling, with_kwargs=kwargs)
    try:
        refused = r"output of 0 \(Linear\).*global forward hook .*doubling"
        with pytest.raises(GradkitError, match=refused), track(model, "second_moment"):
            model(x)
        assert _global_forward_hooks[handle.id] is doubling
    finally:
        handle.remove()
        _global_forward_hooks_with_kwargs.pop(handle.id, None)  # its handle leaves it (torch 2.13)

    def odd_doubled(module, *rest):
        return 2.0 * rest[-1] if isinstance(module, _Odd) else None

    for hook in (observer, odd_doubled):
        ref = per_example_grads(model, F.cross_entropy, x, y) if hook is observer else None
        with track(model, "second_moment") as stats:
            handle = register_module_forward_hook(hook)  # registered inside the block
            try:
                F.cross_entropy(model(x), y).backward()
            finally:
                handle.remove()
        if ref is None:  # the loop with the hook registered
            handle = register_module_forward_hook(hook)
            try:
                ref = per_example_grads(model, F.cross_entropy, x, y)
            finally:
                handle.remove()
        for name, g in ref.items():
            assert_close(stats[name].second_moment, g.square().mean(0), rtol=1e-10, atol=1e-14)
    assert not _global_forward_hooks


class _DoubledOnLookup(nn.Linear):
    """``self.weight`` is ``2 * weight``: ``nn.Module.__getattr__`` gives a module its
    parameters, and this class overrides it."""

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        return 2.0 * value if name == "weight" else value


def test_a_class_that_changes_attribute_lookup_gets_the_fallback(monkeypatch):
    """The Linear rule reads the parameter, the forward ``self.weight``: a class whose
    ``__getattr__`` returns another tensor for it had its second moment 0.34 off, silently. A
    rule registered for the class itself is written for its lookup, and kept."""
    from gradkit.per_example import _registry

    def own_rule(module, uses, ctx):  # pragma: no cover - only its identity is compared
        raise AssertionError

    monkeypatch.setitem(_registry._RULES, _DoubledOnLookup, own_rule)
    assert gradkit.per_example.find_rule(_DoubledOnLookup(3, 4)) is own_rule
    monkeypatch.undo()
    torch.manual_seed(0)
    model = nn.Sequential(_DoubledOnLookup(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    assert gradkit.per_example.find_rule(model[0]) is None
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    ref = per_example_grads(model, F.cross_entropy, x, y)
    with track(model, "second_moment", "batch_l2") as stats:
        F.cross_entropy(model(x), y).backward()
    for name, g in ref.items():
        assert_close(stats[name].second_moment, g.square().mean(0), rtol=1e-10, atol=1e-14)
    norms = sum(g.flatten(1).square().sum(1) for g in ref.values())
    assert_close(stats.batch_l2(), norms, rtol=1e-10, atol=1e-14)


def test_a_parameter_removed_inside_the_block_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    refused = pytest.raises(GradkitError, match=r"parameter '2.bias'.*removed from the module")
    with track(model, "variance"), refused:
        model[2].bias = None
        model(torch.randn(5, 3, dtype=D))


def test_derived_quantities_match_definitions():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(10, 3, dtype=D), torch.randn(10, 2, dtype=D)
    ref = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    with track(model, "variance") as stats:
        ((model(x) - y) ** 2).sum(1).mean().backward()
    tr = sum(float(g.var(0, unbiased=True).sum()) for g in ref.values())
    # |G|^2 without bias: E|mean|^2 = |G|^2 + tr(Sigma) / N
    g2 = sum(float(g.mean(0).square().sum()) for g in ref.values()) - tr / 10
    assert gradkit.per_example.noise_scale(stats) == pytest.approx(tr / g2, rel=1e-10)
    snr = gradkit.per_example.gradient_snr(stats)
    w = ref["weight"]
    assert snr["weight"] == pytest.approx(float((w.mean(0) ** 2 / w.var(0)).mean()), rel=1e-10)
    # the median of an even number of entries (6 weights, 2 biases) is the mean of the middle two
    medians = gradkit.per_example.gradient_snr(stats, reduction="median")
    for name, g in ref.items():
        ratio = (g.mean(0) ** 2 / g.var(0)).reshape(-1).sort().values
        k = len(ratio) // 2
        assert len(ratio) % 2 == 0
        assert medians[name] == pytest.approx(float((ratio[k - 1] + ratio[k]) / 2), rel=1e-10)
    assert gradkit.per_example.cabs_batch_size(stats, lr=0.1, loss=0.5, max_size=10**6) == round(
        0.1 * tr / 0.5
    )
    with pytest.raises(ValueError, match="loss: expected a positive loss value"):
        gradkit.per_example.cabs_batch_size(stats, lr=0.1, loss=0.0)
    assert "noise scale" in stats.summary() and "weight" in stats.summary()


class KeyBias(nn.Module):
    """Attention scores ``q . (W x_t + b)``: the key bias adds one number to every score of a
    query, which the softmax ignores: its exact gradient is 0, its computed one rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(4, 4), nn.Linear(4, 4)
        self.value = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, 4]
        scores = self.query(x) @ self.key(x).transpose(1, 2)
        return (scores.softmax(-1) @ self.value(x)).sum(1)


def test_snr_leaves_out_a_parameter_whose_gradient_is_rounding():
    """The key bias's entries were all noise, alike among themselves, so their ratios were kept:
    BERT's median SNR moved by 1-2 % with the order of the examples. Taken at the scale of the
    model's largest gradient, they are rounding: its SNR is nan (a zero gradient), and every
    other parameter's is the same in any order of the examples."""
    torch.manual_seed(0)
    model = KeyBias().double()
    x = torch.randn(6, 5, 4, dtype=D)
    y = torch.randn(6, 2, dtype=D)
    results = []
    for order in (torch.arange(6), torch.tensor([5, 3, 1, 0, 2, 4])):
        with track(model, "variance") as stats:
            ((model(x[order]) - y[order]) ** 2).sum(1).mean().backward()
        results.append(gradkit.per_example.gradient_snr(stats, reduction="median"))
    assert abs(model.key.bias.grad).max() < 1e-14  # rounding, where the others are ~1
    for snr in results:
        assert math.isnan(snr["key.bias"]), snr
    for name in results[0]:
        if name != "key.bias":
            assert results[1][name] == pytest.approx(results[0][name], rel=1e-9), name


@pytest.mark.parametrize("quantity", ["variance", "batch_grad", "batch_l2"])
def test_tracker_and_captures_are_freed(quantity):
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    refs = []
    with track(model, quantity) as stats:
        model(torch.randn(4, 6)).sum().backward()
    refs.append(weakref.ref(stats))
    with track(model, "mean") as never_backwarded:
        out = model(torch.randn(4, 6)).sum()
    refs.append(weakref.ref(never_backwarded))
    del stats, never_backwarded, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_retained_graph_of_a_shared_layer_counts_each_backward_once():
    """A layer called twice in one forward: one pass counts its examples once; a second pass
    through the retained graph is refused."""
    from .settings import Twice

    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randn(3, 4, dtype=D)
    ref = per_example_grads(model, lambda o, t: (o**3).sum(), x, None)
    with track(model, "mean", "variance") as stats:
        loss = (model(x) ** 3).sum(1).mean()
        loss.backward(retain_graph=True)
        with pytest.raises(GradkitError, match="second pass through a call"):
            loss.backward()
    assert stats.num_examples == 3
    for name, g in ref.items():
        assert_close(
            [stats[name].mean, stats[name].variance], [g.mean(0), g.var(0, unbiased=False)]
        )


def test_parameter_names_are_named_parameters():
    """The tracker names parameters from its one walk of the modules: the same names and order
    as model.named_parameters(), shared modules and tied weights counted once."""
    from gradkit.per_example._tracker import _named_parameters

    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(3, 2), nn.Linear(3, 2, bias=False))
    model[4].weight = model[3].weight  # tied, registered again under another module
    model.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    model.register_parameter("absent", None)
    assert _named_parameters(dict(model.named_modules())) == list(model.named_parameters())


def test_batchnorm_in_eval_mode_has_a_rule_of_its_own() -> None:
    """Not the vmap fallback (a re-run per example): its own closed form, exact by the grid's
    batchnorm*_eval settings."""
    from gradkit.per_example._registry import find_rule
    from gradkit.per_example.rules._norm import batch_norm_rule

    for kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        assert find_rule(kind(3)) is batch_norm_rule
    assert find_rule(nn.SyncBatchNorm(3)) is None  # its own forward: the exact fallback

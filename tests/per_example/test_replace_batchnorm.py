"""``per_example.replace_batchnorm``: what it replaces and keeps, ``groups``, the original left
alone, and tracking of the converted model against the float64 per-example loop."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import gradkit
from gradkit import GradkitError
from gradkit.per_example import replace_batchnorm
from gradkit.testing import assert_close, per_example_grads

D = torch.float64
STATS_KEYS = ("running_mean", "running_var", "num_batches_tracked")


class Net(nn.Module):
    """BatchNorm2d at the top level and inside nested Sequentials, BatchNorm1d on ``[N, C, L]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.block = nn.Sequential(nn.Conv2d(6, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.Tanh()))
        self.bn1d = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(torch.tanh(self.bn(self.conv(x))))  # [N, 4, 2, 2]
        h = self.bn1d(h.flatten(2))  # [N, 4, 4]
        return self.fc(h.flatten(1))


BN_NAMES = {"bn": 6, "block.1.0": 4, "bn1d": 4}


def make_net(dtype: torch.dtype = D) -> Net:
    """A Net with affine parameters and running statistics away from their defaults."""
    torch.manual_seed(0)
    net = Net().to(dtype)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, _BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(7)
    return net


def snapshot(model: nn.Module) -> tuple[dict[str, type], dict[str, torch.Tensor]]:
    types = {n: type(m) for n, m in model.named_modules()}
    return types, {k: v.clone() for k, v in model.state_dict().items()}


def test_replaces_every_batchnorm_under_the_same_name():
    net = make_net()
    out = replace_batchnorm(net)
    assert not any(isinstance(m, _BatchNorm) for m in out.modules())
    modules = dict(out.named_modules())
    for name, c in BN_NAMES.items():
        gn, bn = modules[name], dict(net.named_modules())[name]
        assert type(gn) is nn.GroupNorm
        assert (gn.num_groups, gn.num_channels) == (math.gcd(32, c), c)
        assert gn.eps == bn.eps and gn.affine
        assert gn.training
        assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
    # everything else is the same module type under the same name
    before = {n: type(m) for n, m in net.named_modules() if n not in BN_NAMES}
    assert {n: type(m) for n, m in out.named_modules() if n not in BN_NAMES} == before


def test_state_dict_keys_of_affine_parameters_stay_loadable():
    net = make_net()
    old = net.state_dict()
    out = replace_batchnorm(net)
    dropped = {f"{n}.{k}" for n in BN_NAMES for k in STATS_KEYS}
    assert set(out.state_dict()) == set(old) - dropped
    for k, v in out.state_dict().items():
        assert torch.equal(v, old[k]), k
    fresh = replace_batchnorm(Net().double())
    result = fresh.load_state_dict(old, strict=False)
    assert result.missing_keys == [] and set(result.unexpected_keys) == dropped
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, old[k]), k


def test_original_model_is_untouched():
    net = make_net()
    types, state = snapshot(net)
    out = replace_batchnorm(net)
    assert out is not net
    new_types, new_state = snapshot(net)
    assert new_types == types
    assert new_state.keys() == state.keys()
    assert all(torch.equal(new_state[k], state[k]) for k in state)
    # no storage shared: training the copy leaves the original alone
    with torch.no_grad():
        for p in out.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


def test_copy_false_converts_in_place():
    net = make_net()
    bn_weight = net.bn.weight.detach().clone()
    out = replace_batchnorm(net, copy=False)
    assert out is net
    assert isinstance(net.bn, nn.GroupNorm) and torch.equal(net.bn.weight, bn_weight)
    assert not any(isinstance(m, _BatchNorm) for m in net.modules())


def test_a_model_deepcopy_cannot_copy_needs_copy_false():
    net = make_net()
    net.stream = (i for i in range(3))  # a generator: copy.deepcopy raises
    with pytest.raises(
        TypeError, match=r"model: expected a model that copy\.deepcopy .*copy=False"
    ):
        replace_batchnorm(net)
    assert isinstance(net.bn, nn.BatchNorm2d)
    assert replace_batchnorm(net, copy=False) is net and isinstance(net.bn, nn.GroupNorm)


def test_a_batchnorm_model_itself_is_converted():
    bn = nn.BatchNorm2d(8)
    for copy in (True, False):
        gn = replace_batchnorm(bn, groups=4, copy=copy)
        assert type(gn) is nn.GroupNorm and gn.num_groups == 4
        assert type(bn) is nn.BatchNorm2d


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5, 6, 32, 1024])
def test_int_groups_use_the_gcd(groups):
    out = replace_batchnorm(make_net(), groups=groups)
    modules = dict(out.named_modules())
    for name, c in BN_NAMES.items():
        assert modules[name].num_groups == math.gcd(groups, c)
        assert c % modules[name].num_groups == 0


def test_callable_groups():
    seen = []

    def groups(c: int) -> int:
        seen.append(c)
        return c // 2

    out = replace_batchnorm(make_net(), groups=groups)
    assert sorted(seen) == sorted(BN_NAMES.values())
    modules = dict(out.named_modules())
    assert all(modules[n].num_groups == c // 2 for n, c in BN_NAMES.items())


@pytest.mark.parametrize(
    "groups, match",
    [
        (lambda c: 4, r"groups\(6\) to return a positive int dividing num_channels=6 \(for bn\)"),
        (lambda c: 0, r"groups\(6\).*got 0"),
        (lambda c: c / 2, r"groups\(6\).*got 3\.0"),
        (lambda c: True, r"groups\(6\).*got True"),
    ],
)
def test_bad_callable_groups_raise(groups, match):
    net = make_net()
    with pytest.raises(ValueError, match=r"replace_batchnorm\(model, \.\.\.\): groups: .*" + match):
        replace_batchnorm(net, groups=groups)
    assert isinstance(net.bn, nn.BatchNorm2d)


def test_an_error_leaves_the_model_as_it_was_also_in_place():
    net = make_net()
    types, state = snapshot(net)
    # fine for bn (C = 6), wrong for block.1.0 (C = 4), which comes later
    with pytest.raises(ValueError, match=r"groups\(4\) .*num_channels=4 \(for block\.1\.0\)"):
        replace_batchnorm(net, groups=lambda c: 3, copy=False)
    new_types, new_state = snapshot(net)
    assert new_types == types
    assert all(torch.equal(new_state[k], state[k]) for k in state)


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match=r"replace_batchnorm\(model, \.\.\.\): model: .*nn\.Module"):
        replace_batchnorm("net")  # type: ignore[arg-type]
    for bad in ("4", 2.0, True, None):
        with pytest.raises(TypeError, match="groups: expected a positive int or a callable"):
            replace_batchnorm(make_net(), groups=bad)  # type: ignore[arg-type]
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"groups: expected a positive int, got {bad}"):
            replace_batchnorm(make_net(), groups=bad)
    with pytest.raises(ValueError, match=r"uninitialized lazy module at 0 \(LazyBatchNorm2d\)"):
        replace_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_dtype_and_device_are_kept(dtype, device):
    net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)).to(device=device, dtype=dtype)
    gn = replace_batchnorm(net)[1]
    for p in (gn.weight, gn.bias):
        assert p.dtype == dtype and p.device.type == device


def test_flags_kept_and_sharing_preserved():
    shared = nn.BatchNorm2d(4)
    frozen = nn.BatchNorm2d(4).eval()
    frozen.weight.requires_grad_(False)
    net = nn.Sequential(shared, nn.Sequential(shared), frozen, nn.BatchNorm2d(4, affine=False))
    net.append(nn.SyncBatchNorm(4))
    out = replace_batchnorm(net, groups=2)
    assert out[0] is out[1][0] and isinstance(out[0], nn.GroupNorm)
    assert not out[2].training and out[0].training
    assert not out[2].weight.requires_grad and out[2].bias.requires_grad
    assert not out[3].affine and list(out[3].parameters()) == []
    assert isinstance(out[4], nn.GroupNorm) and out[4].num_groups == 2
    assert len(list(out.parameters())) == 6


def test_logs_each_replaced_module(caplog):
    with caplog.at_level(logging.DEBUG, logger="gradkit.per_example._batchnorm"):
        replace_batchnorm(make_net())
    text = caplog.text
    assert "bn: BatchNorm2d(6) -> GroupNorm(2, 6)" in text
    assert "block.1.0: BatchNorm2d(4) -> GroupNorm(4, 4)" in text
    assert "bn1d: BatchNorm1d(4) -> GroupNorm(4, 4)" in text
    assert "replaced 3 BatchNorm module(s)" in text


@pytest.mark.parametrize("groups, ref", [(1, "layer"), (6, "instance")])
def test_extreme_groups_are_layer_and_instance_norm(groups, ref):
    net = make_net()
    gn = replace_batchnorm(net.bn, groups=groups)
    x = torch.randn(3, 6, 4, 5, dtype=D)
    if ref == "layer":
        want = F.layer_norm(x, x.shape[1:], eps=gn.eps)
    else:
        want = F.instance_norm(x, eps=gn.eps)
    want = want * gn.weight[:, None, None] + gn.bias[:, None, None]
    assert_close(gn(x), want)


def sq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1) * 0.5 + 0.3 * out.pow(3).sum(1)


def test_track_on_converted_model_matches_per_example_loop():
    net = make_net()
    out = replace_batchnorm(net)
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    x, y = torch.randn(5, 3, 4, 4, generator=g, dtype=D), torch.randn(5, 3, generator=g, dtype=D)
    ref = per_example_grads(out, lambda o, t: sq_loss(o, t).sum(), x, y)
    assert out.training
    with gradkit.per_example.track(out, "variance", "batch_l2") as stats:
        sq_loss(out(x), y).mean().backward()
    assert set(stats) == set(ref)
    assert_close(
        {n: stats[n].variance for n in ref},
        {n: g.var(0, unbiased=False) for n, g in ref.items()},
        rtol=1e-10,
        atol=1e-12,
    )
    assert_close(
        stats.batch_l2(), sum(g.flatten(1).square().sum(1) for g in ref.values()), rtol=1e-10
    )


def test_original_model_is_refused_by_track_in_training_mode():
    net = make_net()
    x = torch.randn(5, 3, 4, 4, dtype=D)
    with (
        pytest.raises(GradkitError, match="BatchNorm2d"),
        gradkit.per_example.track(net, "variance", "batch_l2"),
    ):
        net(x).sum().backward()


def test_batchnorm1d_on_flat_features():
    """BatchNorm1d on ``[N, C]``: GroupNorm normalizes the C/G channels of each group."""
    net = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6)).double()
    out = replace_batchnorm(net, groups=2)
    x = torch.randn(4, 3, dtype=D)
    h = out[0](x).view(4, 2, 3)
    want = (h - h.mean(2, keepdim=True)) / (h.var(2, unbiased=False, keepdim=True) + 1e-5).sqrt()
    assert_close(out(x), want.view(4, 6) * out[1].weight + out[1].bias)


def test_track_batchnorm1d_on_flat_features():
    """Tracking the GroupNorm that replaced a BatchNorm1d on ``[N, C]`` (no positions to sum
    over): per-example gradients match the loop, and ``p.grad`` is what plain autograd gives."""
    net = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6)).double()
    out = replace_batchnorm(net, groups=2)
    x = torch.randn(4, 3, dtype=D)
    ref = per_example_grads(out, lambda o, t: o.pow(3).sum(), x, None)
    out(x).pow(3).sum().backward()
    plain = {n: p.grad.clone() for n, p in out.named_parameters()}
    out.zero_grad()
    with gradkit.per_example.track(out, "batch_grad", loss_reduction="sum") as stats:
        out(x).pow(3).sum().backward()
    assert_close({n: stats[n].batch_grad for n in ref}, ref, rtol=1e-10, atol=1e-12)
    assert_close({n: p.grad for n, p in out.named_parameters()}, plain, rtol=1e-10, atol=1e-12)

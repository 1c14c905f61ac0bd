"""Operators used after the parameters changed in place, and batches of zero examples.

A curvature operator on one batch keeps the graph of its construction; after an optimizer
step, ``p.add_`` under ``no_grad`` or an edit of ``p.data`` its products must be those of the
model as it is now (it rebuilds the graph), never the old curvature, a mix, or autograd's
"modified by an inplace operation". The oracle is always a fresh operator or a dense float64
Hessian from ``torch.func`` at the new values. The functions built on the operators
(:func:`diagonal`, :func:`trace`, :func:`eigenvalues`) inherit this.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import GGN, Fisher, Hessian, diagonal, eigenvalues, spectral_density, trace
from gradkit.testing import assert_close

from ._oracles import D, ce_problem, dense_ggn, dense_hessian


def _gen(seed: int) -> torch.Generator:
    """A seeded generator on the device under test."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def _sgd_step(model: nn.Module, loss_fn: Callable, batch) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.7)
    opt.zero_grad()
    loss_fn(model(batch[0]), batch[1]).backward()
    opt.step()
    opt.zero_grad()


def _data_edit(model: nn.Module, loss_fn: Callable, batch) -> None:
    for p in model.parameters():
        p.data.mul_(1.5).add_(0.1)  # no version counter sees this


def _add_under_no_grad(model: nn.Module, loss_fn: Callable, batch) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))


CHANGES = {"sgd-step": _sgd_step, "data-edit": _data_edit, "add-no-grad": _add_under_no_grad}


@pytest.mark.parametrize("change", list(CHANGES))
def test_hessian_and_ggn_follow_the_model_after_an_in_place_change(change):
    model, loss_fn, batch = ce_problem()
    H, G = Hessian(model, loss_fn, batch), GGN(model, loss_fn, batch)
    P = H.shape[0]
    v = torch.randn(P, dtype=D)
    assert_close(
        [H @ v, G @ v],
        [dense_hessian(model, loss_fn, [batch]) @ v, dense_ggn(model, loss_fn, batch) @ v],
    )
    CHANGES[change](model, loss_fn, batch)
    H_new, G_new = dense_hessian(model, loss_fn, [batch]), dense_ggn(model, loss_fn, batch)
    V = torch.randn(P, 3, dtype=D)
    assert_close([H @ v, H @ V, G @ v, G @ V], [H_new @ v, H_new @ V, G_new @ v, G_new @ V])
    assert_close([H.dense(), G.dense()], [H_new, G_new])


@pytest.mark.parametrize("change", ["sgd-step", "data-edit"])
def test_diagonal_trace_and_eigenvalues_inherit_the_check(change):
    model, loss_fn, batch = ce_problem()
    H, G = Hessian(model, loss_fn, batch), GGN(model, loss_fn, batch)
    gen = lambda: _gen(0)
    before = (eigenvalues(H, k=2, generator=gen()), diagonal(G).value)
    CHANGES[change](model, loss_fn, batch)
    H_new, G_new = dense_hessian(model, loss_fn, [batch]), dense_ggn(model, loss_fn, batch)
    top = torch.linalg.eigvalsh(H_new).flip(0)[:2]
    assert_close(eigenvalues(H, k=2, generator=gen()), top, rtol=1e-8, atol=1e-10)
    assert not torch.allclose(before[0], top)
    assert_close(diagonal(H).value, H_new.diagonal())
    assert_close(diagonal(G).value, G_new.diagonal())
    assert not torch.allclose(before[1], G_new.diagonal())
    assert_close(trace(H, method="exact").value, H_new.trace())
    fresh = Hessian(model, loss_fn, batch)
    assert_close(trace(H, 9, generator=gen()).value, trace(fresh, 9, generator=gen()).value)
    sd, sd_fresh = (spectral_density(op, probes=1, steps=5, generator=gen()) for op in (H, fresh))
    assert_close(sd.nodes, sd_fresh.nodes)


def test_fisher_follows_the_model_with_the_same_samples():
    model, loss_fn, batch = ce_problem()
    F_mc = Fisher(model, loss_fn, batch, samples=4, generator=_gen(3))
    F_emp = Fisher(model, loss_fn, batch, kind="empirical")
    F_mc.dense()
    _sgd_step(model, loss_fn, batch)
    fresh = Fisher(model, loss_fn, batch, samples=4, generator=_gen(3))
    assert_close(F_mc.dense(), fresh.dense())
    assert_close(F_emp.dense(), Fisher(model, loss_fn, batch, kind="empirical").dense())


class _ModeScale(nn.Module):
    """Scales by a buffer in eval mode and by twice it in training mode (like dropout or batch
    norm, the function depends on the mode and on a buffer, deterministically)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((6,), 0.5, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * (2.0 if self.training else 1.0)


def test_train_eval_switch_and_buffers_rebuild_the_graph():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), _ModeScale(), nn.Tanh(), nn.Linear(6, 3)).to(D)
    model.eval()
    x, y = torch.randn(10, 4, dtype=D), torch.randint(0, 3, (10,))
    H = Hessian(model, F.cross_entropy, (x, y))
    H.dense()
    model.train()
    assert_close(H.dense(), dense_hessian(model, F.cross_entropy, [(x, y)]))
    model.eval()
    with torch.no_grad():
        model[1].scale.mul_(4.0)
    assert_close(H.dense(), dense_hessian(model, F.cross_entropy, [(x, y)]))
    model[1].scale.data.fill_(0.1)  # no version counter sees this one
    assert_close(H.dense(), dense_hessian(model, F.cross_entropy, [(x, y)]))


def test_a_replaced_parameter_is_refused_and_state_is_kept():
    model, loss_fn, batch = ce_problem()
    H = Hessian(model, loss_fn, batch)
    old = model[0].weight
    model[0].weight = nn.Parameter(old.detach() + 1)
    v = torch.randn(H.shape[0], dtype=D)
    with pytest.raises(GradkitError, match=r"Hessian\(Sequential\): parameter '0.weight' is no"):
        H @ v
    with pytest.raises(GradkitError, match=r"build a new operator"):
        diagonal(H)
    with pytest.raises(GradkitError, match=r"parameter '0.weight' is no longer"):
        eigenvalues(H, k=1)


@pytest.mark.parametrize("op_type", [Hessian, GGN])
@pytest.mark.parametrize("change", ["frozen", "cast"])
def test_a_frozen_or_cast_parameter_is_refused_everywhere(op_type, change):
    # found by a probe: after freezing a parameter, products, dense and eigenvalues raised
    # autograd's bare "does not require grad" while diagonal() and trace() still answered
    # over all parameters; after model.float(), products raised torch's bare dtype mismatch
    model, loss_fn, batch = ce_problem()
    op = op_type(model, loss_fn, batch)
    want = op.dense()
    if change == "frozen":
        model[0].weight.requires_grad_(False)
        words = r"parameter '0.weight' no longer requires grad .*unfreeze it"
    else:
        model.float()
        words = r"parameter '0.weight' is torch.float32 on \S+ now; the operator was built for"
    v = torch.randn(op.shape[0], dtype=D)
    for call in (
        lambda: op @ v,
        op.dense,
        lambda: diagonal(op),
        lambda: trace(op, method="exact"),
        lambda: eigenvalues(op, k=1),
    ):
        with pytest.raises(GradkitError, match=words):
            call()
    if change == "frozen":
        model[0].weight.requires_grad_(True)
    else:
        model.double()
    assert_close(op.dense(), want, rtol=1e-12, atol=1e-14)


def test_several_batches_follow_the_model_too():
    model, loss_fn, (x, y) = ce_problem()
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    H = Hessian(model, loss_fn, batches)
    v = torch.randn(H.shape[0], dtype=D)
    H @ v
    _sgd_step(model, loss_fn, (x, y))
    assert_close(H @ v, dense_hessian(model, loss_fn, batches) @ v)


def test_a_tensor_captured_by_the_loss_modified_in_place_is_worded():
    model, _, (x, y) = ce_problem()
    weight = torch.ones(3, dtype=D, requires_grad=True)
    loss = lambda out, t: F.cross_entropy(out * weight, t)
    H = Hessian(model, loss, (x, y))
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(GradkitError, match=r"modified in place after the operator was built"):
        H @ torch.randn(H.shape[0], dtype=D)


@pytest.mark.parametrize("op", [Hessian, GGN, Fisher])
def test_an_empty_batch_is_refused_at_construction(op):
    model, loss_fn, (x, y) = ce_problem()
    kw = {"kind": "empirical"} if op is Fisher else {}
    with pytest.raises(ValueError, match=r"data: expected a batch of at least one example, got a"):
        op(model, loss_fn, (x[:0], y[:0]), **kw)
    with pytest.raises(ValueError, match=r"data\[1\]: expected a batch of at least one example"):
        op(model, loss_fn, [(x, y), (x[:0], y[:0])], **kw)
    with pytest.raises(ValueError, match=r"data: expected at least one batch, got an empty list"):
        op(model, loss_fn, [], **kw)
    summed = lambda o, t: F.cross_entropy(o, t, reduction="sum")
    with pytest.raises(ValueError, match=r"a batch of 0 examples"):
        op(model, summed, (x[:0], y[:0]), reduction="sum", **kw)

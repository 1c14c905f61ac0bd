"""An HVPOperator is the Hessian at one point: after that point changed in place (an optimizer
step, an edit of ``p.data``), its products raise a GradkitError instead of autograd's
"modified by an inplace operation" or a silent mix of old and new values; the estimators built
on it inherit the check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import diagonal, eigenvalues, trace
from gradkit.func import hvp_operator, module_hessian, module_hvp_operator
from gradkit.testing import assert_close

D = torch.float64


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    batch = (torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,)))
    return model, batch


def _step(model, batch):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    opt.step()


def _edit_data(model, batch):
    model[2].bias.data.add_(torch.tensor([1.0, -1.0], dtype=D))  # bumps no version counter


def _add_no_grad(model, batch):
    with torch.no_grad():
        model[0].weight.mul_(1.1)


def _new_parameter(model, batch):
    # the old tensor keeps its version and values: only its identity tells (products were the
    # old model's, 3.0 off)
    model[2].weight = nn.Parameter(torch.randn(2, 4, dtype=D))


def _swap_layer(model, batch):
    model[2] = nn.Linear(4, 2).to(D)


CHANGES = {
    "sgd-step": _step,
    "data-edit": _edit_data,
    "add-no-grad": _add_no_grad,
    "new-parameter": _new_parameter,
    "swap-layer": _swap_layer,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_module_operator_refuses_products_after_the_parameters_changed(change):
    model, batch = _problem()
    op = module_hvp_operator(model, F.cross_entropy, batch)
    ref = module_hessian(model, F.cross_entropy, batch, flat=True)
    assert_close(op.to_dense(), ref)
    CHANGES[change](model, batch)
    v = torch.randn(op.shape[0], dtype=D)
    with pytest.raises(GradkitError, match=r"module_hvp_operator\(Sequential\) @ v: the operator "):
        op @ v
    with pytest.raises(GradkitError, match=r"module_hvp_operator\(model, loss_fn, batch\)"):
        op.to_dense()
    for estimate in (
        lambda: diagonal(op),
        lambda: trace(op, 9),
        lambda: eigenvalues(op, k=1),
    ):
        with pytest.raises(GradkitError, match=r"built at other values"):
            estimate()
    # a new operator is the Hessian at the new values
    assert_close(
        module_hvp_operator(model, F.cross_entropy, batch).to_dense(),
        module_hessian(model, F.cross_entropy, batch, flat=True),
    )


def test_a_mode_switch_is_refused_too():
    model, batch = _problem()
    op = module_hvp_operator(model, F.cross_entropy, batch)
    model.eval()
    with pytest.raises(GradkitError, match=r"switched between train\(\) and eval\(\)"):
        op @ torch.randn(op.shape[0], dtype=D)


def test_a_function_operator_checks_the_parameters_it_captures():
    model, (x, y) = _problem()
    op = hvp_operator(lambda t: F.cross_entropy(model(x) * t, y), torch.ones(2, dtype=D))
    op.to_dense()
    with torch.no_grad():
        model[2].weight.add_(1.0)
    with pytest.raises(GradkitError, match=r"hvp_operator\(<lambda>\) @ v: .*captured"):
        op @ torch.ones(2, dtype=D)


def test_edits_of_the_arguments_do_not_move_the_point():
    # hvp_operator differentiates a copy of args: the operator stays the Hessian at the point
    x = torch.tensor([1.0, 2.0], dtype=D)
    op = hvp_operator(lambda t: (t**3).sum(), x)
    x.add_(5.0)
    assert_close(op @ torch.eye(2, dtype=D), torch.diag(torch.tensor([6.0, 12.0], dtype=D)))


def test_a_saved_tensor_modified_in_place_is_worded():
    w = torch.ones(3, dtype=D)
    op = hvp_operator(lambda t: (t * w).sin().sum(), torch.ones(3, dtype=D))
    w.mul_(2.0)  # no gradient, so not tracked: autograd's version check of the graph sees it
    with pytest.raises(GradkitError, match=r"modified in place after the operator was built"):
        op @ torch.ones(3, dtype=D)

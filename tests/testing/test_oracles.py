"""The oracles themselves: checked against closed forms, and shown able to fail."""

import pytest
import torch
from torch import nn

from gradkit.testing import (
    assert_close,
    finite_difference_grad,
    finite_difference_hvp,
    finite_difference_jacobian,
    per_example_grads,
    tolerances,
)


def test_per_example_grads_closed_form_linear_mse():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    g = per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(), x, y)
    w, b = model.weight.detach().double(), model.bias.detach().double()
    r = 2 * (x.double() @ w.T + b - y.double())  # [5, 2]
    assert_close(g["weight"], torch.einsum("no,ni->noi", r, x.double()))
    assert_close(g["bias"], r)
    assert model.weight.dtype == torch.float32  # the original is untouched


def test_per_example_grads_batch_dim_and_frozen():
    model = nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    x = torch.randn(2, 4)  # examples along dim 1
    g = per_example_grads(model, lambda o, t: o.sum(), x.T.contiguous(), None)
    g1 = per_example_grads(
        nn.Sequential(model), lambda o, t: o.sum(), x.T.contiguous(), None, dtype=None
    )
    assert list(g) == ["weight"] and g["weight"].shape == (4, 1, 2)
    assert_close(g["weight"].float(), g1["0.weight"])


def test_finite_differences_match_closed_forms():
    x = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    assert_close(
        finite_difference_grad(lambda z: (z.sin()).sum(), x), x.cos(), rtol=1e-8, atol=1e-9
    )
    J = finite_difference_jacobian(lambda z: z.exp().reshape(3, 1), x)
    assert J.shape == (3, 1, 3)
    v = torch.tensor([1.0, 0.5, -1.0], dtype=torch.float64)
    assert_close(
        finite_difference_hvp(lambda z: (z**4).sum(), x, v), 12 * x**2 * v, rtol=1e-7, atol=1e-8
    )


def test_tolerance_policy():
    assert tolerances(torch.float64)[0] == 1e-10
    assert tolerances(torch.float32)[0] == 1e-5
    assert tolerances(torch.bfloat16)[0] == 1e-2
    with pytest.raises(ValueError, match="compare integer results exactly"):
        tolerances(torch.int64)


def test_assert_close_reports_every_mismatch_and_structure():
    with pytest.raises(AssertionError, match=r"2 of 3 entries differ") as info:
        assert_close(
            {"a": torch.ones(2), "b": torch.zeros(2), "c": None},
            {"a": torch.zeros(2), "b": torch.ones(2), "c": None},
        )
    assert "['a']" in str(info.value) and "['b']" in str(info.value)
    with pytest.raises(AssertionError, match="structures differ"):
        assert_close([torch.ones(1)], [torch.ones(1), torch.ones(1)])
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.ones(2), torch.ones(3))
    with pytest.raises(AssertionError, match="None"):
        assert_close([None], [torch.ones(1)])
    # float32 tolerance is tighter than a 1e-4 relative error
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1.0]), torch.tensor([1.0001]))
    assert_close(torch.tensor([1.0]), torch.tensor([1.000001]))

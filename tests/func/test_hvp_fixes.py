"""HVP operators refuse vectors of another dtype; errors of hvp, hvp_operator, hessians and
jacobian name the call and what went wrong, not torch's internals."""

import pytest
import torch

from gradkit import GradkitError
from gradkit.func import hessians, hvp, hvp_operator, jacobian
from gradkit.testing import assert_close

D = torch.float64


def cube(t):
    return (t**3).sum()


def test_operator_refuses_a_vector_of_another_dtype():
    """A float64 v was rounded to a float32 operator's dtype, silently (hvp refuses it)."""
    op = hvp_operator(cube, torch.tensor([1.0, 2.0]))
    v = torch.tensor([1 / 3, 0.1], dtype=D)
    for product in (lambda: op @ v, lambda: op.matvec(v), lambda: op @ v[:, None]):
        with pytest.raises(
            TypeError,
            match=r"^hvp_operator\(cube\) @ v: v: expected dtype torch.float32 \(that of the "
            r"operator\), got Tensor\(shape=\(2,(| 1)\), dtype=torch.float64\); convert it with "
            r"v.to\(torch.float32\)",
        ):
            product()
    with pytest.raises(TypeError, match="expected dtype torch.float32"):
        op @ torch.tensor([1, 0])
    # in the operator's dtype: 6 x v, the Hessian of sum(x**3) at x = (1, 2) being diag(6, 12)
    assert_close(op @ v.float(), torch.tensor([6.0, 12.0]) * v.float())
    with pytest.raises(TypeError, match=r"v\[0\]: expected dtype torch.float32"):
        hvp(cube, torch.tensor([1.0, 2.0]), v)


@pytest.mark.parametrize("method", ["reverse_over_reverse", "forward_over_reverse"])
def test_hvp_of_a_function_that_modifies_its_argument_is_worded(method):
    x = torch.tensor([1.0, 2.0], dtype=D)
    with pytest.raises(
        GradkitError,
        match=r"^hvp\(<lambda>\): f: expected a function that leaves its arguments unchanged",
    ):
        hvp(lambda t: t.pow_(3).sum(), x, torch.ones(2, dtype=D), method=method)
    x = torch.tensor([1.0, 2.0], dtype=D)
    # out of place, as the message says: the oracle's value
    _, hv = hvp(lambda t: t.pow(3).sum(), x, torch.ones(2, dtype=D), method=method)
    assert_close(hv, torch.func.hessian(cube)(x) @ torch.ones(2, dtype=D))


@pytest.mark.parametrize("count", [1, 2], ids=["one arg", "two args"])
def test_hvp_operator_of_a_function_that_modifies_its_argument_is_worded(count):
    args = torch.ones(2, dtype=D) if count == 1 else (torch.ones(2, dtype=D),) * 2
    with pytest.raises(
        GradkitError,
        match=r"^hvp_operator\(<lambda>\): f: expected a function that leaves its arguments "
        r"unchanged",
    ):
        hvp_operator(lambda t, *rest: t.pow_(3).sum(), args)


def test_hessians_on_a_freed_graph_names_hessians():
    """The error named gradients(ys, xs), a call the user did not make."""
    x = torch.tensor([1.0, 2.0], dtype=D, requires_grad=True)
    y = (x**3).sum()
    y.backward()
    with pytest.raises(GradkitError, match=r"^hessians\(ys, xs\): the graph of ys was freed"):
        hessians(y, x)
    (h,) = hessians((x**3).sum(), x)
    assert_close(h, torch.func.hessian(cube)(x.detach()))


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_jacobian_of_a_dict_output_describes_it(mode):
    """The message printed torch.func's internal GradTrackingTensor wrapper."""
    with pytest.raises(TypeError) as info:
        jacobian(lambda t: {"a": t * 2}, torch.ones(2), mode=mode)
    text = str(info.value)
    assert "Tracking" not in text and "Batched" not in text
    assert "expected a function returning one tensor, got dict{'a': Tensor(shape=(2,)" in text

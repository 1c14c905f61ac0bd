"""batch_jacobian's precondition (output row i depends on input row i only) is checked: a
function that mixes rows raises instead of returning zeros or sums for the cross terms; a
row-wise function passes and equals the diagonal blocks of the full Jacobian."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.func import batch_jacobian, jacobian
from gradkit.testing import assert_close

D = torch.float64


def _diagonal_blocks(full: torch.Tensor, x: torch.Tensor, out_shape: torch.Size) -> torch.Tensor:
    """The blocks ``J[i, ..., i, ...]`` of a full Jacobian ``[b, *O, b, *X]``, as
    ``[b, *O, *X]``."""
    b = x.shape[0]
    flat = full.reshape(b, out_shape.numel() // b, b, x[0].numel())
    blocks = torch.stack([flat[i, :, i] for i in range(b)])
    return blocks.reshape(b, *out_shape[1:], *x.shape[1:])


def _centered(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0)


def _softmax_over_batch(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=0)


def _batch_norm_train(x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, training=True)


def _pair_only(x: torch.Tensor) -> torch.Tensor:
    """Couples rows 1 and 2 only: a probe on one fixed row could miss it."""
    out = x.sin()
    return torch.cat([out[:1], out[1:3] + out[1:3].flip(0) * 0.5, out[3:]])


MIXING = {
    "centered": _centered,
    "softmax-dim0": _softmax_over_batch,
    "batch-norm-train": _batch_norm_train,
    "pair-only": _pair_only,
}


@pytest.mark.parametrize("mode", ["auto", "reverse", "forward"])
@pytest.mark.parametrize("name", list(MIXING))
def test_functions_that_mix_rows_raise(name, mode):
    x = torch.randn(5, 3, dtype=D)
    with pytest.raises(GradkitError, match=r"batch_jacobian\(_.*\): f: expected a function whose "):
        batch_jacobian(MIXING[name], x, mode=mode)


def test_the_message_names_the_rows_and_the_way_out():
    x = torch.randn(5, 3, dtype=D)
    with pytest.raises(GradkitError) as info:
        batch_jacobian(_pair_only, x)
    text = str(info.value)
    assert "rows [1, 2] of x" in text
    assert "jacobian(f, x)" in text and "check_independence=False" in text


def test_batch_norm_module_in_training_mode_raises_a_gradkit_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(D)
    x = torch.randn(6, 3, dtype=D)
    with pytest.raises(GradkitError, match=r"batch_jacobian\(Sequential\): .*eval"):
        batch_jacobian(model, x)
    model.eval()  # running statistics: row-wise again
    full = jacobian(model, x)
    assert_close(batch_jacobian(model, x), _diagonal_blocks(full, x, model(x).shape))


@pytest.mark.parametrize("mode", ["auto", "reverse", "forward"])
def test_row_wise_functions_pass_and_equal_the_full_jacobians_diagonal_blocks(mode):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 2)).to(D)
    conv = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten()).to(D)
    for f, x in ((mlp, torch.randn(6, 3, dtype=D)), (conv, torch.randn(4, 2, 5, dtype=D))):
        want = _diagonal_blocks(jacobian(f, x), x, f(x).shape)
        assert_close(batch_jacobian(f, x, mode=mode), want)


def test_float32_models_pass_the_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 200), nn.Tanh(), nn.Linear(200, 20))
    x = 10 * torch.randn(64, 30)
    for mode in ("reverse", "forward"):
        assert batch_jacobian(model, x, mode=mode).shape == (64, 20, 30)


def test_opting_out_returns_the_blocks_without_the_extra_product():
    x = torch.randn(4, 3, dtype=D)
    J = batch_jacobian(_centered, x, check_independence=False, mode="reverse")
    # the per-row sum of the full Jacobian's blocks over output rows: zero for x - mean(x)
    assert_close(J, torch.zeros(4, 3, 3, dtype=D))
    with pytest.raises(TypeError, match=r"check_independence: expected a bool, got 'no'"):
        batch_jacobian(torch.sin, x, check_independence="no")


def test_one_row_and_functions_under_vmap_are_not_checked():
    x = torch.randn(1, 3, dtype=D)
    assert_close(batch_jacobian(_centered, x), torch.zeros(1, 3, 3, dtype=D))
    xs = torch.randn(2, 4, 3, dtype=D)
    out = torch.func.vmap(lambda t: batch_jacobian(torch.sin, t))(xs)
    assert_close(out, torch.diag_embed(xs.cos()))


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError, match=r"batch_jacobian\(sin\): x: expected .* at least one row"):
        batch_jacobian(torch.sin, torch.ones(0, 2))

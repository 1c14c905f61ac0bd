"""The window the trainer callbacks drive: a tracked step left open is not merged into the
next one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradkit.integrations._common import MonitorWindow

D = torch.float64


def test_a_step_left_open_is_dropped_not_merged_into_the_next():
    """A tracked step that never reached its optimizer step (the loop left it or skipped it):
    ``start`` of the next step did nothing while it was open, and the next record counted the
    old micro-batches too (8 examples for 4, the norm of their mean)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = torch.randn(8, 3, dtype=D), torch.randint(0, 2, (8,))
    window = MonitorWindow(1, None, ("variance", "batch_l2"), True, False, {}, "Callback()")
    window.attach(model)
    window.start(0)
    (nn.functional.cross_entropy(model(x[:4]), y[:4]) / 2).backward()  # no optimizer step
    model.zero_grad()
    with pytest.warns(UserWarning, match="tracked step 0 did not reach its optimizer step"):
        window.start(1)
    loss = nn.functional.cross_entropy(model(x[4:]), y[4:])
    loss.backward()
    numbers = window.finish()
    assert numbers is not None and numbers["gradkit/examples"] == 4
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert numbers["gradkit/grad_norm"] == pytest.approx(float(grads.norm()), rel=1e-10)
    assert [r["step"] for r in window.monitor.records] == [1]
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0

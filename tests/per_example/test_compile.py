"""``track`` on a model run through ``torch.compile``: the statistics equal the one-example-at-a-
time oracle, and ``p.grad`` equals an untracked compiled backward's.

The hooks ``track`` installs are module hooks; Dynamo traces through them (or breaks the graph
there), so a compiled model is tracked like an eager one. ``aot_eager`` checks the tracing
quickly; ``inductor`` (the default backend, C++ code generation) is what users run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradkit.per_example import track
from gradkit.testing import per_example_grads


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()


# torch.compile imports parts of torch.jit that warn about their own deprecation
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
# Dynamo reads .grad of a non-leaf input while it traces a region after a graph break
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_gives_the_oracle_statistics(backend: str) -> None:
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    compiled = torch.compile(model, backend=backend)
    with track(model, "variance", "batch_l2", "batch_grad") as stats:
        F.cross_entropy(compiled(x), y).backward()
    tracked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = per_example_grads(model, lambda o, t: F.cross_entropy(o, t), x, y)
    l2 = sum(g.flatten(1).square().sum(1) for g in ref.values())
    for name, g in ref.items():
        st = stats[name]
        torch.testing.assert_close(st.batch_grad, g, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(st.variance, g.var(0, unbiased=False), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(stats.batch_l2(), l2, rtol=1e-10, atol=1e-12)

    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    F.cross_entropy(torch.compile(plain, backend=backend)(x), y).backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(tracked_grads[name], p.grad, rtol=1e-12, atol=1e-14)
    torch._dynamo.reset()

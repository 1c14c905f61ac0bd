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

from gradkit import GradkitError
from gradkit.per_example import _fused, track
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
@pytest.mark.parametrize("fused", [False, True], ids=["autograd", "fused"])
def test_compiled_model_gives_the_oracle_statistics(
    backend: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fused``: the layers' weight gradients summed from the statistics (as a model of
    real size has them), through the compiled graph's breaks at the hooks."""
    if fused:
        monkeypatch.setattr(_fused, "MIN_PRODUCT", 0)
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


_COMPILE_WARNINGS = (
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning",
)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


@pytest.mark.filterwarnings(*_COMPILE_WARNINGS)
def test_code_compiled_before_the_block_is_refused_with_what_to_do() -> None:
    """torch.compile reuses code compiled without hooks (it does not guard on hooks added
    later): the block sees no example, and the error says why and what to do."""
    torch._dynamo.reset()
    model = _model()
    x, y = _data()
    compiled = torch.compile(model, backend="aot_eager")
    F.cross_entropy(compiled(x), y).backward()  # an untracked step compiles first
    with track(model, "variance") as stats:
        F.cross_entropy(compiled(x), y).backward()
    with pytest.raises(GradkitError, match="skip_nnmodule_hook_guards .* set it to False"):
        _ = stats["0.weight"].variance
    torch._dynamo.reset()


@pytest.mark.filterwarnings(*_COMPILE_WARNINGS)
def test_tracked_and_untracked_steps_of_one_compiled_model_alternate() -> None:
    """With hook guards on, tracked and untracked calls compile once each and alternate: every
    tracked step gives the oracle's statistics, every untracked one only p.grad."""
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        for step in range(4):
            x, y = _data()
            model.zero_grad(set_to_none=True)
            if step % 2 == 0:
                F.cross_entropy(compiled(x), y).backward()
                continue
            with track(model, "variance", "batch_l2") as stats:
                F.cross_entropy(compiled(x), y).backward()
            ref = per_example_grads(model, lambda o, t: F.cross_entropy(o, t), x, y)
            for name, g in ref.items():
                var = g.var(0, unbiased=False)
                torch.testing.assert_close(stats[name].variance, var, rtol=1e-9, atol=1e-12)
                torch.testing.assert_close(model.get_parameter(name).grad, g.mean(0))
            l2 = sum(g.flatten(1).square().sum(1) for g in ref.values())
            torch.testing.assert_close(stats.batch_l2(), l2, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_many_tracked_modules_do_not_recompile_gradkits_hooks() -> None:
    """Twelve tracked layers: the hooks run eagerly without Dynamo compiling a frame per
    module (a wrapper compiled per closure hit the recompile limit of 8 and warned)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(12)]).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    compiled = torch.compile(model, backend="eager")
    with (
        torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True),
        track(model, "variance", loss_reduction="sum") as stats,
    ):
        compiled(x).pow(2).sum().backward()
    ref = per_example_grads(model, lambda o, _: o.pow(2).sum(), x, None)
    for name, g in ref.items():
        torch.testing.assert_close(stats[name].variance, g.var(0, unbiased=False))


def test_tracking_an_eager_model_does_not_load_dynamo() -> None:
    """torch.compiler.disable imports Dynamo (70 MiB of a process): a process that never
    compiles must not pay it for track()."""
    import subprocess
    import sys

    code = (
        "import sys, torch, gradkit\n"
        "m = torch.nn.Linear(3, 2)\n"
        "with gradkit.per_example.track(m, 'variance'):\n"
        "    m(torch.randn(4, 3)).pow(2).sum().backward()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False", run.stdout + run.stderr

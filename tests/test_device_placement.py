"""Results live on the device of the tensors they come from, never on the default one.

The GPU test run sets the default device to CUDA (``GRADKIT_TEST_DEVICE=cuda``), so a tensor
the library creates without ``device=`` lands on the GPU there and the run cannot see the bug a
user meets (whose default device stays the CPU). Two checks stand in for it on every machine:

* a static one: every tensor factory in the library (``torch.zeros``, ``torch.tensor``, ...)
  names its device (``device="cpu"`` for a host tensor, which a user's default device must not
  move either), or is listed below with the reason it follows the default device;
* a simulated one: a model on the ``meta`` device (values-free, but a CPU tensor mixed into its
  results is an error or shows in ``.device``) is tracked through the paths that create
  tensors of their own: a module the loss does not reach (zeros for each of its examples).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from gradkit import per_example
from gradkit.optim import adam, rmsprop
from gradkit.per_example._stats import PowerSums

pytestmark = pytest.mark.cpu_only  # the meta device is the stand-in for another device

SRC = Path(__file__).resolve().parents[1] / "src" / "gradkit"
FACTORIES = {
    "arange",
    "as_tensor",
    "empty",
    "empty_strided",
    "eye",
    "full",
    "linspace",
    "normal",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "scalar_tensor",
    "tensor",
    "zeros",
}
# not library code: scripts and the CLI build their data on the CPU and move it themselves
OUTSIDE = ("_bench/", "cli/", "_digits.py")
# (file, call) -> why this tensor follows torch's default device (a tensor meant for the host
# names device="cpu": see tests/test_default_device.py)
ON_THE_DEFAULT_DEVICE = {
    ("accumulate/_sizing.py", "torch.empty(0)"): "a model without parameters: the default device",
    ("curvature/_fisher.py", "torch.randint(0, 2 ** 62, (), **kw)"): "kw names the device",
    ("hyper/_projections.py", "torch.zeros(1, dtype=torch.float64)"): "probes a user's function",
}


def _factory_calls() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(OUTSIDE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id == "torch"):
                continue
            if node.func.attr in FACTORIES and all(k.arg != "device" for k in node.keywords):
                found.append((rel, ast.unparse(node), node.lineno))
    return found


def test_every_tensor_factory_names_its_device_or_says_why_not():
    calls = _factory_calls()
    assert len(calls) >= len(ON_THE_DEFAULT_DEVICE) // 2  # the walk finds them at all
    unlisted = [
        f"{rel}:{n}: {call}" for rel, call, n in calls if (rel, call) not in ON_THE_DEFAULT_DEVICE
    ]
    assert not unlisted, (
        "tensors created without device= (a CPU tensor beside a GPU model's): pass the device "
        "of the tensors they go with, or list them in ON_THE_DEFAULT_DEVICE with the reason\n"
        + "\n".join(unlisted)
    )
    stale = set(ON_THE_DEFAULT_DEVICE) - {(rel, call) for rel, call, _ in calls}
    assert not stale, (
        f"ON_THE_DEFAULT_DEVICE lists calls the library no longer makes: {sorted(stale)}"
    )


class _Branches(nn.Module):
    """Two heads, one used per call: the other's examples all have zero gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


@pytest.mark.parametrize("quantity", ["mean", "variance", "second_moment", "batch_grad"])
def test_a_module_the_loss_does_not_reach_has_statistics_on_the_models_device(quantity):
    model = _Branches().to("meta")
    with per_example.track(model, quantity, "batch_l2") as stats:
        model(torch.empty(5, 4, device="meta")).sum().backward()
    for name in ("a.weight", "b.weight", "b.bias"):
        assert getattr(stats[name], quantity).device.type == "meta", name
        assert stats[name].batch_l2.device.type == "meta", name
    assert stats.batch_l2().device.type == "meta"  # summed over both heads


def test_an_accumulator_without_examples_gives_empty_results_on_its_device():
    owner = nn.Parameter(torch.empty(3, 2, device="meta"))
    acc = PowerSums(owner.shape, torch.float32, owner=owner)
    assert acc.device.type == "meta"
    assert acc.zeros(0, *acc.shape).device.type == "meta"
    assert PowerSums(owner.shape, torch.float32).device == torch.device("cpu")  # no owner


@pytest.mark.parametrize(
    "make",
    [
        lambda: adam(lr=1e-3, betas=(torch.tensor(0.9), 0.999)),
        lambda: adam(betas=(torch.full((3,), 0.9), 0.999)),  # a schedule: one value per step
        lambda: rmsprop(alpha=torch.tensor(0.99), centered=True),
    ],
    ids=["adam_beta1", "adam_beta1_schedule", "rmsprop_centered_alpha"],
)
def test_a_cpu_scalar_hyperparameter_beside_another_devices_parameters(make):
    """``torch.tensor(0.9)`` (the README's hyperparameters) stands beside CUDA tensors as a
    0-dim tensor, but ``lerp`` expanded it to the parameter's shape on the CPU: Adam's and
    centered RMSprop's steps raised on mixing devices (found on an H200)."""
    params = {"w": torch.zeros(4, 3, device="meta")}
    grads = {"w": torch.ones(4, 3, device="meta")}
    opt = make()
    new, _ = opt.update(grads, opt.init(params), params)
    assert new["w"].device.type == "meta"

"""The public functions of gradkit.func and gradkit.curvature have return types precise enough
for ``mypy --strict`` to accept unpacking and indexing their results (``(h,) = hessians(...)``,
``values, vectors = eigenvalues(..., return_vectors=True)``, ``H["w"]["b"].shape``)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_only  # static type checks

SNIPPET = """
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradkit.curvature import GGN, Hessian, diagonal, eigenvalues, trace
from gradkit.func import (
    batch_jacobian,
    custom_gradient,
    gradients,
    hessian,
    hessians,
    hvp,
    jacobian,
    jvp,
    module_hessian,
    vjp,
)

x = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
(h,) = hessians((x**3).sum(), x)
size: torch.Size = h.shape
(g,) = gradients((x**2).sum(), [x])
g_first: torch.Tensor = gradients((x**2).sum(), x, unconnected_gradients="zero")[0]
step: torch.Tensor = x.detach() - 0.1 * g


def f2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum()


a, b = torch.ones(2), torch.ones(2)
J: torch.Tensor = jacobian(torch.sin, a)
Ja, Jb = jacobian(torch.mul, a, b, argnums=(0, 1))
shapes = (Ja.shape, Jb.shape, batch_jacobian(torch.sin, torch.ones(3, 2)).shape)
Hx: torch.Tensor = hessian(f2, a, b)
(H00, H01), (H10, H11) = hessian(f2, a, b, argnums=(0, 1))
blocks_shape = H01.shape
value, tangent = jvp(torch.sin, a, b)
tangent_shape = tangent.shape
out, cot = vjp(torch.sin, a, b)
cot_shape = cot.shape
out2, (ca, cb) = vjp(torch.mul, (a, b), b)
cot_shapes = (ca.shape, cb.shape)
val, hv = hvp(lambda t: (t**3).sum(), a, b)
hv_shape = hv.shape
val2, (ha, hb) = hvp(f2, (a, b), (b, b))
hvp_shapes = (ha.shape, hb.shape)

model = nn.Linear(2, 1)
data = (torch.ones(3, 2), torch.ones(3, 1))
H_blocks = module_hessian(model, F.mse_loss, data)
cross = H_blocks["weight"]["bias"].shape
H_flat: torch.Tensor = module_hessian(model, F.mse_loss, data, flat=True)


@custom_gradient
def ste(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    return torch.sign(t), lambda dy: dy


y: torch.Tensor = ste(torch.ones(2))

H = Hessian(model, F.mse_loss, data)
Hv: torch.Tensor = H @ torch.ones(3)
Hd = H @ {"weight": torch.ones(1, 2), "bias": torch.ones(1)}
piece = Hd["weight"].shape
values: torch.Tensor = eigenvalues(H, k=1)
values2, vectors = eigenvalues(GGN(model, F.mse_loss, data), k=1, return_vectors=True)
vector_shape = vectors.shape
d: torch.Tensor = diagonal(H).value
t_value: torch.Tensor = trace(H, method="exact").value
"""


def test_results_unpack_and_index_under_mypy_strict(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("mypy")
    (tmp_path / "snippet.py").write_text(SNIPPET)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--allow-untyped-calls",
            "--ignore-missing-imports",
            "--cache-dir",
            str(tmp_path / ".cache"),
            "--config-file",
            "",
            str(tmp_path / "snippet.py"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr

"""Bad inputs to gradkit.curvature: the operators (Hessian, GGN, Fisher) and the functions on
them (diagonal, trace, eigenvalues, spectral_density). A refused call leaves the weights and
the accumulated gradients as they were; rows that must succeed compare with a fresh operator
or a dense float64 Hessian from torch.func (an operator used after an optimizer step gives
the curvature at the new parameters)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from gradkit import GradkitError
from gradkit.curvature import GGN, Hessian, diagonal, eigenvalues, spectral_density, trace
from gradkit.testing import assert_close

from ._case import Built, Case

D = torch.float64


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    for p in model.parameters():  # gradients accumulated before the call must survive it
        p.grad = torch.full_like(p, 0.25)
    return model


def _data(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(n, 3, dtype=D, generator=g), torch.randint(0, 2, (n,), generator=g)


def _state(model: Callable[[], nn.Module]) -> Callable[[], Sequence[torch.Tensor]]:
    return lambda: [t for p in model().parameters() for t in (p, p.grad) if t is not None]


def _dense_hessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The oracle: torch.func's Hessian of the loss at the model's current parameters."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(t: torch.Tensor) -> torch.Tensor:
        parts = t.split([s.numel() for s in shapes])
        ps = {n: q.view(s) for n, q, s in zip(names, parts, shapes, strict=True)}
        return F.cross_entropy(torch.func.functional_call(model, ps, (x,)), y)

    return torch.func.jacrev(torch.func.jacrev(loss))(theta)


def _sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.8)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


# -- operators used after the parameters changed: the curvature at the new values ------------


def _hessian_after_step() -> None:
    model, (x, y) = _mlp(), _data()
    H = Hessian(model, F.cross_entropy, (x, y))
    v = torch.randn(H.shape[0], dtype=D)
    H @ v
    _sgd_step(model, x, y)
    assert_close(H @ v, _dense_hessian(model, x, y) @ v)


def _ggn_after_data_edit() -> None:
    model, (x, y) = _mlp(), _data()
    G = GGN(model, F.cross_entropy, (x, y))
    before = G.dense()
    model[0].weight.data.mul_(3.0)  # bumps no version counter
    after = G.dense()
    assert_close(after, GGN(model, F.cross_entropy, (x, y)).dense())
    assert not torch.allclose(after, before)


def _diagonal_after_step() -> None:
    model, (x, y) = _mlp(), _data()
    H = Hessian(model, F.cross_entropy, (x, y))
    diagonal(H)
    _sgd_step(model, x, y)
    assert_close(diagonal(H).value, _dense_hessian(model, x, y).diagonal())


def _eigenvalues_after_add_no_grad() -> None:
    model, (x, y) = _mlp(), _data()
    H = Hessian(model, F.cross_entropy, (x, y))
    eigenvalues(H, k=1, generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    with torch.no_grad():
        model[2].weight.add_(1.0)
    want = torch.linalg.eigvalsh(_dense_hessian(model, x, y))[-1:]
    got = eigenvalues(H, k=1, generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    assert_close(got, want, rtol=1e-7, atol=1e-9)


@cache
def _replaced() -> Built:
    """A model whose first bias was replaced after its operator was built."""
    model = _mlp()
    op = Hessian(model, F.cross_entropy, _data())
    model[0].bias = nn.Parameter(torch.zeros(4, dtype=D))
    return Built(model, op)


@cache
def _capturing() -> Built:
    """An operator whose loss captures a tensor that was modified after it was built."""
    captured = torch.ones(2, dtype=D, requires_grad=True)
    model = _mlp()
    op = Hessian(model, lambda o, t: F.cross_entropy(o * captured, t), _data())
    with torch.no_grad():
        captured.mul_(2.0)
    return Built(model, op)


def _times_ones(op: Hessian) -> torch.Tensor:
    return op @ torch.ones(op.shape[0], dtype=D)


@cache
def _m() -> nn.Sequential:
    return _mlp()


@cache
def _h() -> Hessian:
    return Hessian(_m(), F.cross_entropy, _data())


_P = 3 * 4 + 4 + 4 * 2 + 2  # the parameters of _mlp()
_META = nn.Linear(3, 2, device="meta")


def _x(n: int = 5) -> torch.Tensor:
    return _data(n)[0]


ROWS: list[Case] = [
    Case("curvature.Hessian.after_optimizer_step", _hessian_after_step),
    Case("curvature.GGN.after_p_data_edit", _ggn_after_data_edit),
    Case("curvature.diagonal.after_optimizer_step", _diagonal_after_step),
    Case("curvature.eigenvalues.after_add_under_no_grad", _eigenvalues_after_add_no_grad),
    Case(
        "curvature.Hessian.replaced_parameter",
        lambda: _times_ones(_replaced().op),
        GradkitError,
        ("Hessian(Sequential)", "'0.bias'", "replaced", "build a new operator"),
        _state(lambda: _replaced().model),
    ),
    Case(
        "curvature.Hessian.tensor_captured_by_loss_modified",
        lambda: _times_ones(_capturing().op),
        GradkitError,
        ("@ v", "captured by loss_fn", "modified", "build a new operator"),
        _state(lambda: _capturing().model),
    ),
    Case(
        "curvature.Hessian.empty_batch",
        lambda: Hessian(_m(), F.cross_entropy, (_x()[:0], _data()[1][:0])),
        ValueError,
        ("Hessian(Sequential)", "data", "0 examples", "at least one example"),
        _state(_m),
    ),
    Case(
        "curvature.GGN.empty_batch_in_list",
        lambda: GGN(_m(), F.cross_entropy, [_data(), (_x()[:0], _data()[1][:0])]),
        ValueError,
        ("GGN(Sequential)", "data[1]", "0 examples", "drop empty batches"),
        _state(_m),
    ),
    Case(
        "curvature.Hessian.empty_list",
        lambda: Hessian(_m(), F.cross_entropy, []),
        ValueError,
        ("data", "at least one batch", "empty list"),
    ),
    Case(
        "curvature.Hessian.targets_rows_mismatch",
        lambda: Hessian(_m(), F.cross_entropy, (_x(), _data()[1][:3])),
        ValueError,
        ("data", "targets with 5 rows", "got Tensor(shape=(3,)"),
        _state(_m),
    ),
    Case(
        "curvature.Hessian.model_is_a_list",
        lambda: Hessian([_m()], F.cross_entropy, _data()),  # type: ignore[arg-type]
        TypeError,
        ("Hessian(list)", "model", "torch.nn.Module"),
    ),
    Case(
        "curvature.Hessian.params_is_an_int",
        lambda: Hessian(_m(), F.cross_entropy, _data(), params=3),  # type: ignore[arg-type]
        TypeError,
        ("params", "a parameter name or a list of names", "got 3"),
    ),
    Case(
        "curvature.Hessian.chunk_size_zero",
        lambda: Hessian(_m(), F.cross_entropy, _data(), chunk_size=0),
        ValueError,
        ("chunk_size", "int >= 1", "got 0"),
    ),
    Case(
        "curvature.GGN.vectorize_string",
        lambda: GGN(_m(), F.cross_entropy, _data(), vectorize="no"),  # type: ignore[arg-type]
        TypeError,
        ("vectorize", "a bool or None", "'no'"),
    ),
    Case(
        "curvature.Hessian.meta_model",
        lambda: Hessian(_META, F.mse_loss, (torch.ones(2, 3), torch.ones(2, 2))),
        ValueError,
        ("model", "meta device", "load_state_dict"),
    ),
    Case(
        "curvature.Hessian.data_on_another_device",
        lambda: Hessian(_m(), F.cross_entropy, (_x().to("meta"), _data()[1].to("meta"))),
        ValueError,
        ("data inputs[0]", "device", "{device}", "meta", ".to('{device}')"),
        _state(_m),
    ),
    Case(
        "curvature.Hessian.data_of_another_dtype",
        lambda: Hessian(_m(), F.cross_entropy, (_x().float(), _data()[1])),
        TypeError,
        ("data inputs[0]", "torch.float64", "float32", ".to(torch.float64)"),
        _state(_m),
    ),
    Case(
        "curvature.trace.probes_zero",
        lambda: trace(_h(), probes=0),
        ValueError,
        ("trace(Hessian(Sequential)", "probes", ">= 5", "got 0"),
        _state(_m),
    ),
    Case(
        "curvature.trace.probes_string",
        lambda: trace(_h(), probes="10"),  # type: ignore[arg-type]
        TypeError,
        ("probes", "an int", "'10'"),
    ),
    Case(
        "curvature.trace.integer_matrix",
        lambda: trace(torch.eye(4, dtype=torch.long), method="hutch++"),
        TypeError,
        ("trace(Tensor", "floating-point operator", "torch.int64"),
    ),
    Case(
        "curvature.eigenvalues.k_zero",
        lambda: eigenvalues(_h(), k=0),
        ValueError,
        ("eigenvalues(Hessian(Sequential))", "k", f"[1, {_P}]", "got 0"),
    ),
    Case(
        "curvature.eigenvalues.max_iter_zero",
        lambda: eigenvalues(_h(), k=1, max_iter=0),
        ValueError,
        ("max_iter", "at least k (1)", "got 0"),
    ),
    Case(
        "curvature.eigenvalues.tol_string",
        lambda: eigenvalues(_h(), k=1, tol="1e-3"),  # type: ignore[arg-type]
        TypeError,
        ("tol", "finite number", "'1e-3'"),
    ),
    Case(
        "curvature.eigenvalues.integer_matrix",
        lambda: eigenvalues(torch.eye(3, dtype=torch.long), k=1),
        TypeError,
        ("eigenvalues(Tensor)", "floating-point operator", "int64"),
    ),
    Case(
        "curvature.eigenvalues.nan_operator",
        lambda: eigenvalues(torch.full((3, 3), float("nan"), dtype=D), k=1),
        GradkitError,
        ("eigenvalues(Tensor)", "nan or inf", "not finite"),
    ),
    Case(
        "curvature.spectral_density.width_zero",
        lambda: spectral_density(_h(), probes=1, steps=3, width=0.0),
        ValueError,
        ("spectral_density(Hessian(Sequential))", "width", "> 0", "0.0"),
    ),
    Case(
        "curvature.spectral_density.grid_string",
        lambda: spectral_density(_h(), probes=1, steps=3, grid="100"),  # type: ignore[arg-type]
        TypeError,
        ("grid", "int >= 2", "'100'"),
    ),
    Case(
        "curvature.diagonal.max_size_string",
        lambda: diagonal(_h(), max_size="10"),  # type: ignore[arg-type]
        TypeError,
        ("diagonal(Hessian(Sequential)", "max_size", "'10'"),
    ),
    Case(
        "curvature.diagonal.max_memory_negative",
        lambda: diagonal(GGN(_m(), F.cross_entropy, _data()), max_memory=-1),
        ValueError,
        ("diagonal(GGN(Sequential)", "max_memory", "int >= 1", "-1"),
        _state(_m),
    ),
    Case(
        "curvature.dense.chunk_zero",
        lambda: _h().dense(chunk=0),
        ValueError,
        ("Hessian(Sequential).dense()", "chunk", "got 0"),
    ),
    Case(
        "curvature.matmul.meta_vector",
        lambda: _h() @ torch.ones(_P, device="meta"),
        ValueError,
        ("Hessian(Sequential) @ v", "meta device", "create v on {device}"),
    ),
    Case(
        "curvature.check_deterministic.rtol_string",
        lambda: _h().check_deterministic(rtol="tight"),  # type: ignore[arg-type]
        TypeError,
        ("check_deterministic()", "rtol", "finite number > 0", "'tight'"),
    ),
]

"""Bad input to the optimizers raises errors that name the call, the argument, what was
expected, what was received, and what to do."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradkit import optim


def _params():
    return {"w": torch.ones(2, 3), "b": torch.zeros(3)}


def _grads():
    return {"w": torch.ones(2, 3), "b": torch.ones(3)}


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (
            lambda: optim.sgd(lr=-0.1),
            ValueError,
            r"sgd: lr: expected a finite value >= 0, got -0.1; fix the value",
        ),
        (
            lambda: optim.sgd(lr=float("nan")),
            ValueError,
            r"sgd: lr: expected a finite value >= 0, got nan",
        ),
        (
            lambda: optim.sgd(lr=True),
            TypeError,
            r"sgd: lr: expected a number or a tensor, got True",
        ),
        (
            lambda: optim.sgd(lr="0.1"),
            TypeError,
            r"sgd: lr: expected a number or a tensor, got '0.1'",
        ),
        (
            lambda: optim.sgd(lr=torch.tensor(1)),
            TypeError,
            r"sgd: lr: expected a floating-point tensor, got Tensor\(shape=\(\), "
            r"dtype=torch.int64\)",
        ),
        (
            lambda: optim.sgd(lr=torch.ones(2, 2)),
            ValueError,
            r"sgd: lr: expected a 0-d tensor or a 1-d schedule.*give per-parameter tensors in a "
            r"dict",
        ),
        (
            lambda: optim.sgd(lr=0.1, dampening=1.5),
            ValueError,
            r"sgd: dampening: expected a finite value >= 0 and <= 1, got 1.5",
        ),
        (
            lambda: optim.sgd(lr=0.1, nesterov=True),
            ValueError,
            r"sgd: nesterov: expected momentum != 0 and dampening == 0 \(as torch.optim.SGD\)",
        ),
        (
            lambda: optim.sgd(lr=0.1, nesterov=1),
            TypeError,
            r"sgd: nesterov: expected a bool, got 1",
        ),
        (
            lambda: optim.sgd(lr={"w": -1.0}),
            ValueError,
            r"sgd: lr\['w'\]: expected a finite value >= 0",
        ),
        (
            lambda: optim.adam(betas=(0.9,)),
            ValueError,
            r"adam: betas: expected a pair \(beta1, beta2\)",
        ),
        (
            lambda: optim.adam(betas=(1.0, 0.999)),
            ValueError,
            r"adam: beta1: expected a finite value >= 0 and < 1, got 1.0",
        ),
        (lambda: optim.adamw(amsgrad="yes"), TypeError, r"adamw: amsgrad: expected a bool"),
        (
            lambda: optim.rmsprop(alpha=2.0),
            ValueError,
            r"rmsprop: alpha: expected a finite value >= 0 and <= 1",
        ),
        (lambda: optim.rmsprop(centered=None), TypeError, r"rmsprop: centered: expected a bool"),
        (
            lambda: optim.sgd(0.1, mask={"w": torch.ones(2, 3)}),
            TypeError,
            r"sgd: mask\['w'\]: expected a boolean tensor \(True = trainable\) or None",
        ),
        (
            lambda: optim.sgd(0.1, mask=torch.ones(2, 3, dtype=torch.bool)),
            TypeError,
            r"sgd: mask: expected None, or a dict / tuple of boolean tensors",
        ),
    ],
)
def test_bad_construction_is_explained(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


def test_bad_updates_are_explained():
    P, G = _params(), _grads()
    opt = optim.sgd(lr=0.1)
    state = opt.init(P)
    with pytest.raises(
        TypeError,
        match=(
            r"sgd.update: betas: expected one of this optimizer's hyperparameters \(lr, "
            r"momentum, dampening, weight_decay\)"
        ),
    ):
        opt.update(G, state, P, betas=(0.9, 0.9))
    with pytest.raises(
        ValueError,
        match=(
            r"sgd.update: momentum: expected 0 \(the optimizer was built with "
            r"momentum=0.*build the optimizer with a nonzero momentum"
        ),
    ):
        opt.update(G, state, P, momentum=0.9)
    with pytest.raises(
        TypeError, match=r"sgd.update: state: expected a SGDState from sgd.init\(params\), got"
    ):
        opt.update(G, optim.adam().init(P), P)
    with pytest.raises(ValueError, match=r"sgd.update: state.momentum_buffer: expected a buffer"):
        optim.sgd(0.1, momentum=0.9).update(G, state, P)
    with pytest.raises(
        ValueError,
        match=r"sgd.update: grads: expected a dict with the keys \['w', 'b'\], got keys \['w'\]",
    ):
        opt.update({"w": G["w"]}, state, P)
    with pytest.raises(
        ValueError,
        match=(
            r"sgd.update: grads\['b'\]: expected a tensor of the parameter's shape \(3,\) and "
            r"dtype torch.float32, got Tensor\(shape=\(4,\)"
        ),
    ):
        opt.update({"w": G["w"], "b": torch.ones(4)}, state, P)
    with pytest.raises(
        TypeError, match=r"sgd.update: grads\['b'\]: expected a torch.Tensor or None, got 1.0"
    ):
        opt.update({"w": G["w"], "b": 1.0}, state, P)
    with pytest.raises(
        TypeError, match=r"sgd.update: params: expected a dict name -> tensor or a tuple of tensors"
    ):
        opt.update(G, state, torch.ones(3))
    with pytest.raises(
        ValueError,
        match=(
            r"sgd.update: lr: expected a value for every parameter \(parameters: \['w', "
            r"'b'\]\), got keys \['w'\]"
        ),
    ):
        opt.update(G, state, P, lr={"w": 0.1})
    with pytest.raises(
        ValueError,
        match=r"sgd.update: lr\['b'\]: expected a number or a tensor that broadcasts to \(3,\)",
    ):
        opt.update(G, state, P, lr={"w": 0.1, "b": torch.ones(2)})
    with pytest.raises(
        ValueError,
        match=(
            r"sgd.update: lr: expected one value per parameter in a container like the "
            r"parameters"
        ),
    ):
        opt.update(G, state, P, lr=(0.1, 0.2))
    with pytest.raises(
        TypeError, match=r"adam.update: betas: expected a pair \('beta1', 'beta2'\)"
    ):
        optim.adam().update(G, optim.adam().init(P), P, betas=0.9)


def test_bad_layouts_are_explained():
    P = _params()
    opt = optim.sgd(0.1, momentum=0.9)
    with pytest.raises(
        TypeError,
        match=r"state_layout\(params, state\): params: expected tensors of one dtype on one device",
    ):
        optim.state_layout(
            {"w": torch.ones(2), "b": torch.ones(2, dtype=torch.float64)},
            opt.init({"w": torch.ones(2), "b": torch.ones(2)}),
        )
    with pytest.raises(
        TypeError, match=r"state_layout\(params, state\): state: expected an optimizer state"
    ):
        optim.state_layout(P, {"momentum": 1})
    layout = optim.state_layout(P, opt.init(P))
    with pytest.raises(
        ValueError,
        match=(
            r"StateLayout.unflatten: vector: expected a 1-d tensor of 18 elements, got "
            r"Tensor\(shape=\(17,\)"
        ),
    ):
        layout.unflatten(torch.zeros(17), step=0)
    assert "StateLayout(size=18, num_params=9" in repr(layout)
    assert (
        repr(optim.sgd(0.1))
        == "sgd(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, "
        "maximize=False)"
    )
    assert optim.sgd.__module__ == "gradkit.optim" and optim.SGDState.__module__ == "gradkit.optim"


TENSOR_MSG = r"expected a tensor of finite values"


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (lambda: optim.sgd(lr=torch.tensor(-0.1)), ValueError, r"sgd: lr: " + TENSOR_MSG + " >= 0"),
        (lambda: optim.sgd(lr=torch.tensor(math.nan)), ValueError, r"sgd: lr: .*got nan"),
        (lambda: optim.adam(lr=torch.tensor(math.inf)), ValueError, r"adam: lr: .*got inf"),
        (
            lambda: optim.sgd(lr=torch.tensor(-0.1, requires_grad=True)),
            ValueError,
            r"sgd: lr: " + TENSOR_MSG + r".*may require grad, but its value must be valid",
        ),
        (
            lambda: optim.sgd(lr=torch.tensor([0.1, -0.2, 0.3])),
            ValueError,
            r"sgd: lr: .*got -0.2\d* \(entry 1 of a tensor of shape \(3,\)\)",
        ),
        (
            lambda: optim.sgd(lr={"w": torch.tensor([[0.1], [-1.0]])}),
            ValueError,
            r"sgd: lr\['w'\]: " + TENSOR_MSG,
        ),
        (
            lambda: optim.adam(eps=torch.tensor(0.0)),
            ValueError,
            r"adam: eps: " + TENSOR_MSG + " > 0",
        ),
        (
            lambda: optim.adam(betas=(torch.tensor(1.0), 0.9)),
            ValueError,
            r"adam: beta1: " + TENSOR_MSG + " >= 0 and < 1, got 1.0",
        ),
        (lambda: optim.rmsprop(alpha=torch.tensor(1.5)), ValueError, r"rmsprop: alpha: .*<= 1"),
        (lambda: optim.sgd(lr=torch.tensor(1j)), TypeError, r"sgd: lr: expected a floating-point"),
        (
            lambda: optim.adam(eps=0.0),
            ValueError,
            r"adam: eps: expected a finite value > 0, got 0.0",
        ),
        (lambda: optim.adamw(eps=-1e-8), ValueError, r"adamw: eps: expected a finite value > 0"),
        (lambda: optim.rmsprop(eps=0), ValueError, r"rmsprop: eps: expected a finite value > 0"),
        (lambda: optim.adam(betas="ab"), TypeError, r"adam: betas: expected a pair"),
        (lambda: optim.adam(betas=0.9), TypeError, r"adam: betas: expected a pair"),
        (lambda: optim.adam(betas=(0.9, 0.99, 0.9)), ValueError, r"adam: betas: expected a pair"),
        (lambda: optim.adam(betas=(-0.1, 0.9)), ValueError, r"adam: beta1: expected a finite"),
        (lambda: optim.adam(betas=(0.9, "0.99")), TypeError, r"adam: beta2: expected a number"),
        (lambda: optim.sgd(0.1, momentum="0.9"), TypeError, r"sgd: momentum: expected a number"),
        (
            lambda: optim.sgd(lr=None),
            TypeError,
            r"sgd: lr: expected a number or a tensor, got None",
        ),
        (lambda: optim.sgd(lr=[0.1, "x"]), TypeError, r"sgd: lr\[1\]: expected a number"),
        (lambda: optim.rmsprop(centered="no"), TypeError, r"rmsprop: centered: expected a bool"),
        (lambda: optim.adam(maximize=0), TypeError, r"adam: maximize: expected a bool, got 0"),
    ],
)
def test_tensor_hyperparameters_are_checked_like_numbers(build, error, pattern):
    """Before: ``lr=torch.tensor(-0.1)`` (or NaN, inf, a negative schedule entry) was accepted
    and trained uphill or into NaN without a word; eps=0 gave 0/0 for unused weights."""
    with pytest.raises(error, match=pattern):
        build()


def test_valid_tensor_hyperparameters_still_work_and_stay_differentiable():
    P, G = _params(), _grads()
    lr = torch.tensor(0.1, requires_grad=True)
    opt = optim.sgd(lr=lr, momentum=torch.tensor(0.9, dtype=torch.float64))
    new, _ = opt.update(G, opt.init(P), P)
    (g,) = torch.autograd.grad(new["w"].sum(), lr)
    assert torch.equal(g, -G["w"].sum())  # d(w - lr g)/d lr = -g
    assert isinstance(optim.sgd(lr=np.float32(0.1)).hyperparams["lr"], float)  # numpy scalars


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (
            lambda o, s: o.update(
                {"w": torch.ones(2, 3, dtype=torch.float64), "b": _grads()["b"]}, s, _params()
            ),
            ValueError,
            r"sgd.update: grads\['w'\]: expected a tensor of the parameter's shape \(2, 3\) and "
            r"dtype torch.float32, got Tensor\(shape=\(2, 3\), dtype=torch.float64\)",
        ),
        (
            lambda o, s: o.update(
                _grads(), s, {"w": torch.ones(2, 3, dtype=torch.long), "b": _params()["b"]}
            ),
            TypeError,
            r"sgd.update: params\['w'\]: expected a floating-point tensor",
        ),
        (
            lambda o, s: o.update(_grads(), s, _params(), return_delta="yes"),
            TypeError,
            r"sgd.update: return_delta: expected a bool",
        ),
        (
            lambda o, s: o.update(_grads(), s, _params(), lr=torch.tensor(-1.0)),
            ValueError,
            r"sgd.update: lr: expected a tensor of finite values >= 0",
        ),
        (
            lambda o, s: o.update(
                _grads(),
                s._replace(momentum_buffer={"w": torch.ones(1), "b": _params()["b"]}),
                _params(),
            ),
            ValueError,
            r"sgd.update: state.momentum_buffer\['w'\]: expected a buffer like its parameter",
        ),
        (
            lambda o, s: optim.sgd(
                0.1, mask={"w": torch.ones(3, dtype=torch.bool), "b": None}
            ).update(_grads(), s, _params()),
            ValueError,
            r"sgd.update: mask\['w'\]: expected a boolean tensor of the parameter's shape \(2, 3\)",
        ),
        (
            lambda o, s: optim.apply_updates(_params(), {"w": torch.ones(1), "b": _params()["b"]}),
            ValueError,
            r"apply_updates\(params, delta\): delta\['w'\]: expected a tensor of the parameter's "
            r"shape \(2, 3\)",
        ),
        (
            lambda o, s: optim.state_layout(_params(), s).unflatten(torch.zeros(18), step=-1),
            ValueError,
            r"StateLayout.unflatten: step: expected an int >= 0, got -1",
        ),
        (
            lambda o, s: optim.state_layout(_params(), s).flatten(_params(), s, out=torch.zeros(3)),
            ValueError,
            r"StateLayout.flatten: out: expected a 1-d tensor of 18 elements",
        ),
        (
            lambda o, s: optim.state_layout({"w": torch.ones(3), "b": _params()["b"]}, s),
            ValueError,
            r"state_layout\(params, state\): state.momentum_buffer\['w'\]: expected a buffer "
            r"shaped like its parameter \(3,\)",
        ),
    ],
)
def test_bad_update_arguments_are_explained(call, error, pattern):
    """Before: a float64 gradient for a float32 weight, an int weight, a slot or a mask of
    another shape gave raw torch errors, silent broadcasting or truncated int weights."""
    opt = optim.sgd(0.1, momentum=0.9)
    state = opt.init(_params())
    with pytest.raises(error, match=pattern):
        call(opt, state)


def test_a_per_parameter_value_on_another_device_than_its_parameter_is_refused():
    """A non-0-d per-parameter value on the CPU beside CUDA parameters failed at the first update
    with torch's bare device error (seen on an H200); the meta device stands in for CUDA here.
    A 0-d value is read wherever it lives."""
    params = {"W": torch.ones(4, 3, device="meta"), "b": torch.ones(3, device="meta")}
    per_weight = optim.sgd(lr={"W": torch.full((4, 3), 0.1, device="cpu"), "b": 0.1})
    with pytest.raises(
        ValueError, match=r"sgd.init\(params\): lr\['W'\]: expected a tensor on its"
    ):
        per_weight.init(params)
    optim.sgd(lr={"W": torch.tensor(0.1, device="cpu"), "b": 0.1}).init(params)
    optim.sgd(lr={"W": torch.full((4, 3), 0.1, device="meta"), "b": 0.1}).init(params)

"""Forward-mode hypergradients: tangents pushed through the dynamics with Jacobian-vector
products (RFHO/FAR-HO's ``ForwardHG``).

For one direction :math:`e` in hyperparameter space the tangent :math:`Z_t = ds_t/d\\lambda\\, e`
follows the dynamics

.. math:: Z_{t+1} = \\frac{\\partial \\Phi_t}{\\partial s_t} Z_t
          + \\frac{\\partial \\Phi_t}{\\partial \\lambda} e, \\qquad
          \\frac{dE}{d\\lambda} e = \\frac{\\partial E}{\\partial s_T} Z_T
          + \\frac{\\partial E}{\\partial \\lambda} e

computed by forward-mode AD (dual tensors of ``torch.autograd.forward_ad``) over the inner
gradient (forward over reverse: one Hessian-vector product per step). Every step's graph is
dropped as soon as the step is done, so memory does not grow with T; time is one pass of T
steps per hyperparameter element.

The losses may close over the hyperparameters, so a tensor cannot be swapped for a dual one:
the hyperparameter receives its tangent in place (``h.copy_(dual of h)``, same values) for the
duration of each step; its version counter is restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from gradkit._forward_ad import load_decompositions
from gradkit._tree import leaves, rebuild
from gradkit._validate import check_bool
from gradkit.hyper._problem import (
    Dynamics,
    HyperResult,
    check_hyper,
    check_scalar,
    check_steps,
    grads_of,
    unused_error,
)

__all__ = ["forward"]


def _set_version(t: torch.Tensor, version: int) -> None:
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:  # pragma: no cover - older torch: the counter stays bumped
        return
    try:
        setter((t,), (version,))
    except TypeError:  # pragma: no cover - older signature
        setter(t, version)


@contextlib.contextmanager
def _seeded(h: torch.Tensor, index: int) -> Iterator[None]:
    """Give ``h`` the tangent ``e_index`` (inside a dual level), values unchanged; a negative
    index gives no tangent."""
    load_decompositions()
    if index < 0:
        yield
        return
    version = h._version
    tangent = torch.zeros_like(h)
    tangent.view(-1)[index] = 1
    with torch.no_grad():
        h.copy_(fwAD.make_dual(h.detach().clone(), tangent))
    try:
        yield
    finally:
        _set_version(h, version)


Pair = tuple[torch.Tensor, torch.Tensor | None]


def _unpack(t: torch.Tensor) -> Pair:
    """``(primal, tangent or None)``, both cut from every graph."""
    primal, tangent = fwAD.unpack_dual(t)
    return primal.detach(), (None if tangent is None else tangent.detach())


def _pack(pair: Pair, *, requires_grad: bool = False) -> torch.Tensor:
    """A tensor (dual when it has a tangent) from ``(primal, tangent)``."""
    primal, tangent = pair
    x = primal.detach().requires_grad_(True) if requires_grad else primal
    return x if tangent is None else fwAD.make_dual(x, tangent)


def _pass(
    dyn: Dynamics, steps: int, h: torch.Tensor, index: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """One run of the dynamics with the tangent ``e_index`` on ``h``:
    ``(E, dE tangent or None, theta_T)``.

    Each step runs in its own dual level and hands ``(primal, tangent)`` pairs to the next: a
    level's exit drops every tangent made in it, which breaks the reference cycles that
    tangents computed with grad mode on form with the graph (one level for the whole pass
    keeps every step's activations alive, memory growing with T).
    """
    structure, opt, call = dyn.structure, dyn.opt, dyn.call
    ps: list[Pair] = []
    slots: dict[str, list[Pair]] = {}
    counts: Any = None
    for t in range(-1, steps):
        with fwAD.dual_level(), _seeded(h, index):
            if t < 0:  # the initial state: params0 may hold h itself (initial weights)
                ps = [_unpack(p) for p in leaves(dyn.params0, structure, call, "params0")]
                state = opt.init(dyn.params0)
                counts = state.counts
                slots = {
                    f: [_unpack(v) for v in leaves(getattr(state, f), structure, call, f)]
                    for f in opt.slots
                }
                continue
            xs = [_pack(p, requires_grad=True) for p in ps]
            params = rebuild(structure, xs)
            state = dyn.state0._replace(
                step=t,
                counts=counts,
                **{f: rebuild(structure, [_pack(v) for v in vs]) for f, vs in slots.items()},
            )
            with torch.enable_grad():
                loss = dyn.inner_loss(params, dyn.batch(t))
                gs = grads_of(loss, xs, call, create_graph=True)
                grads = rebuild(structure, gs)
                new_params, state = opt.update(grads, state, params)
            dyn.record(t, state, grads)
            counts = state.counts
            ps = [_unpack(p) for p in leaves(new_params, structure, call, "params")]
            slots = {
                f: [_unpack(v) for v in leaves(getattr(state, f), structure, call, f)]
                for f in opt.slots
            }
    with fwAD.dual_level(), _seeded(h, index):
        value = check_scalar(
            dyn.outer_loss(rebuild(structure, [_pack(p) for p in ps])), call, "outer_loss"
        )
        primal, tangent = _unpack(value)
    return primal, tangent, [p for p, _ in ps]


def forward(
    inner_loss: Callable[..., Any],
    outer_loss: Callable[..., Any],
    params0: Any,
    opt: Any,
    *,
    steps: int,
    hyper: dict[str, torch.Tensor],
    batches: Any = None,
    full_output: bool = False,
) -> Any:
    r"""Forward-mode hypergradient: the same quantity as :func:`reverse`, by tangents.

    Memory is independent of ``steps`` (one step's graph and one tangent per state tensor);
    time is ``n`` passes of ``steps`` steps, ``n`` the total number of hyperparameter
    elements, each step costing about a gradient and a Hessian-vector product. The right
    engine for a few scalar hyperparameters (learning rate, momentum, weight decay); use
    :func:`reverse` for many (per-example weights).

    Args:
        inner_loss, outer_loss, params0, opt, steps, hyper, batches: as :func:`reverse`
            (a parameter without a gradient at a step is skipped, as there).
        full_output: return a :class:`HyperResult` (grads, outer loss, last iterate).

    Returns:
        ``{name: d outer_loss / d hyper[name]}`` shaped like each tensor.

    Examples:
        >>> import torch
        >>> from gradkit import hyper, optim
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> lr, mu = torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
        >>> inner = lambda p, batch: ((X @ p["w"] - y) ** 2).mean()
        >>> outer = lambda p: ((X[:5] @ p["w"] - y[:5]) ** 2).mean()
        >>> args = (inner, outer, {"w": torch.zeros(3, dtype=torch.float64)},
        ...         optim.sgd(lr=lr, momentum=mu))
        >>> fwd = hyper.forward(*args, steps=20, hyper={"lr": lr, "momentum": mu})
        >>> rev = hyper.reverse(*args, steps=20, hyper={"lr": lr, "momentum": mu})
        >>> all(torch.allclose(fwd[k], rev[k], rtol=1e-10) for k in fwd)
        True
    """
    call = "forward(inner_loss, outer_loss, params0, opt)"
    names, hypers = check_hyper(hyper, call)
    steps = check_steps(steps, call)
    check_bool(full_output, call, "full_output")
    dyn = Dynamics(inner_loss, outer_loss, opt, params0, batches, call)
    grads = {
        name: torch.zeros_like(h, memory_format=torch.contiguous_format)
        for name, h in zip(names, hypers, strict=True)
    }
    value, final = None, None
    for name, h in zip(names, hypers, strict=True):
        flat = grads[name].view(-1)
        for index in range(h.numel()):
            value, tangent, final = _pass(dyn, steps, h, index)
            if not dyn.any_gradient:
                raise dyn.no_gradient_error()
            if tangent is None:
                raise unused_error(call, name)
            flat[index] = tangent.to(flat.dtype)
    grads = {name: g.detach() for name, g in grads.items()}
    if not full_output:
        return grads
    if value is None or final is None:  # only empty hyperparameter tensors: no pass ran
        value, _, final = _pass(dyn, steps, hypers[0], -1)
    return HyperResult(grads, value, rebuild(dyn.structure, final))

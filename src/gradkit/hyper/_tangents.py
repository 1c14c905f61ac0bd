"""Tangents of the training state along hyperparameter directions, every direction of a step
from one gradient (what :func:`gradkit.hyper.forward` and the real-time engine share).

For a direction :math:`e` (one hyperparameter element) the tangent :math:`Z = ds_t/d\\lambda\\, e`
of the state (parameters :math:`\\theta` and optimizer slots) follows

.. math:: Z_{t+1} = \\frac{\\partial \\Phi_t}{\\partial s_t} Z_t
          + \\frac{\\partial \\Phi_t}{\\partial \\lambda} e .

A step splits into the gradient and the optimizer's update. The gradient's tangent is a
second-order product,

.. math:: \\dot g = \\nabla_\\theta \\big( \\nabla_\\theta L \\cdot Z_\\theta
          + \\nabla_\\lambda L \\cdot e \\big)

(the mixed partial derivatives commute), so one backward pass with ``create_graph`` gives
:math:`\\nabla_\\theta L` and :math:`\\nabla_\\lambda L` for every direction, and each direction
adds one backward pass through that graph: reverse over reverse, cheaper than
forward-over-reverse dual tensors on CPU (a gradient and one Hessian-vector product on the
hyper suite's MLP: 3.0 ms against 5.0 ms). Batching the directions' backward passes with
``is_grads_batched`` was measured too and is slower than the loop there (it copies the step's
activations per direction). The update's tangent is a Jacobian-vector product by two vector-Jacobian
products on its small elementwise graph. (Dual tensors would do it in one pass, but every
product of a dual tensor with a plain one, a Python float included, leaves torch's C++ fast
path: about 200 us against 10 us an operation on the suite's 16k-element weights, which made
the update cost more than the gradient.) Only the initial state uses dual tensors: the
hyperparameter receives its tangent in place (``h.copy_(dual of h)``, same values) while
``opt.init`` runs, since ``params0`` may hold it; its version counter is restored afterwards.

A tangent is ``None`` where the state does not depend on the direction (structurally), so a
hyperparameter with no path to the outer loss can be told apart: the engines give the
optimizer's own tensors a zero there and report any other tensor
(:meth:`~gradkit.hyper._problem.Dynamics.check_reached`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from gradkit._forward_ad import load_decompositions
from gradkit._tree import leaves, rebuild
from gradkit.hyper._problem import Dynamics, check_scalar, hyper_leaves

__all__ = ["Direction", "Trajectory", "advance", "read", "start"]

Direction = tuple[int, int]
"""``(index of the hyperparameter tensor, index of the element in its flat view)``."""

Maybe = list[torch.Tensor | None]
Tangent = tuple[Maybe, dict[str, Maybe]]
"""One direction's tangents of the parameters and of each optimizer slot (None: none)."""


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
    """Give ``h`` the tangent ``e_index`` (inside a dual level), values unchanged."""
    load_decompositions()
    version = h._version
    tangent = torch.zeros_like(h)
    tangent.view(-1)[index] = 1
    with torch.no_grad():
        h.copy_(fwAD.make_dual(h.detach().clone(), tangent))
    try:
        yield
    finally:
        _set_version(h, version)


def _unpack(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    primal, tangent = fwAD.unpack_dual(t)
    return primal.detach(), (None if tangent is None else tangent.detach())


@dataclass
class Trajectory:
    """The state ``s_t`` (parameters, optimizer slots, per-parameter counts) and one tangent
    per direction."""

    ps: list[torch.Tensor]
    slots: dict[str, list[torch.Tensor]]
    counts: Any
    tangents: list[Tangent]


def _split(dyn: Dynamics, params: Any, state: Any) -> tuple[list[Any], dict[str, list[Any]]]:
    """Unpacked ``(primal, tangent)`` pairs of the parameters and of each slot."""
    ps = [_unpack(p) for p in leaves(params, dyn.structure, dyn.call, "params")]
    slots = {
        f: [_unpack(v) for v in leaves(getattr(state, f), dyn.structure, dyn.call, f)]
        for f in dyn.opt.slots
    }
    return ps, slots


def _collect(
    pairs: Sequence[tuple[list[Any], dict[str, list[Any]], Any]], empty: int
) -> Trajectory:
    """A trajectory from each direction's ``(params, slots, counts)`` pairs (every direction
    has the same primals); ``empty`` directions when ``pairs`` holds only the primal run."""
    ps, slots, counts = pairs[0]
    tangents: list[Tangent] = [
        ([z for _, z in p], {f: [z for _, z in vs] for f, vs in s.items()})
        for p, s, _ in pairs[:empty]
    ]
    return Trajectory(
        [p for p, _ in ps], {f: [v for v, _ in vs] for f, vs in slots.items()}, counts, tangents
    )


@contextlib.contextmanager
def _level(hypers: Sequence[torch.Tensor], direction: Direction | None) -> Iterator[None]:
    """A dual level in which the direction's hyperparameter element holds tangent 1 (no
    tangent anywhere for ``None``: the primal run of a trajectory without directions)."""
    with fwAD.dual_level():
        if direction is None:
            yield
            return
        with _seeded(hypers[direction[0]], direction[1]):
            yield


def start(
    dyn: Dynamics, hypers: Sequence[torch.Tensor], directions: Sequence[Direction]
) -> Trajectory:
    """``s_0`` and its tangents (not None only where ``params0`` holds a hyperparameter)."""
    runs = []
    each: Sequence[Direction | None] = directions or [None]
    for direction in each:
        with _level(hypers, direction):
            state = dyn.opt.init(dyn.params0)
            runs.append((*_split(dyn, dyn.params0, state), state.counts))
    return _collect(runs, len(directions))


def _grad_tangents(
    gs: Sequence[torch.Tensor | None],
    gh: Sequence[torch.Tensor | None],
    xs: Sequence[torch.Tensor],
    hypers: Sequence[torch.Tensor],
    direction: Direction,
    zp: Maybe,
) -> Maybe:
    """The tangent of the gradient along one direction: the gradient with respect to the
    parameters of ``grad L . Z + dL/dlambda . e`` (one backward pass through the graph of
    ``gs`` and ``gh``, kept for the other directions)."""
    outputs, seeds = [], []
    for g, z in zip(gs, zp, strict=True):
        if g is not None and z is not None and g.requires_grad:
            outputs.append(g)
            seeds.append(z)
    j, i = direction
    g = gh[j]
    if g is not None and g.requires_grad:
        e = torch.zeros_like(hypers[j], memory_format=torch.contiguous_format)
        e.view(-1)[i] = 1
        outputs.append(g)
        seeds.append(e)
    if not outputs:
        return [None] * len(xs)
    return list(torch.autograd.grad(outputs, xs, seeds, retain_graph=True, allow_unused=True))


def advance(
    dyn: Dynamics,
    t: int,
    hypers: Sequence[torch.Tensor],
    directions: Sequence[Direction],
    traj: Trajectory,
) -> Trajectory:
    """Step ``t``: ``s_{t+1}`` and the tangent of every direction."""
    n = len(traj.ps)
    xs = [p.detach().requires_grad_(True) for p in traj.ps]
    versions = dyn.buffer_versions() if t == 0 else None
    with hyper_leaves(hypers if directions else ()), torch.enable_grad():
        loss = check_scalar(
            dyn.inner_loss(rebuild(dyn.structure, xs), dyn.batch(t)), dyn.call, "inner_loss"
        )
        if versions is not None:
            dyn.check_buffers(versions)
        wrt = [*xs, *hypers] if directions else xs
        res: Sequence[torch.Tensor | None] = (
            torch.autograd.grad(loss, wrt, create_graph=bool(directions), allow_unused=True)
            if loss.requires_grad
            else [None] * len(wrt)
        )
    gs, gh = list(res[:n]), list(res[n:])
    gdots = [
        _grad_tangents(gs, gh, xs, hypers, d, zp)
        for d, (zp, _) in zip(directions, traj.tangents, strict=True)
    ]
    grads = [None if g is None else g.detach() for g in gs]
    return _update(dyn, t, hypers, directions, traj, grads, gdots)


def _update(
    dyn: Dynamics,
    t: int,
    hypers: Sequence[torch.Tensor],
    directions: Sequence[Direction],
    traj: Trajectory,
    grads: Maybe,
    gdots: Sequence[Maybe],
) -> Trajectory:
    """The optimizer's update of ``s_t`` with ``grads`` and its tangent along every direction
    (``gdots``: the gradient's tangents): a Jacobian-vector product by two vector-Jacobian
    products, ``J v = d/du (J^T u) . v`` (the update's graph and ``J^T u`` built once, then one
    small backward pass per direction)."""
    structure, fields = dyn.structure, list(dyn.opt.slots)
    n = len(traj.ps)
    gi = [None if g is None else g.detach().requires_grad_(bool(directions)) for g in grads]
    pi = [p.detach().requires_grad_(bool(directions)) for p in traj.ps]
    si = {f: [v.detach().requires_grad_(bool(directions)) for v in traj.slots[f]] for f in fields}
    with hyper_leaves(hypers if directions else ()), torch.set_grad_enabled(bool(directions)):
        state = dyn.state0._replace(
            step=t, counts=traj.counts, **{f: rebuild(structure, si[f]) for f in fields}
        )
        new_params, new_state = dyn.opt.update(
            rebuild(structure, gi), state, rebuild(structure, pi)
        )
        dyn.record(t, new_state, rebuild(structure, grads))
        outs = leaves(new_params, structure, dyn.call, "params") + [
            v for f in fields for v in leaves(getattr(new_state, f), structure, dyn.call, f)
        ]
        live = [k for k, o in enumerate(outs) if o.requires_grad]
        inputs = [g for g in gi if g is not None] + pi + [v for f in fields for v in si[f]]
        inputs += list(hypers)
        us = [torch.zeros_like(outs[k]).requires_grad_(True) for k in live]
        vjps: Sequence[torch.Tensor | None] = (
            torch.autograd.grad(
                [outs[k] for k in live], inputs, us, create_graph=True, allow_unused=True
            )
            if live
            else [None] * len(inputs)
        )
    tangents: list[Tangent] = []
    for (j, i), (zp, zs), gdot in zip(directions, traj.tangents, gdots, strict=True):
        e = torch.zeros_like(hypers[j], memory_format=torch.contiguous_format)
        e.view(-1)[i] = 1
        seeds = [z for g, z in zip(gi, gdot, strict=True) if g is not None] + list(zp)
        seeds += [z for f in fields for z in zs[f]]
        seeds += [e if k == j else None for k in range(len(hypers))]
        pairs = [
            (v, z) for v, z in zip(vjps, seeds, strict=True) if v is not None and z is not None
        ]
        found: Sequence[torch.Tensor | None] = [None] * len(us)
        if pairs:
            found = torch.autograd.grad(
                [v for v, _ in pairs],
                us,
                [z for _, z in pairs],
                retain_graph=True,
                allow_unused=True,
            )
        out: Maybe = [None] * len(outs)
        for k, z in zip(live, found, strict=True):
            out[k] = None if z is None else z.detach()
        tangents.append(
            (out[:n], {f: out[n * (m + 1) : n * (m + 2)] for m, f in enumerate(fields)})
        )
    primal = [o.detach() for o in outs]
    return Trajectory(
        primal[:n],
        {f: primal[n * (m + 1) : n * (m + 2)] for m, f in enumerate(fields)},
        new_state.counts,
        tangents,
    )


def read(
    dyn: Dynamics,
    hypers: Sequence[torch.Tensor],
    directions: Sequence[Direction],
    traj: Trajectory,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``(E(theta_t), [dE/d lambda along each direction, None where no path])``: one backward
    pass of the outer loss, then a dot product per direction."""
    xs = [p.detach().requires_grad_(True) for p in traj.ps]
    with hyper_leaves(hypers if directions else ()), torch.enable_grad():
        value = check_scalar(dyn.outer_loss(rebuild(dyn.structure, xs)), dyn.call, "outer_loss")
        wrt = [*xs, *hypers]
        res: Sequence[torch.Tensor | None] = (
            torch.autograd.grad(value, wrt, allow_unused=True)
            if directions and value.requires_grad
            else [None] * len(wrt)
        )
    n = len(xs)
    gp, gh = res[:n], res[n:]
    if directions:
        dyn.check_outer(any(g is not None for g in gp))
    out: list[torch.Tensor | None] = []
    for (j, i), (zp, _) in zip(directions, traj.tangents, strict=True):
        total: torch.Tensor | None = None
        for g, z in zip(gp, zp, strict=True):
            if g is not None and z is not None:
                part = torch.dot(g.reshape(-1), z.reshape(-1))
                total = part if total is None else total + part
        g = gh[j]
        if g is not None:
            part = g.reshape(-1)[i]
            total = part if total is None else total + part
        out.append(None if total is None else total.detach())
    return value.detach(), out

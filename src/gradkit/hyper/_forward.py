"""Forward-mode hypergradients: tangents pushed through the dynamics (RFHO/FAR-HO's
``ForwardHG``).

For one direction :math:`e` in hyperparameter space the tangent :math:`Z_t = ds_t/d\\lambda\\, e`
follows the dynamics

.. math:: Z_{t+1} = \\frac{\\partial \\Phi_t}{\\partial s_t} Z_t
          + \\frac{\\partial \\Phi_t}{\\partial \\lambda} e, \\qquad
          \\frac{dE}{d\\lambda} e = \\frac{\\partial E}{\\partial s_T} Z_T
          + \\frac{\\partial E}{\\partial \\lambda} e .

Every hyperparameter element is a direction, and all directions of a pass share one run of the
dynamics: each step computes the inner gradient once (with its graph) and adds, per direction,
one backward pass through that graph and one elementwise dual pass of the update (see
:mod:`gradkit.hyper._tangents`). Each step's graph is dropped when the step is done, so memory
does not grow with T; it grows with the directions of a pass (one tangent of the state each),
which ``chunk_size`` bounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradkit._tree import rebuild
from gradkit._validate import check_bool, check_int
from gradkit.hyper._problem import (
    Dynamics,
    HyperResult,
    check_hyper,
    check_steps,
)
from gradkit.hyper._tangents import Direction, advance, read, start

__all__ = ["forward"]


def forward(
    inner_loss: Callable[..., Any],
    outer_loss: Callable[..., Any],
    params0: Any,
    opt: Any,
    *,
    steps: int,
    hyper: dict[str, torch.Tensor],
    batches: Any = None,
    chunk_size: int | None = None,
    full_output: bool = False,
) -> Any:
    r"""Forward-mode hypergradient: the same quantity as :func:`reverse`, by tangents.

    Every hyperparameter element is a direction, and the directions share one run of the
    dynamics: each step costs one inner gradient (with its graph) plus, per direction, a
    backward pass through that graph (a Hessian-vector product) and an elementwise pass of the
    update. Memory is independent of ``steps``: one step's graph and one tangent of the state
    (parameters and optimizer slots) per direction. The right engine for a few scalar
    hyperparameters (learning rate, momentum, weight decay); use :func:`reverse` for many
    (per-example weights).

    Args:
        inner_loss, outer_loss, params0, opt, steps, hyper, batches: as :func:`reverse`
            (a parameter without a gradient at a step is skipped, as there).
        chunk_size: the most directions one run of the dynamics carries (default: all);
            ``k`` gives ``ceil(n / k)`` runs for ``n`` elements, each holding ``k`` tangents
            of the state.
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
    directions: list[Direction] = [(j, i) for j, h in enumerate(hypers) for i in range(h.numel())]
    if chunk_size is not None:
        chunk = check_int(chunk_size, call, "chunk_size", low=1, example=8)
    else:
        chunk = max(1, len(directions))
    check_bool(full_output, call, "full_output")
    dyn = Dynamics(inner_loss, outer_loss, opt, params0, batches, call)
    dyn.check_steps(steps)
    flat = [torch.zeros(h.numel(), dtype=h.dtype, device=h.device) for h in hypers]
    reached = [False] * len(hypers)
    for first in range(0, max(1, len(directions)), chunk):
        part = directions[first : first + chunk]
        traj = start(dyn, hypers, part)
        for t in range(steps):
            traj = advance(dyn, t, hypers, part, traj)
        if not dyn.any_gradient:
            raise dyn.no_gradient_error()
        value, tangents = read(dyn, hypers, part, traj)
        for (j, i), tangent in zip(part, tangents, strict=True):
            if tangent is not None:
                reached[j] = True
                # detached: through the user's graph (lr = log_lr.exp()) it carries one
                flat[j][i] = tangent.detach().to(flat[j].dtype)
    dyn.check_reached(names, hypers, reached)
    grads = {name: f.view(h.shape) for name, f, h in zip(names, flat, hypers, strict=True)}
    if not full_output:
        return grads
    return HyperResult(grads, value, rebuild(dyn.structure, [p.clone() for p in traj.ps]))

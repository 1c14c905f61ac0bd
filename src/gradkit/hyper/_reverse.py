"""Reverse-mode hypergradients through T optimizer steps: store the state history, replay.

The forward pass runs the T steps without any graph and writes the flat states ``s_t``
(parameters and optimizer slots, one contiguous row each) into one preallocated buffer. The
backward pass walks t = T-1, ..., 0: it rebuilds step t from the stored ``s_t`` -- the inner
gradient with ``create_graph=True`` and the optimizer update -- and takes one vector-Jacobian
product for the state and all hyperparameters together (RFHO/FAR-HO's ``ReverseHG``):

.. math::
    a_T = \\partial E / \\partial s_T, \\quad
    a_t = a_{t+1}^\\top \\partial \\Phi_t / \\partial s_t, \\quad
    \\frac{dE}{d\\lambda} = \\frac{\\partial E}{\\partial \\lambda}
    + \\sum_{t} a_{t+1}^\\top \\frac{\\partial \\Phi_t}{\\partial \\lambda}
    + a_0^\\top \\frac{\\partial s_0}{\\partial \\lambda}

Only one step's graph is alive at a time. Memory: the history (T rows of ``|s|`` elements) plus
one step's graph. With ``checkpoint_every=k`` only every k-th state is kept
(``ceil(T/k)`` rows) plus a segment buffer of ``k - 1`` rows; each segment is recomputed from
its checkpoint before it is replayed (one extra forward step per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradkit._errors import message
from gradkit._validate import check_bool
from gradkit.hyper._budget import budget_bytes, plan, saved_bytes
from gradkit.hyper._problem import (
    Dynamics,
    HyperResult,
    check_hyper,
    check_last,
    check_steps,
    hyper_leaves,
    sum_paths,
)

__all__ = ["checkpoint_stride", "reverse", "truncated"]


def checkpoint_stride(checkpoint_every: Any, span: int, call: str) -> int:
    if checkpoint_every is None:
        return 1
    if checkpoint_every == "sqrt":
        return max(1, math.ceil(math.sqrt(span)))
    fix = "pass e.g. checkpoint_every=10 or 'sqrt' (None stores every state)"
    expected = "None (store every state), an int >= 1, or 'sqrt'"
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, str)):
        raise TypeError(message(call, "checkpoint_every", expected, repr(checkpoint_every), fix))
    if isinstance(checkpoint_every, str) or checkpoint_every < 1:
        raise ValueError(message(call, "checkpoint_every", expected, repr(checkpoint_every), fix))
    # a stride longer than the steps stores only the first state (the same result)
    return min(checkpoint_every, max(span, 1))


def _engine(
    call: str,
    inner_loss: Callable[..., Any],
    outer_loss: Callable[..., Any],
    params0: Any,
    opt: Any,
    steps: Any,
    hyper: Any,
    batches: Any,
    checkpoint_every: Any,
    last: Any,
    full_output: Any,
    memory_budget: Any = None,
) -> HyperResult:
    names, hypers = check_hyper(hyper, call)
    steps = check_steps(steps, call)
    check_bool(full_output, call, "full_output")
    span = steps if last is None else check_last(last, steps, call)
    if checkpoint_every is not None and memory_budget not in (None, "auto"):
        raise ValueError(
            message(
                call,
                "checkpoint_every",
                "None when memory_budget is given (the budget chooses the stride)",
                repr(checkpoint_every),
                "pass one of checkpoint_every and memory_budget",
            )
        )
    k = checkpoint_stride(checkpoint_every, span, call)
    dyn = Dynamics(inner_loss, outer_loss, opt, params0, batches, call)
    dyn.check_steps(steps)
    start = steps - span
    with hyper_leaves(hypers):
        s0 = dyn.initial()
        s = s0.detach()
        budget = (
            None if checkpoint_every is not None else budget_bytes(memory_budget, s.device, call)
        )
        for t in range(start):
            s = dyn.step(s, t)
        kept, leaf, measured = 0, None, None
        if budget is not None:  # the first differentiated step runs with its graph, measured
            leaf = s.detach().requires_grad_(True)
            with saved_bytes() as found:
                measured = dyn.graph_step(leaf, start)
            state_bytes = dyn.layout.size * s.element_size()
            chosen = plan(budget, span, state_bytes, sum(found.values()), call)
            kept, k = chosen.graphs, chosen.stride
        end = steps - kept  # steps start .. end - 1 are replayed, end .. T - 1 keep their graphs
        rows = -(-(end - start) // k)
        history = s.new_empty((rows, dyn.layout.size))
        for t in range(start, end):
            if (t - start) % k == 0:
                history[(t - start) // k].copy_(s)
            s = measured.detach() if measured is not None and t == start else dyn.step(s, t)
        if kept == 0:
            leaf = measured = None  # drop the measured graph
        elif measured is not None and end == start:  # all fit: the measured graph is the first
            s = measured
            for t in range(start + 1, steps):
                s = dyn.graph_step(s, t)
        else:
            leaf = s = s.detach().requires_grad_(True)
            for t in range(end, steps):
                s = dyn.graph_step(s, t)
        measured = None
        if not dyn.any_gradient:
            raise dyn.no_gradient_error()
        value, adjoint, direct, final = dyn.outer(s, hypers)
        total = sum_paths([None] * len(hypers), direct)
        if leaf is not None:  # back through the kept graphs in one pass
            with torch.enable_grad():
                res = torch.autograd.grad(  # retain_graph: the user's graph (see Dynamics.vjp)
                    s, [leaf, *hypers], adjoint, retain_graph=True, allow_unused=True
                )
            adjoint = res[0] if res[0] is not None else torch.zeros_like(adjoint)
            total = sum_paths(total, res[1:])
        del s, leaf
        segment = history.new_empty((k - 1, dyn.layout.size))
        for j in reversed(range(rows)):
            first = start + j * k
            states = [history[j]]
            for i in range(1, min(k, end - first)):
                states.append(dyn.step(states[-1], first + i - 1, out=segment[i - 1]))
            for i in reversed(range(len(states))):
                adjoint, parts = dyn.vjp(states[i], first + i, adjoint, hypers)
                total = sum_paths(total, parts)
        dyn.check_replay()
        if start == 0 and s0.requires_grad:
            with torch.enable_grad():
                parts = torch.autograd.grad(
                    s0, hypers, adjoint, retain_graph=True, allow_unused=True
                )
            total = sum_paths(total, parts)
    if span == steps:  # nothing cut: a tensor no path reaches is the optimizer's or a mistake
        dyn.check_reached(names, hypers, [g is not None for g in total])
    grads = {
        name: (torch.zeros_like(h) if g is None else g.reshape(h.shape).to(h.dtype))
        for name, h, g in zip(names, hypers, total, strict=True)
    }
    return HyperResult(grads, value, final)


def reverse(
    inner_loss: Callable[..., Any],
    outer_loss: Callable[..., Any],
    params0: Any,
    opt: Any,
    *,
    steps: int,
    hyper: dict[str, torch.Tensor],
    batches: Any = None,
    checkpoint_every: int | str | None = None,
    memory_budget: int | float | str | None = "auto",
    full_output: bool = False,
) -> Any:
    r"""Exact reverse-mode hypergradient of ``outer_loss`` after ``steps`` optimizer steps on
    ``inner_loss``.

    .. math:: \frac{d}{d\lambda} E(\theta_T(\lambda), \lambda), \quad
              (\theta_{t+1}, \sigma_{t+1}) = \text{opt.update}(\nabla_\theta
              L(\theta_t, \lambda; b_t), \sigma_t, \theta_t), \quad \theta_0 = \text{params0}

    Within ``memory_budget``, the last steps keep their graphs (one backward pass through
    them, as the unrolled graph: no replay); the states of the other steps are stored in one
    preallocated buffer (``|s|`` = parameters + optimizer slots each) and each of those steps
    is replayed once with a vector-Jacobian product; when even the states do not fit, only
    every k-th is stored and the segments are recomputed. The result is the same whatever the
    plan (up to float rounding).

    Args:
        inner_loss: ``inner_loss(params, batch) -> scalar``; ``params`` mirrors ``params0``. It
            may close over hyperparameter tensors (L2 coefficients, per-example weights).
        outer_loss: ``outer_loss(params) -> scalar`` at the last iterate (e.g. validation).
        params0: initial parameters: a dict, ``module.named_parameters()``, a module, or a
            tuple of tensors of one dtype and device.
        opt: a :mod:`gradkit.optim` optimizer; tensors it was built with (``sgd(lr=lr)``) are
            hyperparameters when listed in ``hyper``.
        steps: the number of inner steps T, an int >= 1.
        hyper: ``name -> tensor`` to differentiate: any tensor the optimizer or the losses use
            (or one of ``params0``'s tensors: initial weights). They need not require grad;
            ``requires_grad`` is switched on for the duration of the call and restored.
        batches: None (``inner_loss(params, None)``), a list (step t uses
            ``batches[t % len]``), or a callable ``t -> batch`` that returns the same batch
            whenever asked for step t (steps are replayed).
        checkpoint_every: None stores every state (memory ``T |s|``, each step computed
            twice: forward, then replayed); ``k`` stores every k-th state and recomputes each
            segment (memory ``(ceil(T/k) + k - 1) |s|``, one more forward per step);
            ``"sqrt"`` uses ``k = ceil(sqrt(T))``; ``k > T`` stores only the first state. The
            result is the same. Keeps no graph (``memory_budget`` must then be ``"auto"`` or
            None, and is not used).
        memory_budget: bytes for kept graphs and stored states: a number, a size such as
            ``"2GB"`` or ``"512MiB"``, ``"auto"`` (the default: an eighth of the memory
            available on the parameters' device when the call starts), or None (no graph
            kept, every state stored: the least time without graphs, ``T |s|`` bytes). A
            step's graph is measured on the first step (the storages autograd saves for it).
            Everything fits: the unrolled graph's time; otherwise as many of the last steps'
            graphs as fit beside the other states; below ``T |s|``: the checkpoint stride that
            fits; below square-root checkpointing's need: that, with a
            :class:`MemoryBudgetWarning`. On CPU the process's resident memory can exceed the
            budget: glibc's allocator keeps freed blocks of the many transient step tensors
            (measured up to 4x on the suite's MLP; ``MALLOC_MMAP_THRESHOLD_=65536`` removes
            most of it).
        full_output: return a :class:`HyperResult` (grads, outer loss, last iterate).

    Returns:
        ``{name: d outer_loss / d hyper[name]}`` shaped like each tensor (detached).

    Raises:
        ValueError: for a hyperparameter nothing depends on that is not one of the tensors
            the optimizer was built with (the optimizer was built from ``lr.item()``, or
            ``hyper`` holds a copy of its tensor), an inner loss that gives no parameter a
            gradient, a non-scalar loss, ``steps < 1`` / ``checkpoint_every < 1``, or
            ``batches`` that give a replayed step another batch than its first run (its inner
            loss changed by a relative 1e-4).
        TypeError: for arguments of the wrong type (``steps=2.0``, ``checkpoint_every=True``).

    A tensor the optimizer was built with (identity, not value) gets an exact 0 where the outer
    loss does not depend on it: SGD's momentum and dampening at ``steps=1`` (the first step's
    buffer is the gradient itself), the hyperparameters of a parameter that never gets a
    gradient.

    A parameter the inner loss does not use at a step (a branch not taken, a layer unfrozen
    later) gets no gradient there and is skipped by the optimizer, as ``torch.optim`` skips a
    parameter whose ``.grad`` is None: weights, slots and its step count stay as they are.

    Examples:
        >>> import torch
        >>> from gradkit import hyper, optim
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> lr, l2 = torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.01, dtype=torch.float64)
        >>> inner = lambda p, batch: ((X @ p["w"] - y) ** 2).mean() + l2 * (p["w"] ** 2).sum()
        >>> outer = lambda p: ((X @ p["w"] - y) ** 2).mean()
        >>> params0 = {"w": torch.zeros(3, dtype=torch.float64)}
        >>> g = hyper.reverse(inner, outer, params0, optim.sgd(lr=lr, momentum=0.9), steps=50,
        ...                   hyper={"lr": lr, "l2": l2})
        >>> g2 = hyper.reverse(inner, outer, params0, optim.sgd(lr=lr, momentum=0.9), steps=50,
        ...                    hyper={"lr": lr, "l2": l2}, checkpoint_every="sqrt")
        >>> sorted(g), torch.allclose(g["l2"], g2["l2"], rtol=1e-12)
        (['l2', 'lr'], True)
    """
    res = _engine(
        "reverse(inner_loss, outer_loss, params0, opt)",
        inner_loss,
        outer_loss,
        params0,
        opt,
        steps,
        hyper,
        batches,
        checkpoint_every,
        None,
        full_output,
        memory_budget,
    )
    return res if full_output else res.grads


def truncated(
    inner_loss: Callable[..., Any],
    outer_loss: Callable[..., Any],
    params0: Any,
    opt: Any,
    *,
    steps: int,
    last: int,
    hyper: dict[str, torch.Tensor],
    batches: Any = None,
    checkpoint_every: int | str | None = None,
    full_output: bool = False,
) -> Any:
    r"""Truncated reverse mode: run ``steps`` steps, back-propagate through the ``last`` ones.

    .. math:: \frac{\partial E}{\partial \lambda} + \sum_{t = T - K}^{T - 1}
              a_{t+1}^\top \frac{\partial \Phi_t}{\partial \lambda}, \quad K = \text{last}

    i.e. the exact hypergradient of the problem that starts from the (constant) state
    :math:`s_{T-K}` (FAR-HO's ``ReverseHG.truncated``). ``last = steps`` gives :func:`reverse`,
    its errors included; ``last = 0`` only the direct term. Only K states are stored. Arguments
    as :func:`reverse`; paths cut by a truncation (``last < steps``) give zeros, not an error.

    Examples:
        >>> import torch
        >>> from gradkit import hyper, optim
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> l2 = torch.tensor(0.01, dtype=torch.float64)
        >>> inner = lambda p, batch: ((X @ p["w"] - y) ** 2).mean() + l2 * (p["w"] ** 2).sum()
        >>> outer = lambda p: ((X @ p["w"] - y) ** 2).mean()
        >>> args = (inner, outer, {"w": torch.zeros(3, dtype=torch.float64)}, optim.sgd(lr=0.1))
        >>> full = hyper.reverse(*args, steps=30, hyper={"l2": l2})
        >>> torch.allclose(hyper.truncated(*args, steps=30, last=30, hyper={"l2": l2})["l2"],
        ...                full["l2"], rtol=1e-12)
        True
        >>> hyper.truncated(*args, steps=30, last=0, hyper={"l2": l2})["l2"]
        tensor(0., dtype=torch.float64)
    """
    call = "truncated(inner_loss, outer_loss, params0, opt)"
    res = _engine(
        call,
        inner_loss,
        outer_loss,
        params0,
        opt,
        steps,
        hyper,
        batches,
        checkpoint_every,
        last,
        full_output,
    )
    return res if full_output else res.grads

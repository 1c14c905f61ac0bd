"""The outer loop of gradient-based hyperparameter optimization: :class:`HyperOptimizer`.

Each hyper-step computes the hypergradient with one engine, hands it to a ``torch.optim``
optimizer over the hyperparameter tensors, projects the new values onto their constraint sets,
and records what happened:

* ``"reverse"``, ``"truncated"``, ``"forward"``: train ``steps`` inner steps from the initial
  parameters (or from the last iterate with ``warm_start``), differentiate through them;
* ``"implicit"``: train ``steps`` inner steps, then implicit differentiation at the iterate;
* ``"rtho"``: real-time forward mode (Franceschi et al. 2017): one training run that never
  restarts; every hyper-step trains ``steps`` more inner steps, carrying the tangents along,
  and updates the hyperparameters while training goes on.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from gradkit._errors import GradkitError, describe, message
from gradkit._tree import leaves, rebuild, structure_of
from gradkit._validate import check_bool, check_callable, check_choice
from gradkit.hyper._budget import budget_bytes
from gradkit.hyper._forward import forward
from gradkit.hyper._implicit import implicit
from gradkit.hyper._online import OnlineTangents
from gradkit.hyper._outer import (
    check_method_options,
    check_projections,
    check_state_dict,
    outer_optimizer,
)
from gradkit.hyper._problem import (
    Dynamics,
    HyperResult,
    check_hyper,
    check_steps,
)
from gradkit.hyper._reverse import reverse, truncated

__all__ = ["HyperOptimizer", "HyperStep"]

logger = logging.getLogger(__name__)

_CALL = "HyperOptimizer"
_METHODS = ("reverse", "truncated", "forward", "rtho", "implicit")
_FORMAT = "gradkit.hyper.HyperOptimizer/1"


class HyperStep(NamedTuple):
    """What one hyper-step did (an entry of :attr:`HyperOptimizer.history`).

    Attributes:
        iteration: the hyper-step's index, from 0.
        inner_steps: inner steps trained when the hypergradient was taken (``"rtho"``: since
            the start of the run; the other methods: per hyper-step).
        outer_loss: the outer loss at the hyperparameter values ``hyper``.
        grad_norm: the L2 norm of the hypergradient over all hyperparameters.
        hyper: the values at which ``outer_loss`` and the hypergradient were taken (before
            this step's update; detached copies), or ``{}`` with ``record=False``.
        grads: the hypergradient at those values, or ``{}`` with ``record=False``.
        seconds: the wall time of the hyper-step.
    """

    iteration: int
    inner_steps: int
    outer_loss: float
    grad_norm: float
    hyper: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    seconds: float


class HyperOptimizer:
    r"""The outer loop: hypergradient, ``torch.optim`` step, projection, record.

    Minimizes the outer loss :math:`E(\theta_T(\lambda), \lambda)` over the hyperparameter
    tensors ``hyper`` (updated in place, like ``torch.optim`` updates parameters). The
    hypergradient comes from the engine that ``method`` names:

    * ``"reverse"``: :func:`reverse` through ``steps`` inner steps (exact; memory
      ``steps`` states, or fewer with ``checkpoint_every``);
    * ``"truncated"``: :func:`truncated` through the last ``last`` of ``steps`` steps;
    * ``"forward"``: :func:`forward` (exact; memory independent of ``steps``; one pass per
      hyperparameter element);
    * ``"rtho"``: real-time forward mode: one training run; each hyper-step trains ``steps``
      more steps with the tangents carried along, then updates the hyperparameters and goes on
      training (the first hypergradient is :func:`forward`'s over those ``steps`` steps);
    * ``"implicit"``: ``steps`` inner steps, then :func:`implicit` at the last iterate.

    After the outer optimizer's step each projection maps its hyperparameter onto its
    constraint set (box, simplex, L1 ball, capped simplex: :func:`projection`, or any
    function). Every hyper-step is recorded in :attr:`history` and logged at INFO level
    through ``logging.getLogger("gradkit.hyper._optimizer")``; ``callback(record)`` runs
    after it (return ``True`` to stop :meth:`run`). :meth:`state_dict` /
    :meth:`load_state_dict` resume a run exactly.

    Args:
        inner_loss, outer_loss, params0, opt: the inner problem, as for :func:`reverse`.
        hyper: ``name -> tensor``: the hyperparameters to tune: leaf tensors the optimizer was
            built with or the losses close over.
        method: ``"reverse"``, ``"truncated"``, ``"forward"``, ``"rtho"`` or ``"implicit"``.
        steps: inner steps per hyper-step (``"rtho"``: between two hyperparameter updates), an
            int >= 1 (``"implicit"``: >= 0, 0 taking ``params0`` as the optimum).
        outer_opt: a ``torch.optim.Optimizer`` over exactly the hyperparameter tensors, a
            factory ``list[Tensor] -> Optimizer`` (``functools.partial(torch.optim.Adam,
            lr=0.01)``), or None: Adam with lr 1e-3.
        projections: ``name -> projection`` (a name of :func:`projection` or a function
            tensor -> tensor), applied after each outer step.
        batches: as for :func:`reverse`; step ``t`` counts within one inner run (``"rtho"``:
            from the start of the run).
        checkpoint_every: ``"reverse"``/``"truncated"``: as for :func:`reverse`.
        memory_budget: ``"reverse"``: as for :func:`reverse` (default ``"auto"``).
        last: ``"truncated"``: the number of steps back-propagated (required there).
        implicit_options: ``"implicit"``: keyword arguments of :func:`implicit` (``method``,
            ``tol``, ``maxiter``, ``alpha``, ``damping``, ``stationary_tol``, ``batch``).
        warm_start: offline methods: start each inner run from the last iterate of the
            previous one (with a fresh optimizer state) instead of ``params0``.
        callback: called with each :class:`HyperStep`; returning ``True`` stops :meth:`run`.
        record: keep copies of the hyperparameters and of the hypergradient in each record
            (False: numbers only, for many hyperparameters over many hyper-steps).

    Attributes:
        hyper: ``name -> tensor``, the tensors being tuned (the caller's own).
        history: one :class:`HyperStep` per hyper-step done.
        params: the last inner iterate (detached): for the offline methods the parameters
            the last hypergradient was taken at, for ``"rtho"`` the current ones.
        outer_opt: the ``torch.optim`` optimizer over the hyperparameters.

    Examples:
        >>> import functools, torch
        >>> from gradkit import hyper, optim
        >>> X, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
        >>> l2 = torch.tensor(1.0, dtype=torch.float64)
        >>> inner = lambda p, b: ((X[:20] @ p["w"] - y[:20]) ** 2).mean() + l2 * p["w"] @ p["w"]
        >>> outer = lambda p: ((X[20:] @ p["w"] - y[20:]) ** 2).mean()
        >>> hopt = hyper.HyperOptimizer(
        ...     inner, outer, {"w": torch.zeros(3, dtype=torch.float64)}, optim.sgd(lr=0.1),
        ...     {"l2": l2}, steps=50, outer_opt=functools.partial(torch.optim.Adam, lr=0.05),
        ...     projections={"l2": "nonnegative"})
        >>> history = hopt.run(20)
        >>> history[-1].outer_loss < history[0].outer_loss, float(l2) >= 0
        (True, True)
    """

    def __init__(
        self,
        inner_loss: Callable[..., Any],
        outer_loss: Callable[..., Any],
        params0: Any,
        opt: Any,
        hyper: dict[str, torch.Tensor],
        *,
        method: str = "reverse",
        steps: int,
        outer_opt: Any = None,
        projections: Mapping[str, Any] | None = None,
        batches: Any = None,
        checkpoint_every: int | str | None = None,
        memory_budget: int | float | str | None = "auto",
        last: int | None = None,
        implicit_options: Mapping[str, Any] | None = None,
        warm_start: bool = False,
        callback: Callable[[HyperStep], Any] | None = None,
        record: bool = True,
    ) -> None:
        check_choice(method, _METHODS, _CALL, "method")
        self.method = method
        self.names, hypers = check_hyper(hyper, _CALL)
        self.hyper: dict[str, torch.Tensor] = dict(zip(self.names, hypers, strict=True))
        # implicit may start at an optimum already (steps=0); the others train at least a step
        self.steps = check_steps(steps, _CALL, low=0 if method == "implicit" else 1)
        last = check_method_options(
            method, self.steps, checkpoint_every, last, implicit_options, warm_start
        )
        if not (isinstance(memory_budget, str) and memory_budget == "auto"):
            budget_bytes(memory_budget, torch.device("cpu"), _CALL)  # its type and value now
            if method != "reverse" or checkpoint_every is not None:
                raise ValueError(
                    message(
                        _CALL,
                        "memory_budget",
                        "'auto' (the default) unless method='reverse' without checkpoint_every",
                        repr(memory_budget),
                        "drop memory_budget (or checkpoint_every: the budget chooses the stride)",
                    )
                )
        check_bool(record, _CALL, "record")
        if callback is not None:
            check_callable(callback, _CALL, "callback", "a function (HyperStep) -> bool | None")
        self.inner_loss = inner_loss
        self.outer_loss = outer_loss
        self.opt = opt
        self.batches = batches
        self.checkpoint_every = checkpoint_every
        self.memory_budget = memory_budget
        self.last = last
        self.implicit_options = dict(implicit_options or {})
        self.warm_start = warm_start
        self.callback = callback
        self.record = record
        # checks the inner problem now (losses, optimizer, params0), not at the first step
        self._dyn = Dynamics(inner_loss, outer_loss, opt, params0, batches, _CALL)
        self._module = params0 if isinstance(params0, torch.nn.Module) else None
        if method not in ("rtho", "implicit"):  # (RTHO's steps go on across hyper-steps)
            self._dyn.check_steps(self.steps)
        self._start = self._dyn.params0
        if warm_start:
            held = {id(p) for p in leaves(self._start, self._dyn.structure, _CALL, "params0")}
            if any(id(h) in held for h in hypers):
                raise ValueError(
                    message(
                        _CALL,
                        "warm_start",
                        "False when a hyperparameter is one of params0's tensors",
                        "True",
                        "tune initial weights without warm_start",
                    )
                )
            self._start = rebuild(
                self._dyn.structure,
                [p.detach().clone() for p in leaves(self._start, self._dyn.structure, _CALL, "")],
            )
        self.projections = check_projections(projections, self.names)
        self.outer_opt = outer_optimizer(outer_opt, hypers)
        self.history: list[HyperStep] = []
        self.params: Any = None
        self._online: OnlineTangents | None = None

    # -- one hyper-step ----------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        """The number of hyper-steps done."""
        return len(self.history)

    def _kwargs(self) -> dict[str, Any]:
        return {"steps": self.steps, "hyper": self.hyper, "batches": self.batches}

    def _hypergradient(self) -> tuple[float, dict[str, torch.Tensor], Any, int]:
        """``(outer loss, grads, params, inner steps)`` at the current hyperparameters."""
        args = (self.inner_loss, self.outer_loss, self._start, self.opt)
        res: HyperResult
        kw: dict[str, Any] = {**self._kwargs(), "full_output": True}
        if self.method == "reverse":
            res = reverse(
                *args,
                checkpoint_every=self.checkpoint_every,
                memory_budget=self.memory_budget,
                **kw,
            )
        elif self.method == "truncated":
            last = self.steps if self.last is None else self.last
            res = truncated(*args, last=last, checkpoint_every=self.checkpoint_every, **kw)
        elif self.method == "forward":
            res = forward(*args, **kw)
        elif self.method == "implicit":
            res = implicit(
                self.inner_loss,
                self.outer_loss,
                self._train(),
                self.hyper,
                **self.implicit_options,
                full_output=True,
            )
        else:
            return self._rtho()
        return float(res.outer_loss), res.grads, res.params, self.steps

    def _train(self) -> Any:
        """``steps`` inner steps without any graph from the start; the last iterate."""
        dyn = Dynamics(self.inner_loss, self.outer_loss, self.opt, self._start, self.batches, _CALL)
        s = dyn.initial().detach()
        for t in range(self.steps):
            s = dyn.step(s, t)
        return dyn.layout.params_of(s)

    def _rtho(self) -> tuple[float, dict[str, torch.Tensor], Any, int]:
        online = self._online_state()
        first = online.t == 0
        # the run goes on across hyper-steps: a schedule needs a value for every step of it
        self._dyn.check_steps(online.t + self.steps)
        for _ in range(self.steps):
            online.step()
        value, grads = online.hypergradient(check_unused=first)
        return float(value), dict(zip(self.names, grads, strict=True)), online.params(), online.t

    def _online_state(self) -> OnlineTangents:
        if self._online is None:
            self._online = OnlineTangents(self._dyn, self.names, list(self.hyper.values()))
        return self._online

    def step(self) -> HyperStep:
        """One hyper-step: hypergradient, outer optimizer step, projections, record.

        Returns:
            The :class:`HyperStep` appended to :attr:`history`.

        Raises:
            FloatingPointError: the outer loss or the hypergradient is not finite (lower the
                inner or the outer learning rate).
        """
        start = time.perf_counter()
        self._check_model()
        snapshot = {k: h.detach().clone() for k, h in self.hyper.items()} if self.record else {}
        # RTHO's inner run goes on from hyper-step to hyper-step: a step that fails (a refused
        # outer step, a non-finite hypergradient) must not keep the inner steps it took
        online = self._online.state_dict() if self._online is not None else None
        try:
            return self._step(start, snapshot)
        except BaseException:
            if online is None:  # made by this step
                self._online = None
            else:
                self._online_state().load_state_dict(online, f"{_CALL}.step()")
            raise

    def _step(self, start: float, snapshot: dict[str, torch.Tensor]) -> HyperStep:
        versions = self._dyn.buffer_versions()
        value, grads, params, inner_steps = self._hypergradient()
        # the engines run on the module's parameters (a dict): its buffers are checked here
        self._dyn.check_buffers(versions)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        if not (math.isfinite(value) and math.isfinite(norm)):
            raise FloatingPointError(
                message(
                    f"{_CALL}.step",
                    "hypergradient",
                    "a finite outer loss and hypergradient",
                    f"outer loss {value}, hypergradient norm {norm} at hyper-step {self.iteration}",
                    "lower the inner learning rate or the outer optimizer's",
                )
            )
        self._apply(grads)
        self.params = params
        if self.warm_start:
            self._start = rebuild(
                self._dyn.structure,
                [
                    p.detach().clone()
                    for p in leaves(params, structure_of(params, _CALL), _CALL, "")
                ],
            )
        kept = {k: g.detach().clone() for k, g in grads.items()} if self.record else {}
        record = HyperStep(
            self.iteration, inner_steps, value, norm, snapshot, kept, time.perf_counter() - start
        )
        self.history.append(record)
        logger.info(
            "hyper-step %d (%s): outer loss %.6g, hypergradient norm %.3g, %.2f s",
            record.iteration,
            self.method,
            value,
            norm,
            record.seconds,
        )
        return record

    def _check_model(self) -> None:
        """Refuse a module given as ``params0`` whose trainable parameters are no longer the
        ones it had when this optimizer was built (frozen, unfrozen, replaced or added since):
        the hypergradients would train the old set, silently (a layer replaced since was never
        used, 104 % off)."""
        if self._module is None:
            return
        built = self._dyn.params0
        now = {k: p for k, p in self._module.named_parameters() if p.requires_grad}
        if now.keys() == built.keys() and all(now[k] is built[k] for k in now):
            return
        changed = sorted(set(now) ^ set(built)) + [
            k for k in now if k in built and now[k] is not built[k]
        ]
        raise GradkitError(
            message(
                f"{_CALL}.step()",
                "params0",
                "the module's trainable parameters as when the HyperOptimizer was built",
                ", ".join(repr(k) for k in changed[:3])
                + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                + " changed since (frozen, unfrozen, replaced or added)",
                "build a new HyperOptimizer from the model as it is now (frozen parameters are "
                "left out of params0, as torch.optim leaves them)",
            )
        )

    def _apply(self, grads: dict[str, torch.Tensor]) -> None:
        """Outer optimizer step with ``grads`` as the hyperparameters' ``.grad`` (restored
        afterwards), then the projections, in place. When a projection fails, the
        hyperparameters and the outer optimizer's state are restored: a failed step changes
        nothing."""
        values = {name: h.detach().clone() for name, h in self.hyper.items()}
        outer_state = copy.deepcopy(self.outer_opt.state_dict())
        saved = {name: h.grad for name, h in self.hyper.items()}
        try:
            for name, h in self.hyper.items():
                h.grad = grads[name].detach().to(h.dtype).reshape(h.shape).clone()
            with torch.no_grad():
                self.outer_opt.step()
        finally:
            for name, h in self.hyper.items():
                h.grad = saved[name]
        try:
            with torch.no_grad():
                projected = {
                    name: proj(self.hyper[name].detach()) for name, proj in self.projections.items()
                }
                for name, value in projected.items():
                    h = self.hyper[name]
                    if not isinstance(value, torch.Tensor) or value.shape != h.shape:
                        raise ValueError(
                            message(
                                _CALL,
                                f"projections[{name!r}]",
                                f"a function returning a tensor of shape {tuple(h.shape)}",
                                describe(value),
                                "return the projected tensor, shaped like its input",
                            )
                        )
                for name, value in projected.items():
                    self.hyper[name].copy_(value)
            self._check_values()
        except BaseException:
            with torch.no_grad():
                for name, h in self.hyper.items():
                    h.copy_(values[name])
            self.outer_opt.load_state_dict(outer_state)
            raise

    def _check_values(self) -> None:
        """Check the inner optimizer's hyperparameters after the outer step, as the optimizer
        checked them when built: the outer step may move one out of range (a negative learning
        rate trained on silently)."""
        try:
            self.opt.check_values(f"{_CALL}.step()")
        except ValueError as err:
            if hasattr(err, "add_note"):  # Python 3.11
                err.add_note(
                    "The outer step moved it there: keep it in range with projections={name: ...} "
                    "(e.g. lambda v: v.clamp_min(0)), or lower the outer optimizer's learning rate."
                )
            raise

    def run(self, iterations: int) -> list[HyperStep]:
        """``iterations`` hyper-steps (fewer when the callback returns ``True``).

        Returns:
            The records of this call's hyper-steps.
        """
        iterations = check_steps(iterations, f"{_CALL}.run", "iterations", low=0)
        done: list[HyperStep] = []
        for _ in range(iterations):
            record = self.step()
            done.append(record)
            if self.callback is not None and self.callback(record) is True:
                logger.info("hyper-step %d: the callback stopped the run", record.iteration)
                break
        return done

    # -- saving and resuming -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: hyperparameter values, the outer optimizer's state,
        the history, the warm start and the RTHO training state. Plain containers of tensors
        and numbers, loadable with ``torch.load(path, weights_only=True)``."""
        warm = None
        if self.warm_start:
            warm = [p.clone() for p in leaves(self._start, self._dyn.structure, _CALL, "params0")]
        return {
            "format": _FORMAT,
            "method": self.method,
            "names": list(self.names),
            "hyper": {k: h.detach().clone() for k, h in self.hyper.items()},
            "outer_opt": self.outer_opt.state_dict(),
            "history": [r._asdict() for r in self.history],
            "warm_start": warm,
            "online": None if self._online is None else self._online.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the hyperparameter tensors get the saved values (in
        place), the outer optimizer its state, and the run continues where it stopped.

        Raises:
            ValueError: a state of another method, other hyperparameter names or shapes.
        """
        call = f"{_CALL}.load_state_dict"
        fix = "load a state_dict() of a HyperOptimizer built the same way"
        # check everything before changing anything: a failed load leaves the run as it was
        check_state_dict(state_dict, _FORMAT, self.method, self.names, self.hyper, call, fix)
        try:
            history = [HyperStep(**r) for r in state_dict["history"]]
        except TypeError as err:
            raise ValueError(
                message(call, "state_dict['history']", "HyperStep records", str(err), fix)
            ) from None
        warm = state_dict.get("warm_start")
        start = self._start
        if self.warm_start and warm is not None:
            shapes = [p.shape for p in leaves(self._start, self._dyn.structure, _CALL, "")]
            if (
                not isinstance(warm, (list, tuple))
                or [getattr(p, "shape", None) for p in warm] != shapes
            ):
                raise ValueError(
                    message(
                        call,
                        "state_dict['warm_start']",
                        f"tensors of shapes {[tuple(s) for s in shapes]}",
                        describe(warm),
                        fix,
                    )
                )
            start = rebuild(self._dyn.structure, [p.detach().clone() for p in warm])
        saved_outer = copy.deepcopy(self.outer_opt.state_dict())
        try:
            self.outer_opt.load_state_dict(state_dict["outer_opt"])
            online = state_dict.get("online")
            if online is not None:
                self._online_state().load_state_dict(online, call)
        except (ValueError, KeyError, TypeError) as err:
            self.outer_opt.load_state_dict(saved_outer)
            if isinstance(err, ValueError) and str(err).startswith(call):
                raise
            raise ValueError(
                message(
                    call, "state_dict['outer_opt']", "the outer optimizer's state", str(err), fix
                )
            ) from None
        with torch.no_grad():
            for name, h in self.hyper.items():
                h.copy_(state_dict["hyper"][name])
        self.history = history
        self._start = start
        if online is not None:
            self.params = self._online_state().params()

"""What the hypergradient engines share: argument checks, replayable batches, hyperparameter
tensors made differentiable for the duration of a call, and the inner dynamics as a map on one
flat state vector ``s_t`` (parameters and optimizer slots, see :func:`gradkit.optim.state_layout`):

.. math:: s_{t+1} = \\Phi_t(s_t, \\lambda) = s_t \\oplus
          \\text{opt.update}(\\nabla_\\theta L(\\theta_t, \\lambda; \\text{batch}_t), \\ldots)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gradkit._errors import describe, message
from gradkit._tree import entries, leaves, rebuild, structure_of
from gradkit._validate import check_callable, check_int
from gradkit.optim import Optimizer, state_layout

__all__ = [
    "Batches",
    "Dynamics",
    "HyperResult",
    "check_hyper",
    "check_params",
    "check_scalar",
    "check_steps",
    "hyper_leaves",
    "optimizer_tensors",
    "unused_error",
]


REPLAY_RTOL = 1e-4
"""Largest relative change of a step's inner loss between its first run and its replay that
is taken for round-off (nondeterministic GPU reductions) rather than another batch."""


class HyperResult(NamedTuple):
    """What an engine returns with ``full_output=True``.

    Attributes:
        grads: ``name -> d outer_loss / d hyper[name]``, each shaped like its tensor.
        outer_loss: the outer loss at the last iterate (detached).
        params: the last iterate (or the given optimum for :func:`implicit`), detached.
        residual: :func:`implicit` only: ``||H q - g|| / ||g||`` of the linear solve.
        iterations: :func:`implicit` only: Hessian-vector products spent, the 20 that
            estimate a default ``alpha`` (``"neumann"``, ``"fixed_point"``) included.
        inner_grad_norm: :func:`implicit` only: ``||grad inner_loss(params_star)||``, how far
            the given point is from stationary (0 at an exact optimum).
    """

    grads: dict[str, torch.Tensor]
    outer_loss: torch.Tensor
    params: Any
    residual: torch.Tensor | None = None
    iterations: int | None = None
    inner_grad_norm: torch.Tensor | None = None


def _frozen(p: Any) -> bool:
    """A module's parameter that ``torch.optim`` would not train."""
    from torch import nn

    return isinstance(p, nn.Parameter) and not p.requires_grad


def check_params(params: Any, call: str, argument: str = "params0") -> Any:
    """A dict ``name -> tensor`` (from a dict, a module, or ``named_parameters()``) or a tuple of
    floating-point tensors. A module's frozen parameters (``requires_grad=False``) are left
    out, as ``torch.optim`` leaves them: they stay the module's, constant (they were trained,
    1.3 % off the hypergradient of a model with a frozen layer)."""
    from torch import nn

    module = params if isinstance(params, nn.Module) else None
    if module is not None:
        params = module.named_parameters()
    if not isinstance(params, (Mapping, tuple, list, torch.Tensor)) and hasattr(params, "__iter__"):
        items = list(params)
        if all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items):
            trained = [(k, p) for k, p in items if not _frozen(p)]
            if items and not trained:
                raise ValueError(
                    message(
                        call,
                        argument,
                        "parameters of which at least one requires grad",
                        f"{len(items)} parameter(s), all frozen (requires_grad=False)",
                        "unfreeze the parameters to train (p.requires_grad_(True))",
                    )
                )
            params = dict(trained)
        else:
            params = items
    structure = structure_of(params, call, argument)
    seen: dict[int, Any] = {}
    for key, p in zip(structure.keys, leaves(params, structure, call, argument), strict=True):
        first = seen.setdefault(id(p), key)
        if first != key:  # trained twice, or untied by functional_call's tie_weights=False
            raise ValueError(
                message(
                    call,
                    argument,
                    "each tensor once",
                    f"the same tensor as {argument}[{first!r}] and {argument}[{key!r}] (tied "
                    "weights)",
                    "give it once: model.named_parameters() or the module itself list a tied "
                    "tensor once, and functional_call ties it back",
                )
            )
        if not p.is_floating_point():
            raise TypeError(
                message(
                    call,
                    f"{argument}[{key!r}]",
                    "a floating-point tensor",
                    describe(p),
                    "convert it with .double() or .float()",
                )
            )
    values = leaves(params, structure, call, argument)
    kinds: dict[tuple[torch.dtype, torch.device], Any] = {}
    for key, p in zip(structure.keys, values, strict=True):
        kinds.setdefault((p.dtype, p.device), key)  # the first parameter of each
    if len(kinds) > 1:  # the engines keep them in one buffer (the state's rows)
        shown = [f"{argument}[{k!r}] is {dt} on {dev}" for (dt, dev), k in list(kinds.items())[:2]]
        raise TypeError(
            message(
                call,
                argument,
                "tensors of one dtype on one device (the steps keep them in one buffer)",
                ", ".join(shown),
                "convert the model or the tensors to one (model.double(), .float(), .to(device))",
            )
        )
    return rebuild(structure, values)


def check_hyper(
    hyper: Any,
    call: str,
    fix: str = "pass e.g. hyper={'lr': lr} with the tensor the optimizer or the losses use",
) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of ``hyper``: a non-empty dict ``name -> floating tensor``, each tensor
    given once."""
    if not isinstance(hyper, Mapping) or not hyper:
        raise TypeError(
            message(
                call,
                "hyper",
                "a non-empty dict name -> tensor (the hyperparameters to differentiate)",
                describe(hyper),
                fix,
            )
        )
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: dict[int, str] = {}
    for name, h in hyper.items():
        if not isinstance(h, torch.Tensor) or not h.is_floating_point():
            raise TypeError(
                message(
                    call,
                    f"hyper[{name!r}]",
                    "a floating-point tensor",
                    describe(h),
                    "pass the tensor itself (a float copy has no gradient): torch.tensor(0.1)",
                )
            )
        if id(h) in seen:
            raise ValueError(
                message(
                    call,
                    f"hyper[{name!r}]",
                    "each tensor once",
                    f"the tensor of hyper[{seen[id(h)]!r}] again",
                    "list each hyperparameter under one name",
                )
            )
        seen[id(h)] = name
        names.append(str(name))
        tensors.append(h)
    return names, tensors


def check_steps(steps: Any, call: str, argument: str = "steps", *, low: int = 1) -> int:
    """``steps`` as an int >= ``low``: a TypeError for a bool, a float or a string, a
    ValueError below ``low``. Inner steps count from 1 (no step: nothing to differentiate
    through); ``low=0`` for counts that may be zero (``last``, ``iterations``)."""
    return check_int(steps, call, argument, low=low, example="100" if low >= 1 else "10")


def check_last(last: Any, steps: int, call: str) -> int:
    """``last`` (the steps a truncated hypergradient back-propagates through) as an int in
    ``[0, steps]``."""
    last = check_steps(last, call, "last", low=0)
    if last > steps:
        raise ValueError(
            message(
                call,
                "last",
                f"an int in [0, steps={steps}]",
                repr(last),
                "lower last or raise steps",
            )
        )
    return last


def check_scalar(value: Any, call: str, which: str) -> torch.Tensor:
    """``value`` if it is a one-element floating tensor, else a ValueError naming ``which``."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise ValueError(
            message(
                call,
                which,
                "a function returning a scalar floating-point tensor",
                describe(value),
                "reduce the loss with .mean() or .sum()",
            )
        )
    return value.reshape(())


def optimizer_tensors(opt: Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` for every tensor ``opt`` was built with: each tensor hyperparameter
    (a scalar or a schedule) and each tensor entry of a per-parameter value, ``where`` being
    the way to reach it from ``opt.hyperparams`` (``['momentum']``, ``['weight_decay']['w']``)."""
    found: list[tuple[str, torch.Tensor]] = []
    for key, value in opt.hyperparams.items():
        items: list[tuple[Any, Any]] = [(None, value)]
        if isinstance(value, Mapping):
            items = list(value.items())
        elif isinstance(value, tuple):
            items = list(enumerate(value))
        for sub, v in items:
            if isinstance(v, torch.Tensor):
                found.append((f"[{key!r}]" + ("" if sub is None else f"[{sub!r}]"), v))
    return found


def _copy_of(h: torch.Tensor, opt: Optimizer | None) -> str | None:
    """Where in ``opt.hyperparams`` a tensor is that ``h`` equals without being it (a copy)."""
    if opt is None:
        return None
    for where, v in optimizer_tensors(opt):
        if (
            v.shape == h.shape
            and v.dtype == h.dtype
            and v.device == h.device
            and torch.equal(v.detach(), h.detach())
        ):
            return where
    return None


def unused_error(
    call: str,
    name: str,
    fix: str | None = None,
    *,
    h: torch.Tensor | None = None,
    opt: Optimizer | None = None,
) -> ValueError:
    """The error for a hyperparameter that is not one of the optimizer's tensors and that no
    loss and no step depends on. Given the tensor ``h`` and the optimizer, a copy of one of the
    optimizer's tensors (equal values, another tensor) is named as such."""
    got = "a tensor nothing depends on (no path to the outer loss)"
    where = None if h is None else _copy_of(h, opt)
    if where is not None:
        got += f" that equals opt.hyperparams{where} but is another tensor (a copy)"
        fix = f"pass the optimizer's own tensor, opt.hyperparams{where}, not a copy of it"
    return ValueError(
        message(
            call,
            f"hyper[{name!r}]",
            "a tensor the optimizer or the losses use",
            got,
            fix
            or "build the optimizer with this very tensor (e.g. sgd(lr=lr), not lr.item()) or "
            "use it in inner_loss/outer_loss",
        )
    )


@contextlib.contextmanager
def hyper_leaves(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Make every hyperparameter require grad for the duration (restored after), so that
    graphs built by the losses and the optimizer reach it."""
    flipped = [h for h in tensors if not h.requires_grad]
    for h in flipped:
        h.requires_grad_(True)
    try:
        yield
    finally:
        for h in flipped:
            h.requires_grad_(False)


class Batches:
    """The batch of step ``t``: None (full batch), ``batches[t % len(batches)]`` (a list), or
    ``batches(t)`` (a callable that must give the same batch every time it is asked for ``t``:
    the engines replay steps)."""

    def __init__(self, batches: Any, call: str) -> None:
        self._call = call
        self._fn: Callable[[int], Any]
        if batches is None:
            self._fn = lambda t: None
        elif callable(batches):
            self._fn = batches
        elif isinstance(batches, list) and batches:
            items = list(batches)
            self._fn = lambda t: items[t % len(items)]
        else:
            hint = (
                "; if this tuple is one batch, pass [batch] or lambda t: batch"
                if isinstance(batches, tuple)
                else ""
            )
            raise TypeError(
                message(
                    call,
                    "batches",
                    "None, a non-empty list of batches, or a callable step -> batch",
                    describe(batches),
                    "pass e.g. batches=lambda t: (X[idx[t]], y[idx[t]])" + hint,
                )
            )

    def __call__(self, t: int) -> Any:
        return self._fn(t)


def grads_of(
    loss: Any, xs: Sequence[torch.Tensor], call: str, *, create_graph: bool
) -> list[torch.Tensor | None]:
    """``d loss / d xs``, ``None`` for a tensor the loss does not use: the optimizer then skips
    it (no update, its state and count untouched), as ``torch.optim`` skips a parameter whose
    ``.grad`` is None after ``loss.backward()``."""
    loss = check_scalar(loss, call, "inner_loss")
    if not loss.requires_grad:
        return [None] * len(xs)
    return list(torch.autograd.grad(loss, list(xs), create_graph=create_graph, allow_unused=True))


class Dynamics:
    """The inner problem as a map on flat states: ``step`` (no graph), ``vjp`` (one replayed
    step's vector-Jacobian product for state and hyperparameters together), ``outer``."""

    def __init__(
        self,
        inner_loss: Callable[..., Any],
        outer_loss: Callable[..., Any],
        opt: Any,
        params0: Any,
        batches: Any,
        call: str,
    ) -> None:
        check_callable(inner_loss, call, "inner_loss", "a function (params, batch) -> scalar")
        check_callable(outer_loss, call, "outer_loss", "a function params -> scalar")
        if not isinstance(opt, Optimizer):
            raise TypeError(
                message(
                    call,
                    "opt",
                    "a gradkit.optim optimizer",
                    f"a {type(opt).__module__}.{type(opt).__name__}"
                    if isinstance(opt, torch.optim.Optimizer)
                    else describe(opt),
                    "build it with gradkit.optim.sgd / adam / adamw / rmsprop (a functional "
                    "optimizer; torch.optim updates in place and cannot be differentiated "
                    "through)",
                )
            )
        self.call = call
        self.inner_loss = inner_loss
        self.outer_loss = outer_loss
        self.opt = opt
        opt.check_values(call)  # tensors changed in place since it was built, read once more
        # a module's buffers, checked at the first step: inner_loss must not update them
        self._buffers = (
            list(params0.named_buffers()) if isinstance(params0, torch.nn.Module) else []
        )
        self.params0 = check_params(params0, call)
        self.structure = structure_of(self.params0, call, "params0")
        self.state0 = opt.init(self.params0)
        self.layout = state_layout(self.params0, self.state0)
        self.batch = Batches(batches, call)
        self._n = len(self.structure.keys)
        # per-parameter counts before step t where they differ from t (a parameter without a
        # gradient at some step); plain ints beside the history buffer
        self._counts: dict[int, tuple[int, ...]] = {}
        self.any_gradient = False
        # the inner loss of each step's first run, and the relative gaps seen on replay
        # (one growing buffer and two scalars: the number of live tensors stays constant)
        self._losses: torch.Tensor | None = None
        self._stored = 0  # steps 0 .. _stored - 1 have their first loss in _losses
        self._worst: tuple[torch.Tensor, torch.Tensor] | None = None  # (gap, its step)

    def owns(self, h: torch.Tensor) -> bool:
        """Whether ``h`` is one of the tensors the optimizer was built with (by identity, not
        by value: a copy is not the optimizer's)."""
        return any(v is h for _, v in optimizer_tensors(self.opt))

    def check_reached(
        self, names: Sequence[str], hypers: Sequence[torch.Tensor], reached: Sequence[bool]
    ) -> None:
        """Raise for a hyperparameter with no path to the outer loss unless it is the
        optimizer's own tensor. Whether the unrolled loss depends on one of those is a matter
        of the steps run, not a mistake: SGD's momentum and dampening do not enter the first
        step (its buffer is the gradient), nor does the value of a parameter that never gets a
        gradient; their hypergradient is exactly 0, as finite differences give. A tensor that
        is not the optimizer's and that no loss uses (a copy of the optimizer's tensor, or the
        tensor whose ``.item()`` built it) cannot matter at any number of steps: that is a
        mistake to report."""
        for name, h, ok in zip(names, hypers, reached, strict=True):
            if not ok and h.numel() > 0 and not self.owns(h):
                raise unused_error(self.call, name, h=h, opt=self.opt)

    def check_steps(self, steps: int) -> None:
        """Refuse a schedule of the optimizer (a 1-d tensor hyperparameter, one value per
        step) shorter than ``steps``: it was found at the step it ran out, by the optimizer's
        update, which named neither the call nor ``steps``."""
        for key, value in self.opt.hyperparams.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] < steps:
                raise ValueError(
                    message(
                        self.call,
                        f"opt's {key}",
                        f"a schedule with a value for each of the {steps} steps",
                        f"a schedule of {value.shape[0]} values",
                        f"give {steps} values, or run {value.shape[0]} steps",
                    )
                )

    def check_outer(self, depends: bool) -> None:
        """:func:`check_outer` for this problem's call."""
        check_outer(self.call, depends)

    def counts_at(self, t: int) -> Any:
        """The per-parameter counts of the state before step ``t`` (None: ``t`` for all)."""
        c = self._counts.get(t)
        return None if c is None else rebuild(self.structure, list(c))

    def record(self, t: int, state: Any, grads: Any) -> None:
        """Keep the counts of ``state``, the state after step ``t``."""
        c = tuple(entries(state.counts, self.structure, self.call, "state.counts"))
        if c == (t + 1,) * self._n:
            self._counts.pop(t + 1, None)
        else:
            self._counts[t + 1] = c
        if not self.any_gradient:
            gs = leaves(grads, self.structure, self.call, "grads", allow_none=True)
            self.any_gradient = any(g is not None for g in gs)

    def no_gradient_error(self) -> ValueError:
        """The error for an inner loss that gave no parameter a gradient at any step."""
        return ValueError(
            message(
                self.call,
                "inner_loss",
                "a loss that depends on the parameters it is given",
                "a loss with no gradient for any parameter at any step (nothing trained)",
                "compute inner_loss from its params argument (not from a copy or a module's own "
                "weights)",
            )
        )

    def initial(self) -> torch.Tensor:
        """``s_0`` (with a graph when a hyperparameter shaped the initial parameters)."""
        with torch.enable_grad():
            return self.layout.flatten(self.params0, self.state0)

    def _update(
        self, s: torch.Tensor, t: int, *, create_graph: bool, first: bool
    ) -> tuple[Any, Any, Any]:
        params, state = self.layout.unflatten(s, step=t, counts=self.counts_at(t))
        ps = leaves(params, self.structure, self.call, "params")
        xs = ps if create_graph else [p.detach().requires_grad_(True) for p in ps]
        versions = self.buffer_versions() if first and t == 0 else None
        with torch.enable_grad():
            loss = check_scalar(
                self.inner_loss(rebuild(self.structure, xs), self.batch(t)), self.call, "inner_loss"
            )
            gs = grads_of(loss, xs, self.call, create_graph=create_graph)
        if versions is not None:
            self.check_buffers(versions)
        if first:
            self._store_loss(t, loss.detach())
        else:
            self._compare_loss(t, loss.detach())
        return rebuild(self.structure, gs), state, params

    def buffer_versions(self) -> list[int]:
        """The version counters of the buffers of the module given as ``params0``."""
        return [b._version for _, b in self._buffers]

    def check_buffers(self, versions: list[int]) -> None:
        """Refuse an inner loss that updated a buffer of the module given as ``params0`` in
        place (BatchNorm's running statistics in training mode): the steps are replayed, which
        updates it again (a second call gave another hypergradient), and the hypergradient
        leaves out how the buffer depends on the hyperparameters (0.5 % off)."""
        for (name, buf), before in zip(self._buffers, versions, strict=True):
            if buf._version != before:
                raise ValueError(
                    message(
                        self.call,
                        "inner_loss",
                        "a loss that leaves the module's buffers as they are (the steps are "
                        "replayed, and buffers are not differentiated)",
                        f"a loss that updated the buffer {name!r} in place (e.g. BatchNorm's "
                        "running statistics in training mode)",
                        "put such layers in eval mode for the inner loss (model.eval(), or "
                        "track_running_stats=False), or pass copies of the buffers to "
                        "functional_call with the parameters",
                    )
                )

    def _store_loss(self, t: int, value: torch.Tensor) -> None:
        """Keep the inner loss of step ``t``'s first run (checkpoint recomputes are not first
        runs; steps run forward in order the first time)."""
        if t != self._stored:
            return
        if self._losses is None or t >= self._losses.numel():
            grown = value.new_empty(max(16, 2 * t), dtype=torch.float64)
            if self._losses is not None:
                grown[: self._losses.numel()] = self._losses
            self._losses = grown
        self._losses[t] = value.to(torch.float64)
        self._stored = t + 1

    def _compare_loss(self, t: int, value: torch.Tensor) -> None:
        """Track the largest relative change of a replayed step's loss (no synchronization)."""
        if self._losses is None or t >= self._stored:
            return
        first = self._losses[t]
        gap = torch.nan_to_num(
            (value.to(torch.float64) - first).abs() / first.abs().clamp_min(1e-30)
        )
        step = torch.full_like(gap, t)
        if self._worst is None:
            self._worst = (gap, step)
        else:
            worse = gap > self._worst[0]
            self._worst = (
                torch.where(worse, gap, self._worst[0]),
                torch.where(worse, step, self._worst[1]),
            )

    def check_replay(self) -> None:
        """Raise when a replayed step saw another inner loss than its first run: the batches
        callable (or randomness in ``inner_loss``) does not give step ``t`` the same batch
        every time, and the hypergradient would silently mix two trajectories. (NaN losses on
        both runs count as equal: they are reported as non-finite results.)"""
        if self._worst is None:
            return
        gap, step = float(self._worst[0]), int(self._worst[1])
        self._worst = None
        if gap <= REPLAY_RTOL:
            return
        raise ValueError(
            message(
                self.call,
                "batches",
                "the same batch whenever step t is asked for (steps are replayed backwards)",
                f"an inner loss that changed by a relative {gap:.3g} when step {step} was replayed",
                "derive sampling, shuffling and dropout from t (e.g. torch.Generator()"
                ".manual_seed(seed + t)) instead of drawing fresh randomness per call",
            )
        )

    def step(self, s: torch.Tensor, t: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``s_{t+1}`` from ``s_t`` without a graph (into ``out`` if given)."""
        grads, state, params = self._update(s, t, create_graph=False, first=True)
        with torch.no_grad():
            new_params, new_state = self.opt.update(grads, state, params)
            self.record(t, new_state, grads)
            return self.layout.flatten(new_params, new_state, out=out)

    def graph_step(self, s: torch.Tensor, t: int) -> torch.Tensor:
        """``s_{t+1}`` from ``s_t`` with the step's graph (a first run: kept, not replayed)."""
        with torch.enable_grad():
            grads, state, params = self._update(s, t, create_graph=True, first=True)
            new_params, new_state = self.opt.update(grads, state, params)
            self.record(t, new_state, grads)
            return self.layout.flatten(new_params, new_state)

    def vjp(
        self, row: torch.Tensor, t: int, adjoint: torch.Tensor, hypers: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """Replay step ``t`` from the stored ``s_t`` and pull ``adjoint`` (of ``s_{t+1}``) back:
        ``(adjoint of s_t, adjoint of each hyperparameter or None)``, one backward pass."""
        s = row.detach().requires_grad_(True)
        with torch.enable_grad():
            grads, state, params = self._update(s, t, create_graph=True, first=False)
            new_params, new_state = self.opt.update(grads, state, params)
            s_next = self.layout.flatten(new_params, new_state)
            # retain_graph: a hyperparameter may reach the step through the user's own graph
            # (an lr = log_lr.exp() built once), which every step's pass goes through
            res = torch.autograd.grad(
                s_next, [s, *hypers], adjoint, retain_graph=True, allow_unused=True
            )
        a = res[0] if res[0] is not None else torch.zeros_like(s)
        return a.detach(), res[1:]

    def outer(
        self, s_final: torch.Tensor, hypers: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...], Any]:
        """``(E, dE/ds_T, direct dE/d hyper or None, params_T)`` at the last state."""
        s = s_final.detach().requires_grad_(True)
        with torch.enable_grad():
            params = self.layout.params_of(s)
            value = check_scalar(self.outer_loss(params), self.call, "outer_loss")
            res: tuple[torch.Tensor | None, ...]
            if value.requires_grad:
                res = torch.autograd.grad(value, [s, *hypers], retain_graph=True, allow_unused=True)
            else:
                res = (None,) * (1 + len(hypers))
        self.check_outer(res[0] is not None)
        a = res[0] if res[0] is not None else torch.zeros_like(s)
        final = self.layout.params_of(s_final.detach().clone())
        return value.detach(), a.detach(), res[1:], final


def check_outer(call: str, depends: bool) -> None:
    """Refuse an outer loss that does not depend on the parameters it is given (a constant,
    or parameters detached or copied inside ``outer_loss``): every hypergradient through
    training is then 0, and the engines read it differently (reverse gave 0, forward blamed an
    unused hyperparameter)."""
    if not depends:
        raise ValueError(
            message(
                call,
                "outer_loss",
                "a loss computed from the parameters it is given (the trained ones)",
                "a value that does not depend on them (a constant, or parameters detached, "
                "copied or read from the module itself inside outer_loss)",
                "compute outer_loss from its params argument (e.g. "
                "torch.func.functional_call(model, params, x)), without detach()",
            )
        )


def sum_paths(
    total: list[torch.Tensor | None], parts: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Entry-wise sums where ``None`` means "no path" (kept apart from a zero)."""
    out = []
    for acc, part in zip(total, parts, strict=True):
        if part is None:
            out.append(acc)
        else:
            out.append(part.detach() if acc is None else acc + part.detach())
    return out

"""Real-time forward mode (RTHO, Franceschi et al. 2017): tangents carried along one training
run, so a hypergradient is available after every step without restarting.

For each hyperparameter element :math:`\\lambda_j` the tangent
:math:`Z^j_t = ds_t / d\\lambda_j` of the flat state follows the training:

.. math:: Z^j_{t+1} = \\frac{\\partial \\Phi_t}{\\partial s_t} Z^j_t
          + \\frac{\\partial \\Phi_t}{\\partial \\lambda_j}, \\qquad
          \\frac{dE(s_t)}{d\\lambda_j} = \\frac{\\partial E}{\\partial s_t} Z^j_t
          + \\frac{\\partial E}{\\partial \\lambda_j}

(forward-mode AD over the inner gradient, as :func:`gradkit.hyper.forward`). At the first
hypergradient after ``k`` steps this is exactly the forward-mode hypergradient of the ``k``-step
problem; after the hyperparameters change the tangents are carried on unchanged (the RTHO
approximation: they describe the dependence on the hyperparameters as if these had always held
their current values). Memory: one tangent per element, independent of the number of steps;
time: one dual step per element and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from gradkit._errors import describe, message
from gradkit._tree import entries, leaves, rebuild
from gradkit.hyper._forward import Pair, _pack, _seeded, _unpack
from gradkit.hyper._problem import Dynamics, check_scalar, grads_of, unused_error

__all__ = ["OnlineTangents"]

Direction = tuple[int, int]
"""``(index of the hyperparameter tensor, index of the element in its flat view)``."""


class OnlineTangents:
    """The training state ``s_t`` and one tangent per hyperparameter element, advanced one step
    at a time; :meth:`hypergradient` reads ``dE(s_t)/d lambda`` at the current step.

    Args:
        dyn: the inner problem (optimizer, losses, batches, initial parameters).
        names, hypers: the hyperparameters, as checked by ``check_hyper``.
    """

    def __init__(self, dyn: Dynamics, names: Sequence[str], hypers: Sequence[torch.Tensor]) -> None:
        self.dyn = dyn
        self.names = list(names)
        self.hypers = list(hypers)
        self.directions: list[Direction] = [
            (j, i) for j, h in enumerate(self.hypers) for i in range(h.numel())
        ]
        self.t = 0
        self.counts: Any = None  # per-parameter counts of the optimizer state (plain ints)
        self.ps: list[torch.Tensor] = []
        self.slots: dict[str, list[torch.Tensor]] = {}
        # per direction: tangents of the parameters and of each slot (None: no dependence)
        self.tangents: list[tuple[list[torch.Tensor | None], dict[str, list[torch.Tensor | None]]]]
        self.tangents = []
        self._initial()

    # -- the state ---------------------------------------------------------------------------

    def _leaves(self, value: Any, argument: str) -> list[torch.Tensor]:
        return leaves(value, self.dyn.structure, self.dyn.call, argument)

    def _split(self, params: Any, state: Any) -> tuple[list[Pair], dict[str, list[Pair]]]:
        ps = [_unpack(p) for p in self._leaves(params, "params")]
        slots = {
            f: [_unpack(v) for v in self._leaves(getattr(state, f), f)] for f in self.dyn.opt.slots
        }
        return ps, slots

    def _store(
        self,
        d: int | None,
        ps: list[Pair],
        slots: dict[str, list[Pair]],
        *,
        primal: bool,
        counts: Any = None,
    ) -> None:
        if primal:
            self.ps = [p for p, _ in ps]
            if counts is not None:
                self.counts = counts
            self.slots = {f: [v for v, _ in vs] for f, vs in slots.items()}
        if d is not None:
            self.tangents[d] = (
                [z for _, z in ps],
                {f: [z for _, z in vs] for f, vs in slots.items()},
            )

    def _initial(self) -> None:
        """``s_0`` and its tangents (nonzero only where ``params0`` holds a hyperparameter)."""
        dyn = self.dyn
        self.tangents = [([], {}) for _ in self.directions]
        self.counts = dyn.state0.counts
        if not self.directions:
            self._store(None, *self._split(dyn.params0, dyn.state0), primal=True)
            return
        for d, (j, i) in enumerate(self.directions):
            with fwAD.dual_level(), _seeded(self.hypers[j], i):
                state = dyn.opt.init(dyn.params0)
                self._store(d, *self._split(dyn.params0, state), primal=d == 0)

    def _dual(self, d: int, *, requires_grad: bool) -> tuple[list[torch.Tensor], Any]:
        """Parameters (as dual leaves) and slots of direction ``d`` (inside a dual level)."""
        zp, zs = self.tangents[d]
        xs = [_pack((p, z), requires_grad=requires_grad) for p, z in zip(self.ps, zp, strict=True)]
        slots = {
            f: rebuild(
                self.dyn.structure,
                [_pack((v, z)) for v, z in zip(self.slots[f], zs[f], strict=True)],
            )
            for f in self.dyn.opt.slots
        }
        return xs, self.dyn.state0._replace(step=self.t, counts=self.counts, **slots)

    # -- one step and the hypergradient ------------------------------------------------------

    def step(self) -> None:
        """Advance the training by one step, the primal state and every tangent."""
        dyn = self.dyn
        if not self.directions:
            xs = [p.detach().requires_grad_(True) for p in self.ps]
            with torch.enable_grad():
                loss = dyn.inner_loss(rebuild(dyn.structure, xs), dyn.batch(self.t))
                gs = grads_of(loss, xs, dyn.call, create_graph=False)
            with torch.no_grad():
                new_params, new_state = dyn.opt.update(
                    rebuild(dyn.structure, gs), self._plain_state(), rebuild(dyn.structure, self.ps)
                )
            self._store(
                None, *self._split(new_params, new_state), primal=True, counts=new_state.counts
            )
            self.t += 1
            return
        batch = dyn.batch(self.t)
        results = []  # every direction steps from the same s_t: store after all are done
        for d, (j, i) in enumerate(self.directions):
            with fwAD.dual_level(), _seeded(self.hypers[j], i):
                xs, state = self._dual(d, requires_grad=True)
                params = rebuild(dyn.structure, xs)
                with torch.enable_grad():
                    loss = dyn.inner_loss(params, batch)
                    gs = grads_of(loss, xs, dyn.call, create_graph=True)
                    new_params, new_state = dyn.opt.update(
                        rebuild(dyn.structure, gs), state, params
                    )
                results.append((*self._split(new_params, new_state), new_state.counts))
        for d, (ps, slots, counts) in enumerate(results):
            self._store(d, ps, slots, primal=d == 0, counts=counts)
        self.t += 1

    def _plain_state(self) -> Any:
        slots = {f: rebuild(self.dyn.structure, vs) for f, vs in self.slots.items()}
        return self.dyn.state0._replace(step=self.t, counts=self.counts, **slots)

    def params(self) -> Any:
        """The current parameters ``theta_t`` (detached), in the container of ``params0``."""
        return rebuild(self.dyn.structure, [p.clone() for p in self.ps])

    def hypergradient(self, *, check_unused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(E(theta_t), [dE/d hyper for each hyperparameter])`` at the current step.

        With ``check_unused``, a hyperparameter that no tangent reaches raises.
        """
        dyn = self.dyn
        grads = [
            torch.zeros_like(h, memory_format=torch.contiguous_format).detach() for h in self.hypers
        ]
        reached = [False] * len(self.hypers)
        value: torch.Tensor | None = None
        for d, (j, i) in enumerate(self.directions):
            with fwAD.dual_level(), _seeded(self.hypers[j], i):
                xs, _ = self._dual(d, requires_grad=False)
                out = check_scalar(
                    dyn.outer_loss(rebuild(dyn.structure, xs)), dyn.call, "outer_loss"
                )
                primal, tangent = _unpack(out)
            if value is None:
                value = primal
            if tangent is not None:
                reached[j] = True
                grads[j].view(-1)[i] = tangent.to(grads[j].dtype)
        if value is None:
            with torch.no_grad():
                value = check_scalar(
                    dyn.outer_loss(rebuild(dyn.structure, self.ps)), dyn.call, "outer_loss"
                ).detach()
        if check_unused:
            for name, h, ok in zip(self.names, self.hypers, reached, strict=True):
                if not ok and h.numel() > 0:
                    raise unused_error(dyn.call, name)
        return value, grads

    # -- saving and restoring ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step count, state and tangents as plain containers of tensors (``None``: no
        dependence); loadable with ``torch.load(weights_only=True)``."""
        counts = None
        if self.counts is not None:
            counts = list(entries(self.counts, self.dyn.structure, self.dyn.call, "counts"))
        return {
            "t": self.t,
            "counts": counts,
            "params": [p.clone() for p in self.ps],
            "slots": {f: [v.clone() for v in vs] for f, vs in self.slots.items()},
            "tangents": [
                {
                    "params": [None if z is None else z.clone() for z in zp],
                    "slots": {
                        f: [None if z is None else z.clone() for z in zs] for f, zs in s.items()
                    },
                }
                for zp, s in self.tangents
            ],
        }

    def load_state_dict(self, state: Any, call: str) -> None:
        """Restore what :meth:`state_dict` saved (same problem and hyperparameters)."""
        fix = "load a state saved by a HyperOptimizer with the same problem and method='rtho'"
        try:
            t = state["t"]
            counts = state.get("counts")
            ps = list(state["params"])
            slots = {f: list(state["slots"][f]) for f in self.dyn.opt.slots}
            tangents = [
                (list(z["params"]), {f: list(z["slots"][f]) for f in self.dyn.opt.slots})
                for z in state["tangents"]
            ]
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                message(call, "state_dict['online']", "an RTHO state", f"missing {err}", fix)
            ) from None
        shapes = [p.shape for p in self.ps]
        if (
            [p.shape for p in ps] != shapes
            or any([v.shape for v in vs] != shapes for vs in slots.values())
            or len(tangents) != len(self.directions)
            or not isinstance(t, int)
            or not (
                counts is None
                or (
                    isinstance(counts, list)
                    and len(counts) == len(shapes)
                    and all(isinstance(c, int) and 0 <= c <= t for c in counts)
                )
            )
        ):
            raise ValueError(
                message(
                    call,
                    "state_dict['online']",
                    f"parameters of shapes {[tuple(s) for s in shapes]} and "
                    f"{len(self.directions)} tangents",
                    describe(ps),
                    fix,
                )
            )
        self.t = t
        self.counts = None if counts is None else rebuild(self.dyn.structure, list(counts))
        self.ps = [p.detach().clone() for p in ps]
        self.slots = {f: [v.detach().clone() for v in vs] for f, vs in slots.items()}
        self.tangents = [
            (
                [None if z is None else z.detach().clone() for z in zp],
                {f: [None if z is None else z.detach().clone() for z in zs] for f, zs in s.items()},
            )
            for zp, s in tangents
        ]

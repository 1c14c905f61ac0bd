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

from gradkit._errors import describe, message
from gradkit._tree import entries, rebuild
from gradkit.hyper._problem import Dynamics
from gradkit.hyper._tangents import Direction, Trajectory, advance, read, start

__all__ = ["OnlineTangents"]


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
        self.traj: Trajectory = start(dyn, self.hypers, self.directions)

    # -- one step and the hypergradient ------------------------------------------------------

    def step(self) -> None:
        """Advance the training by one step, the primal state and every tangent."""
        self.traj = advance(self.dyn, self.t, self.hypers, self.directions, self.traj)
        self.t += 1

    def params(self) -> Any:
        """The current parameters ``theta_t`` (detached), in the container of ``params0``."""
        return rebuild(self.dyn.structure, [p.clone() for p in self.traj.ps])

    def hypergradient(self, *, check_unused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(E(theta_t), [dE/d hyper for each hyperparameter])`` at the current step.

        With ``check_unused``, a hyperparameter that no tangent reaches raises.
        """
        value, tangents = read(self.dyn, self.hypers, self.directions, self.traj)
        grads = [
            torch.zeros_like(h, memory_format=torch.contiguous_format).detach() for h in self.hypers
        ]
        reached = [False] * len(self.hypers)
        for (j, i), tangent in zip(self.directions, tangents, strict=True):
            if tangent is not None:
                reached[j] = True
                grads[j].view(-1)[i] = tangent.to(grads[j].dtype)
        if check_unused:
            self.dyn.check_reached(self.names, self.hypers, reached)
        return value, grads

    # -- saving and restoring ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step count, state and tangents as plain containers of tensors (``None``: no
        dependence); loadable with ``torch.load(weights_only=True)``."""
        traj = self.traj
        counts = None
        if traj.counts is not None:
            counts = list(entries(traj.counts, self.dyn.structure, self.dyn.call, "counts"))
        return {
            "t": self.t,
            "counts": counts,
            "params": [p.clone() for p in traj.ps],
            "slots": {f: [v.clone() for v in vs] for f, vs in traj.slots.items()},
            "tangents": [
                {
                    "params": [None if z is None else z.clone() for z in zp],
                    "slots": {
                        f: [None if z is None else z.clone() for z in zs] for f, zs in s.items()
                    },
                }
                for zp, s in traj.tangents
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
        shapes = [p.shape for p in self.traj.ps]
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
        self.traj = Trajectory(
            [p.detach().clone() for p in ps],
            {f: [v.detach().clone() for v in vs] for f, vs in slots.items()},
            None if counts is None else rebuild(self.dyn.structure, list(counts)),
            [
                (
                    [None if z is None else z.detach().clone() for z in zp],
                    {
                        f: [None if z is None else z.detach().clone() for z in zs]
                        for f, zs in s.items()
                    },
                )
                for zp, s in tangents
            ],
        )

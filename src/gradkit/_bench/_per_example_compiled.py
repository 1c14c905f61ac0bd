"""The ``compiled`` case of the per_example suite: a tracked step of a ``torch.compile``\\ d model.

The demo CNN on the bundled digits, compiled with inductor (``aot_eager`` in smoke runs, which
compiles in seconds): a plain compiled forward + backward against the same step inside
``track(model, "variance", "batch_l2")``, and both eager steps beside them. ``track``'s forward
hooks run eagerly, as graph breaks between the tracked modules, so the ratio says what
tracking costs a compiled model (the graph breaks included). Every call runs with
``torch._dynamo.config.skip_nnmodule_hook_guards=False``, as users who track some steps of a
compiled model must (docs/per_example.md): tracked and plain calls then compile once each.
"""

from __future__ import annotations

from typing import Any

import torch

import gradkit
from gradkit._bench._case import Case, Method, Target, flat
from gradkit._bench._per_example_problems import SMOKE_BATCH, make_problem
from gradkit._bench._per_example_runner import Runner, reference, relative

__all__ = ["compiled_case"]

_QUANTITIES = ("variance", "batch_l2")


def compiled_case(mode: str, seed: int) -> Case:
    """The case; ``mode`` as in :func:`gradkit._bench.per_example.build_cases`."""
    smoke = mode == "smoke"
    p = make_problem("cnn", seed, SMOKE_BATCH["cnn"] if smoke else None)
    backend = "aot_eager" if smoke else "inductor"
    torch._dynamo.reset()
    compiled = torch.compile(p.model, backend=backend)
    names = [n for n, _ in p.model.named_parameters()]

    def plain(module: Any) -> Any:
        def step() -> None:
            p.model.zero_grad(set_to_none=True)
            with hook_guards():
                p.loss(module).backward()

        return step

    def tracked(module: Any) -> Any:
        def step() -> list[torch.Tensor]:
            p.model.zero_grad(set_to_none=True)
            with hook_guards(), gradkit.per_example.track(p.model, *_QUANTITIES) as stats:
                p.loss(module).backward()
            return [stats[n].variance for n in names] + [stats.batch_l2()]

        return step

    def hook_guards() -> Any:
        # tracked and plain calls alternate: each compiles once and is guarded on the hooks
        return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)

    grads = Runner(p, peers=False).func_grads()
    second = reference("second_moment", grads)
    scales = [float(t.abs().max()) or 1.0 for t in second]
    l2 = reference("batch_l2", grads)
    expected = flat([relative(reference("variance", grads), scales), l2 / l2.abs().max()])

    def value(result: list[torch.Tensor]) -> torch.Tensor:
        return flat([relative(result[:-1], scales), result[-1] / l2.abs().max()])

    methods = [
        Method(
            "plain_compiled",
            f"compiled plain forward + backward ({backend})",
            plain(compiled),
            None,
        ),
        Method(
            "gradkit_compiled",
            'gradkit.per_example.track(model, "variance", "batch_l2") around the compiled model',
            tracked(compiled),
            value,
        ),
        Method("plain", "eager plain forward + backward", plain(p.model), None),
        Method("gradkit", "gradkit tracked, eager", tracked(p.model), value),
    ]
    return Case(
        key="compiled_variance_batch_l2",
        title=f"torch.compile: variance + per-example norms, {p.name}, batch {p.n}",
        setup={**p.setup(), "quantity": "variance + batch_l2", "backend": backend},
        methods=methods,
        baseline=("plain_compiled",),
        reference=None,
        reference_value=(
            "torch.func vmap(grad) per-example gradients (float32), reduced in float64",
            expected,
        ),
        dtype=torch.float32,
        targets=[
            Target("compiled tracked / compiled plain", "gradkit_compiled", ("plain_compiled",)),
            Target("eager tracked / eager plain", "gradkit", ("plain",)),
            Target("compiled plain / eager plain", "plain_compiled", ("plain",)),
        ],
        notes=[
            "`track` hooks the original module; its forward hooks run eagerly, as graph breaks "
            "between the tracked modules (the statistics and p.grad are the eager model's, "
            "tested with aot_eager and inductor). Differences are relative: the variance to the "
            "largest second moment of each parameter, the norms to the largest norm.",
        ],
    )

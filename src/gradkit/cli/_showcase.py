"""The demo's "Differentiation showcase": :mod:`gradkit.func` on the trained model.

Three parts, each a function returning ``(markdown, plots, metrics)``:

* :func:`input_jacobian`: the Jacobian of the logits ``[10]`` w.r.t. one test image ``[8, 8]``
  by ``jacobian(mode="auto")``, checked against the other mode, and a saliency map from it;
* :func:`hessian_spectrum`: the Hessian of the loss as a matrix-free operator
  (``module_hvp_operator``), its largest-magnitude eigenvalue by power iteration, and the
  gradient norm;
* :func:`hvp_cost`: one Hessian-vector product against one gradient, timed in this run.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradkit.cli._report import Plot, figure_token
from gradkit.func import jacobian, module_hvp, module_hvp_operator, module_value_and_grad

__all__ = ["auto_mode", "hessian_spectrum", "hvp_cost", "input_jacobian", "median_seconds"]

Part = tuple[str, list[Plot], dict[str, Any]]


def auto_mode(num_outputs: int, num_inputs: int) -> str:
    """The mode ``jacobian(mode="auto")`` uses: reverse when outputs <= inputs.

    Examples:
        >>> auto_mode(10, 64), auto_mode(64, 10)
        ('reverse', 'forward')
    """
    return "reverse" if num_outputs <= num_inputs else "forward"


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _saliency_figure(image: torch.Tensor, jac: torch.Tensor, top: int, second: int) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.2))
    axes = fig.subplots(1, 3)
    diff = (jac[top] - jac[second]).numpy()
    bound = float(abs(diff).max()) or 1.0
    panels = [
        (image.numpy(), "gray_r", None, None, "test image"),
        (jac[top].abs().numpy(), "magma", None, None, f"|d logit[{top}] / d x|"),
        (diff, "RdBu_r", -bound, bound, f"d (logit[{top}] - logit[{second}]) / d x"),
    ]
    for ax, (data, cmap, lo, hi, title) in zip(axes, panels, strict=True):
        shown = ax.imshow(data, cmap=cmap, vmin=lo, vmax=hi)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def input_jacobian(
    model: nn.Module, image: torch.Tensor, label: int, *, index: int, repeats: int
) -> Part:
    """The Jacobian of the logits w.r.t. one image ``[1, 8, 8]``, by both modes, timed."""
    pixels = image.reshape(8, 8).clone()

    def logits(img: torch.Tensor) -> torch.Tensor:
        return model(img.reshape(1, 1, 8, 8))[0]

    with torch.no_grad():
        probs = logits(pixels).softmax(0)
    top, second = (int(i) for i in probs.topk(2).indices)
    # The Jacobian stays connected to the parameters' graph (it is differentiable w.r.t.
    # them); only its values are needed here.
    jac = jacobian(logits, pixels, mode="auto").detach()  # [10, 8, 8]
    picked = auto_mode(probs.numel(), pixels.numel())
    other = "forward" if picked == "reverse" else "reverse"
    jac_other = jacobian(logits, pixels, mode=other).detach()
    max_diff = float((jac - jac_other).abs().max())
    seconds = {
        mode: median_seconds(functools.partial(jacobian, logits, pixels, mode=mode), repeats)
        for mode in ("reverse", "forward")
    }
    m, n = probs.numel(), pixels.numel()
    markdown = f"""### Input Jacobian of the logits

For test digit #{index} (label {label}, predicted {top} with probability {probs[top]:.3f}),
`gradkit.func.jacobian(f, image, mode="auto")` with `f: image [8, 8] -> logits [{m}]` gives
`J` of shape `{list(jac.shape)}`. `mode="auto"` picked **{picked}**: {m} outputs and {n} inputs,
so {min(m, n)} {"vector-Jacobian" if picked == "reverse" else "Jacobian-vector"} products
instead of {max(m, n)}. The {other} mode gives the same matrix (max |difference|
{max_diff:.1e}).

| mode | products | time (ms, median of {repeats}) |
|---|---|---|
| reverse | {m} VJPs | {seconds["reverse"] * 1e3:.2f} |
| forward | {n} JVPs | {seconds["forward"] * 1e3:.2f} |

The saliency map is `|J[{top}]|`, the sensitivity of the winning logit to each pixel; the
signed map `J[{top}] - J[{second}]` shows which pixels push the decision from {second} to {top}.

{figure_token("saliency")}
"""
    plot = Plot(
        "saliency",
        _saliency_figure(pixels, jac, top, second),
        f"Test digit #{index} and saliency maps from the input Jacobian",
    )
    metrics = {
        "test_index": index,
        "label": label,
        "predicted": top,
        "runner_up": second,
        "probability": float(probs[top]),
        "shape": list(jac.shape),
        "auto_mode": picked,
        "max_abs_difference_between_modes": max_diff,
        "seconds_reverse": seconds["reverse"],
        "seconds_forward": seconds["forward"],
    }
    return markdown, [plot], metrics


def _power_figure(history: list[float]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.2))
    ax = fig.subplots()
    ax.plot(range(1, len(history) + 1), history, marker="o", markersize=3)
    ax.set_xlabel("power-iteration step (one HVP each)")
    ax.set_ylabel("Rayleigh quotient  v·Hv")
    ax.set_title("Top Hessian eigenvalue estimate", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def hessian_spectrum(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    steps: int,
    generator: torch.Generator,
) -> Part:
    """Power iteration on ``module_hvp_operator`` for the largest-magnitude eigenvalue."""
    op = module_hvp_operator(model, F.cross_entropy, batch)
    n = op.shape[0]
    v = torch.randn(n, generator=generator, dtype=op.dtype)
    v /= v.norm()
    history = []
    for _ in range(steps):
        w = op @ v
        history.append(float(v @ w))
        v = w / w.norm()
    hv = op @ v
    eigenvalue = float(v @ hv)
    residual = float((hv - eigenvalue * v).norm()) / max(abs(eigenvalue), 1e-30)
    grad_norm = float(op.gradient.norm())
    loss = float(op.value)
    del op  # frees the first-gradient graph
    gib = n * n * 4 / 2**30
    markdown = f"""### Hessian of the loss

`gradkit.func.module_hvp_operator(model, F.cross_entropy, (x, y))` on {len(batch[1])} training
examples: the Hessian of the mean loss w.r.t. all {n:,} parameters as a matrix-free operator
(the dense matrix would take {gib:.2f} GiB in float32). The first gradient is computed once
and each `op @ v` is one backward through its graph.

| quantity | value |
|---|---|
| loss | {loss:.4f} |
| gradient norm ‖g‖ | {grad_norm:.4g} |
| largest-magnitude eigenvalue λ ({steps} power-iteration steps) | {eigenvalue:.4g} |
| relative residual ‖Hv − λv‖ / abs(λ) | {residual:.2e} |

{figure_token("hessian_power_iteration")}
"""
    plot = Plot(
        "hessian_power_iteration",
        _power_figure(history),
        "Power iteration on the Hessian operator: one HVP per step",
    )
    metrics = {
        "batch_size": len(batch[1]),
        "num_parameters": n,
        "loss": loss,
        "gradient_norm": grad_norm,
        "top_eigenvalue": eigenvalue,
        "power_steps": steps,
        "relative_residual": residual,
        "eigenvalue_history": history,
    }
    return markdown, [plot], metrics


def hvp_cost(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    repeats: int,
    generator: torch.Generator,
) -> Part:
    """Median times of a gradient, a one-off HVP, and an HVP on a kept operator."""
    loss_fn = F.cross_entropy
    op = module_hvp_operator(model, loss_fn, batch)
    v = torch.randn(op.shape[0], generator=generator, dtype=op.dtype)
    v_named = dict(
        zip(
            [n for n, p in model.named_parameters() if p.requires_grad],
            op.unflatten(v),
            strict=True,
        )
    )
    seconds = {
        "gradient": median_seconds(lambda: module_value_and_grad(model, loss_fn, batch), repeats),
        "hvp": median_seconds(lambda: module_hvp(model, loss_fn, batch, v_named), repeats),
        "hvp_operator": median_seconds(lambda: op @ v, repeats),
    }
    ratio = {k: s / seconds["gradient"] for k, s in seconds.items()}
    rows = [
        ("gradient, `module_value_and_grad`", "gradient"),
        ("HVP, one-off, `module_hvp` (forward + double backward)", "hvp"),
        ("HVP on a kept operator, `op @ v` (one extra backward)", "hvp_operator"),
    ]
    table = "\n".join(f"| {label} | {seconds[k] * 1e3:.2f} | {ratio[k]:.2f} |" for label, k in rows)
    markdown = f"""### Cost of a Hessian-vector product

Measured in this run on the same {len(batch[1])} examples, median of {repeats} calls each
after a warm-up, {torch.get_num_threads()} torch thread(s):

| computation | time (ms) | × gradient |
|---|---|---|
{table}
"""
    metrics = {
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "ratio_to_gradient": ratio,
        "hvp_over_gradient": ratio["hvp"],
    }
    return markdown, [], metrics

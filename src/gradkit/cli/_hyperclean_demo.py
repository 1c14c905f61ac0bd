"""The demo's "Hyperparameters by gradient" section: a mini data hyper-cleaning (the result
table of ``gradkit hyperclean`` on a short budget) and a real-time forward-mode run (RTHO) that
tunes the learning rate and the momentum of SGD online while it trains the demo CNN, against
training with the same values held fixed.

RTHO setup: the demo's training examples minus a held-out validation part (the outer loss is
its cross-entropy), replayable minibatches of 32, :func:`gradkit.optim.sgd` with tensor
``lr`` and ``momentum``, a hyper-step every 10 inner steps (Adam on each hyperparameter, then a
box projection), all under the demo's seed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from gradkit import hyper, optim
from gradkit._digits import Digits, make_model
from gradkit.cli._hyperclean import cross_entropy, hyperclean
from gradkit.cli._hyperclean_data import load_source, make_split
from gradkit.cli._hyperclean_report import markdown_table, result_table
from gradkit.cli._report import Plot, Report, figure_token
from gradkit.cli._sections import DemoContext

__all__ = ["hyperparameter_section", "rtho_run"]

BATCH = 32
EVERY = 10  # inner steps per RTHO hyper-step
LR0, MOMENTUM0 = 0.02, 0.5  # deliberately low starting values
LR_BOX, MOMENTUM_BOX = (1e-3, 0.2), (0.0, 0.9)
OUTER_LR = {"lr": 0.003, "momentum": 0.03}


def _split(data: Digits, seed: int) -> tuple[torch.Tensor, ...]:
    """``(x_fit, y_fit, x_val, y_val)``: a fifth of the training examples (at most 256) held out."""
    n = len(data.y_train)
    n_val = min(256, max(1, n // 5))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17))
    fit, val = order[n_val:], order[:n_val]
    return data.x_train[fit], data.y_train[fit], data.x_train[val], data.y_train[val]


def rtho_run(data: Digits, *, steps: int, seed: int) -> dict[str, Any]:
    """RTHO on the demo CNN for ``steps`` inner steps, and the same training with the starting
    values and with RTHO's final values held fixed. Returns curves and final numbers."""
    x_fit, y_fit, x_val, y_val = _split(data, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = make_model()
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}

    def batches(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 100_003 + t)
        idx = torch.randint(0, len(y_fit), (BATCH,), generator=gen)
        return x_fit[idx], y_fit[idx]

    def loss_on(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(functional_call(model, params, (x,)), y).mean()

    def inner_loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        return loss_on(params, *batch)

    def outer_loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_on(params, x_val, y_val)

    lr, momentum = torch.tensor(LR0), torch.tensor(MOMENTUM0)
    outer_opt = torch.optim.Adam(
        [{"params": [lr], "lr": OUTER_LR["lr"]}, {"params": [momentum], "lr": OUTER_LR["momentum"]}]
    )
    hopt = hyper.HyperOptimizer(
        inner_loss,
        outer_loss,
        params0,
        optim.sgd(lr=lr, momentum=momentum),
        {"lr": lr, "momentum": momentum},
        method="rtho",
        steps=EVERY,
        batches=batches,
        outer_opt=outer_opt,
        projections={
            "lr": hyper.projection("box", low=LR_BOX[0], high=LR_BOX[1]),
            "momentum": hyper.projection("box", low=MOMENTUM_BOX[0], high=MOMENTUM_BOX[1]),
        },
    )
    start = time.perf_counter()
    hopt.run(max(1, steps // EVERY))
    rtho_seconds = time.perf_counter() - start
    history = hopt.history
    curve_steps = [r.inner_steps for r in history]
    final = {"lr": float(lr), "momentum": float(momentum)}

    def fixed(lr_value: float, mu_value: float) -> tuple[list[float], dict[str, torch.Tensor]]:
        opt = optim.sgd(lr=lr_value, momentum=mu_value)
        params = {k: v.clone() for k, v in params0.items()}
        state = opt.init(params)
        curve = []
        for t in range(curve_steps[-1]):
            leaves = {k: v.requires_grad_(True) for k, v in params.items()}
            grads = torch.autograd.grad(inner_loss(leaves, batches(t)), list(leaves.values()))
            with torch.no_grad():
                params, state = opt.update(dict(zip(leaves, grads, strict=True)), state, leaves)
                if t + 1 in curve_steps:
                    curve.append(float(outer_loss(params)))
        return curve, params

    start = time.perf_counter()
    fixed_start, p_start = fixed(LR0, MOMENTUM0)
    fixed_final, p_final = fixed(final["lr"], final["momentum"])
    fixed_seconds = time.perf_counter() - start

    @torch.no_grad()
    def test_accuracy(params: dict[str, torch.Tensor]) -> float:
        out = functional_call(model, params, (data.x_test,))
        return float((out.argmax(1) == data.y_test).float().mean())

    return {
        "inner_steps": curve_steps,
        "validation_loss": {
            "rtho": [r.outer_loss for r in history],
            "fixed_start": fixed_start,
            "fixed_final": fixed_final,
        },
        "lr": [float(r.hyper["lr"]) for r in history] + [final["lr"]],
        "momentum": [float(r.hyper["momentum"]) for r in history] + [final["momentum"]],
        "final": final,
        "test_accuracy": {
            "rtho": test_accuracy(hopt.params),
            "fixed_start": test_accuracy(p_start),
            "fixed_final": test_accuracy(p_final),
        },
        "seconds": {"rtho": rtho_seconds, "fixed_runs": fixed_seconds},
        "examples": {"fit": len(y_fit), "validation": len(y_val)},
    }


def _rtho_figure(run: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 3.2))
    ax_loss, ax_lr, ax_mu = fig.subplots(1, 3)
    steps = run["inner_steps"]
    loss = run["validation_loss"]
    final = run["final"]
    ax_loss.plot(steps, loss["rtho"], "o-", ms=2.5, label="RTHO (tuned online)")
    ax_loss.plot(steps, loss["fixed_start"], "s-", ms=2.5, label=f"fixed {LR0}, {MOMENTUM0}")
    ax_loss.plot(
        steps,
        loss["fixed_final"],
        "^-",
        ms=2.5,
        label=f"fixed {final['lr']:.3g}, {final['momentum']:.3g}",
    )
    ax_loss.set_xlabel("inner step")
    ax_loss.set_ylabel("validation cross-entropy")
    ax_loss.set_yscale("log")
    hyper_steps = [0, *steps]
    for ax, key, start, label in (
        (ax_lr, "lr", LR0, "learning rate"),
        (ax_mu, "momentum", MOMENTUM0, "momentum"),
    ):
        ax.step(hyper_steps, run[key], where="post", label="RTHO")
        ax.axhline(start, ls="--", lw=1, color="C1", label="fixed (start)")
        ax.axhline(final[key], ls=":", lw=1, color="C2", label="fixed (RTHO's final)")
        ax.set_xlabel("inner step")
        ax.set_ylabel(label)
    for ax in (ax_loss, ax_lr, ax_mu):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def hyperparameter_section(ctx: DemoContext, report: Report) -> None:
    """``gradkit.hyper``: mini hyper-cleaning, and RTHO tuning lr and momentum online."""
    cfg = ctx.config
    with torch.random.fork_rng(devices=[]):
        start = time.perf_counter()
        data = make_split(load_source(None), cfg.seed, quick=True)
        cleaning = hyperclean(
            data,
            inner_steps=cfg.hyper_inner_steps,
            hyper_steps=cfg.hyper_steps,
            hyper_lr=cfg.hyper_lr,
            on_step=lambda k, _: ctx.note(f"hyper-cleaning, hyper-step {k}/{cfg.hyper_steps}"),
        )
        cleaning_seconds = time.perf_counter() - start
        ctx.note(f"RTHO tuning lr and momentum over {cfg.rtho_steps} steps")
        run = rtho_run(ctx.data, steps=cfg.rtho_steps, seed=cfg.seed)
    n_train, n_val, n_test = data.sizes
    acc = run["test_accuracy"]
    final = run["final"]
    loss = run["validation_loss"]
    table = markdown_table(
        (f"after {run['inner_steps'][-1]} steps", "validation loss", "test accuracy"),
        [
            (
                f"RTHO (tuned online, {run['seconds']['rtho']:.1f} s)",
                f"{loss['rtho'][-1]:.4f}",
                f"{acc['rtho']:.3f}",
            ),
            (
                f"fixed {LR0}, {MOMENTUM0}",
                f"{loss['fixed_start'][-1]:.4f}",
                f"{acc['fixed_start']:.3f}",
            ),
            (
                f"fixed {final['lr']:.3g}, {final['momentum']:.3g}",
                f"{loss['fixed_final'][-1]:.4f}",
                f"{acc['fixed_final']:.3f}",
            ),
        ],
    )
    markdown = f"""`gradkit.hyper` differentiates through training with respect to
hyperparameters, and `HyperOptimizer` tunes them by gradient.

### Data hyper-cleaning, in brief

Half of {n_train} training labels of the digits are replaced by a wrong class; one weight per
training example is learned by reverse-mode hypergradients through {cfg.hyper_inner_steps}
gradient-descent steps of softmax regression, {cfg.hyper_steps} Adam steps on the weights
(projected onto 0 <= w <= 1, sum w <= {int(cleaning.radius)}), so that the trained model does well
on {n_val} clean validation examples; weights below 1e-3 flag their example as corrupted. Test
set: {n_test} examples; {cleaning_seconds:.1f} s. `gradkit hyperclean` runs the full
experiment.

{result_table(cleaning)}
### Real-time hyperparameter tuning (RTHO)

SGD with momentum trains the demo CNN on minibatches of {BATCH} ({run["examples"]["fit"]}
examples); the learning rate and the momentum start low ({LR0}, {MOMENTUM0}) and are tuned while
it trains: every {EVERY} steps the forward-mode tangents carried along give the gradient of
the validation loss ({run["examples"]["validation"]} held-out examples) with respect to both,
and Adam takes a step. Against the same training with fixed values: the starting ones, and
RTHO's final ones ({final["lr"]:.3g}, {final["momentum"]:.3g}).

{table}
{figure_token("rtho")}
"""
    report.add_section(
        "Hyperparameters by gradient",
        markdown,
        [
            Plot(
                "rtho",
                _rtho_figure(run),
                "RTHO: validation loss, learning rate and momentum over the inner steps",
            )
        ],
        metrics={"hyper_cleaning": cleaning.summary(), "rtho": run},
    )

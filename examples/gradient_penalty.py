"""Train with a loss that contains the gradient of the network w.r.t. its input.

A critic-style gradient penalty (Gulrajani et al. 2017, WGAN-GP) on the digits data:
``loss = CE(model(x), y) + lam * mean_i (||d logit_y(x_i) / d x_i|| - 1)^2``. Training
differentiates through the input gradient: a second-order, mixed input/parameter derivative.
``gradkit.func.gradients(..., create_graph=True)`` gives the input gradient with its graph so that
``loss.backward()`` reaches the parameters through it.

Run: ``python examples/gradient_penalty.py --steps 50``
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from gradkit.func import gradients


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits from scikit-learn when available (no download), else a synthetic stand-in."""
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data[:n], dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target[:n])
    except ImportError:  # pragma: no cover - the demo extra installs scikit-learn
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 64, generator=g)
        y = (x[:, :32].sum(1) > x[:, 32:].sum(1)).long()
    return x, y


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lam", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    x, y = make_data(512, args.seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = last = {}
    for step in range(args.steps):
        xb = x.clone().requires_grad_(True)
        logits = model(xb)
        ce = nn.functional.cross_entropy(logits, y)
        picked = logits.gather(1, y[:, None]).sum()  # row i depends on x_i only
        (gx,) = gradients(picked, [xb], create_graph=True)
        penalty = ((gx.norm(dim=1) - 1) ** 2).mean()
        loss = ce + args.lam * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = {"loss": loss.item(), "ce": ce.item(), "penalty": penalty.item()}
        if step == 0:
            first = stats
        last = stats
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step:3d}  loss {stats['loss']:.4f}  ce {stats['ce']:.4f}  "
                f"penalty {stats['penalty']:.4f}"
            )
    return {"first_loss": first["loss"], "last_loss": last["loss"]}


if __name__ == "__main__":
    main()

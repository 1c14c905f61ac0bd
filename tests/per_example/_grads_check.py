"""``p.grad`` after tracking: bit-for-bit what an untracked backward gives, except the weights
of Linear layers on sequences and the weights and biases of convolutions whose gradient
``track(fuse=True)`` sums from the per-example gradients (equal to float rounding)."""

from __future__ import annotations

import torch


def same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose gradients differ: bitwise, or for a weight or bias beyond float rounding."""
    off = []
    for name, w in want.items():
        g = got[name]
        if g.is_sparse or w.is_sparse:
            g, w = g.to_dense(), w.to_dense()
        if torch.equal(g, w):
            continue
        rtol = 1e-12 if w.dtype == torch.float64 else 1e-5
        scale = float(w.abs().max())
        close = torch.allclose(g, w, rtol=rtol, atol=rtol * max(scale, 1e-30))
        if not (name.endswith(("weight", "bias")) and close):
            off.append(name)
    return off

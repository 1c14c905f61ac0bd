"""``p.grad`` after tracking: bit-for-bit what an untracked backward gives, except the weights
and biases of Linear layers on sequences and of convolutions whose gradient
``track(fuse=True)`` sums from the per-example gradients: equal to float rounding, measured
against the model's largest gradient (a sum that cancels to about 0, such as an attention key
projection's bias, whose gradient is 0 under softmax, rounds to a different tiny value)."""

from __future__ import annotations

import torch


def same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose gradients differ: bitwise, or for a weight or bias beyond float rounding."""
    off = []
    dense = [w.to_dense() if w.is_sparse else w for w in want.values()]
    largest = max((float(w.abs().max()) for w in dense if w.numel()), default=0.0)
    for name, w in want.items():
        g = got[name]
        if g.is_sparse or w.is_sparse:
            g, w = g.to_dense(), w.to_dense()
        if torch.equal(g, w):
            continue
        rtol = 1e-12 if w.dtype == torch.float64 else 1e-5
        close = torch.allclose(g, w, rtol=rtol, atol=rtol * max(largest, 1e-30))
        if not (name.endswith(("weight", "bias")) and close):
            off.append(name)
    return off

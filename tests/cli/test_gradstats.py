"""The demo's per-layer statistics against the one-example-at-a-time loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradkit._digits import make_model
from gradkit.cli._gradstats import GradStatsRecorder
from gradkit.testing import per_example_grads

pytestmark = pytest.mark.cpu_only


def test_the_layer_snr_is_the_median_over_the_layers_entries() -> None:
    """The report calls it the median over each layer's entries; it was the mean of each
    parameter's median (weight and bias medians averaged)."""
    torch.manual_seed(0)
    model = make_model().double()
    x, y = torch.rand(16, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (16,))
    recorder = GradStatsRecorder(model, every=1)
    with recorder(1):
        F.cross_entropy(model(x), y).backward()
    want = per_example_grads(model, lambda o, t: F.cross_entropy(o, t), x, y)
    for layer, values in recorder.records[-1]["layers"].items():
        parts = [g.flatten(1) for name, g in want.items() if name.rsplit(".", 1)[0] == layer]
        g = torch.cat(parts, 1)
        var = g.var(0, unbiased=True)
        kept = var > 1e-12 * g.square().mean(0).max()  # dead units: no gradient, no ratio
        ratios = (g.mean(0).square() / var)[kept].sort().values
        k = ratios.numel()
        middle = (ratios[(k - 1) // 2] + ratios[k // 2]) / 2
        assert values["snr"] == pytest.approx(float(middle), rel=1e-8), layer

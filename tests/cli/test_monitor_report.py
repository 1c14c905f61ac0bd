"""``gradkit monitor-report``: the report of a GradientMonitor log (plots, tables, metrics),
and a clear refusal of logs that cannot be read."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gradkit.cli import main
from gradkit.monitor import GradientMonitor

pytestmark = pytest.mark.cpu_only  # the CLI writes files and figures

pytest.importorskip("matplotlib")


def _log(path, steps=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(model, every=2, optimizer=opt, writer=path)
    for _ in range(steps):
        x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        with monitor.step() as step:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            step.loss = loss
        opt.step()
        opt.zero_grad()
    return monitor


def test_the_report_of_a_log(tmp_path, capsys):
    log = tmp_path / "grads.jsonl"
    monitor = _log(log)
    assert main(["monitor-report", str(log), "--out", str(tmp_path / "runs")]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    report = (run / "report.md").read_text()
    assert "3 tracked steps, 0 to 4" in report and "| noise_scale |" in report
    for png in ("noise_scale", "grad_norm", "example_norms", "cabs", "layers_snr_median"):
        assert (run / f"{png}.png").stat().st_size > 1000, png
        assert f"]({png}.png)" in report
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["whole_model"]["last"] == json.loads(json.dumps(monitor.records[-1]))
    assert f"report: {run / 'report.md'}" in capsys.readouterr().out
    assert main(["monitor-report", str(tmp_path), "--out", str(tmp_path / "more")]) == 0  # folder


def test_a_log_of_two_runs_is_reported_as_its_last_run(tmp_path):
    """A monitor appends to an existing log: a second run's steps start again, and the report
    counted both runs as one (\"6 tracked steps, 0 to 4\", one series). The per-layer section's
    numbers reach metrics.json too (its per_layer entry was empty)."""
    log = tmp_path / "grads.jsonl"
    _log(log)
    second = _log(log, steps=4)
    assert main(["monitor-report", str(log), "--out", str(tmp_path / "runs")]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    report = (run / "report.md").read_text()
    assert "2 tracked steps, 0 to 2" in report
    assert "The log holds 2 runs (its steps start again at record 4" in report
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["whole_model"]["last"] == json.loads(json.dumps(second.records[-1]))
    assert metrics["per_layer"]["last"] == json.loads(json.dumps(second.records[-1]["layers"]))


def _written(name, text):
    def make(d):
        (d / name).write_text(text)
        return d / name

    return make


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "missing.jsonl", "does not exist"),
        (_written("empty.jsonl", ""), "holds no records"),
        (_written("bad.jsonl", "oops\n"), "line 1 is not JSON"),
        (lambda d: d, "holds no .jsonl log"),
    ],
)
def test_unreadable_logs_are_refused(tmp_path, capsys, make, words):
    target = make(tmp_path)
    assert main(["monitor-report", str(target), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradkit monitor-report: ") and words in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())

"""Smoke tests of the ``per_example`` benchmark suite: it runs, writes its JSON and markdown,
every result agrees with the torch.func reference, and the memory subprocesses report numbers.
Timing and memory targets are never asserted (machines are noisy)."""

import importlib.util
import json

import pytest
import torch

from gradkit._bench import main
from gradkit._bench.per_example import (
    MODELS,
    QUANTITIES,
    _problem,
    _Runner,
    measure_memory,
    memory_child,
)

PEERS = {
    "backpack": importlib.util.find_spec("backpack") is not None,
    "opacus": importlib.util.find_spec("opacus") is not None,
}


@pytest.mark.slow
def test_per_example_suite_smoke(tmp_path, capsys):
    assert main(["--suite", "per_example", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "per_example.json").read_text(encoding="utf-8"))
    markdown = (tmp_path / "per_example.md").read_text(encoding="utf-8")
    assert result["suite"] == "per_example"
    assert result["config"]["memory"] is False  # off unless asked, in smoke and quick runs
    keys = [c["key"] for c in result["cases"]]
    assert keys == [f"{m}_{q}" for m in MODELS for q in QUANTITIES]

    mismatches = [
        (c["key"], m["key"], m["max_abs_diff"])
        for c in result["cases"]
        for m in c["methods"]
        if m["agree"] is False
    ]
    assert mismatches == []
    assert result["summary"]["all_agree"] is True
    for case in result["cases"]:
        methods = {m["key"]: m for m in case["methods"]}
        assert methods["plain"]["ratio"] == pytest.approx(1.0)
        assert methods["plain"]["agree"] is None  # timed for scale, nothing to compare
        assert methods["gradkit"]["agree"] is True
        assert methods["torch_func"]["agree"] is True
        for peer, installed in PEERS.items():
            assert (peer in methods) == installed, (case["key"], peer)
        assert case["targets"][0]["name"].startswith("gradkit ")
        for t in case["targets"]:
            assert t["ratio"] > 0
            assert t["pass"] in (True, False, None)
    judged = {(c["key"], t["target"]) for c in result["cases"] for t in c["targets"] if t["target"]}
    assert ("mlp_variance", 1.5) in judged and ("3c3d_batch_grad", 2.5) in judged

    assert "## Summary" in markdown
    assert "| method | x baseline |" in markdown
    assert "Numerical agreement: all results agree." in markdown
    assert "## Summary" in capsys.readouterr().out


def test_quick_runs_time_plain_and_gradkit_only():
    quick = _Runner(_problem("mlp", 0, 2), peers=False)
    assert list(quick.variants("variance")) == ["plain", "gradkit"]
    assert quick.notes == []  # nothing skipped: peers are left out on purpose


@pytest.mark.slow
def test_memory_subprocess_reports_a_peak():
    mem = measure_memory("mlp", batch=2, processes=1, variants=())
    assert mem["baseline_mib"] > 0 and mem["extra_mib"] == {}


def test_memory_child(capsys):
    threads = torch.get_num_threads()
    try:
        memory_child(["mlp", "gradkit", "1", "0", "2"])
        assert json.loads(capsys.readouterr().out)["peak_mib"] > 0
        memory_child(["mlp", "no_such_peer", "1", "0", "2"])
        assert json.loads(capsys.readouterr().out) == {"skipped": True}
    finally:
        torch.set_num_threads(threads)  # the entry point sets it for its own process


def test_memory_flag():
    from gradkit._bench import _parser

    assert _parser().parse_args([]).memory is None  # main: on for full runs only
    assert _parser().parse_args(["--memory"]).memory is True
    assert _parser().parse_args(["--quick", "--no-memory"]).memory is False

"""Smoke test of the benchmark suite: it runs, writes its JSON and markdown, and every method
agrees numerically with its reference. Timing targets are never asserted (machines are noisy)."""

import json

import pytest
import torch

from gradkit._bench import main
from gradkit._bench._timing import quantile, time_interleaved
from gradkit._scope import torch_scope

pytestmark = pytest.mark.cpu_only  # the benchmark harness times and measures on the CPU


@pytest.mark.slow
def test_func_suite_smoke(tmp_path, capsys):
    threads = torch.get_num_threads()
    assert main(["--suite", "func", "--smoke", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # the run restores the thread count

    result = json.loads((tmp_path / "func.json").read_text(encoding="utf-8"))
    markdown = (tmp_path / "func.md").read_text(encoding="utf-8")
    printed = capsys.readouterr().out

    assert result["suite"] == "func"
    assert result["machine"]["threads"] == 1
    assert {"torch", "cpu", "date"} <= set(result["machine"])
    keys = [c["key"] for c in result["cases"]]
    assert {"jacobian_50x100", "jacobian_500x8", "hvp", "module_hvp", "hessian"} <= set(keys)

    mismatches = [
        (c["key"], m["key"], m["max_abs_diff"])
        for c in result["cases"]
        for m in c["methods"]
        if m["agree"] is False
    ]
    assert mismatches == []
    assert result["summary"]["all_agree"] is True
    for case in result["cases"]:
        assert case["agreement"]["all_agree"] is True
        checked = [m for m in case["methods"] if m["agree"] is not None]
        assert checked, case["key"]
        for m in case["methods"]:
            assert m["median_ms"] > 0
            assert m["ratio"] > 0
        for t in case["targets"]:
            assert t["ratio"] > 0
            assert t["pass"] in (True, False, None)
    hessian = next(c for c in result["cases"] if c["key"] == "hessian")
    assert hessian["extras"]["max abs asymmetry of gradkit.func.hessian"] < 1e-12

    assert "## Summary" in markdown
    assert "| method | x baseline |" in markdown
    assert "Numerical agreement: all results agree." in markdown
    assert "## Summary" in printed


def test_time_interleaved_round_robin():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    res = time_interleaved(fns, repeats=4, warmup=0, rewarm_s=0.0, seed=1)
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 4 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes from round to round
    for r in res.values():
        assert r["repeats"] == 4 and len(r["samples_ms"]) == 4
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]


def test_time_interleaved_rewarms_cheap_callables():
    calls = []
    res = time_interleaved({"f": lambda: calls.append(1)}, repeats=3, warmup=1)
    assert res["f"]["number"] == 1
    # warmup, two calibration calls, then an untimed call before each timed one
    assert len(calls) == 1 + 2 + 3 * 2


def test_time_interleaved_calibrates_calls_per_sample():
    res = time_interleaved({"f": lambda: None}, repeats=2, warmup=1, min_sample_s=1e-3)
    assert res["f"]["number"] > 1


def test_quantile_and_threads():
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    before = torch.get_num_threads()
    with torch_scope(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="an int >= 1"), torch_scope(0):
        pass


def test_cli_rejects_bad_threads(tmp_path):
    with pytest.raises(SystemExit):
        main(["--threads", "0", "--out", str(tmp_path)])
    assert not (tmp_path / "func.json").exists()


@pytest.mark.parametrize("suite", ["accumulate", "curvature", "hyper", "monitor"])
def test_other_suites_smoke(tmp_path, capsys, suite):
    assert main(["--suite", suite, "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"{suite}.json").read_text())
    assert result["suite"] == suite and result["summary"]["all_agree"]
    assert (tmp_path / f"{suite}.md").read_text().startswith(f"# gradkit benchmarks: {suite}")


@pytest.mark.parametrize(
    ("device", "says"),
    [("tpu", "expected 'cpu' or 'cuda[:N]', got 'tpu'"), ("meta", "got 'meta'")]
    + ([] if torch.cuda.is_available() else [("cuda", "torch.cuda.is_available() is False")]),
)
def test_cli_rejects_a_device_it_cannot_time(tmp_path, capsys, device, says):
    with pytest.raises(SystemExit) as info:
        main(["--suite", "func", "--smoke", "--device", device, "--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "gradkit bench: error: --device: " in err and says in err
    assert not (tmp_path / "func.json").exists()


def test_cpu_runs_say_their_device_and_measure_no_device_memory(tmp_path):
    assert main(["--suite", "accumulate", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "accumulate.json").read_text())
    assert result["machine"]["device"] == "cpu" and result["machine"]["device_name"] is None
    assert all(m["peak_mib"] is None for c in result["cases"] for m in c["methods"])
    assert "peak MiB" not in (tmp_path / "accumulate.md").read_text()


@pytest.mark.cuda
@pytest.mark.parametrize("suite", ["per_example", "func"])
def test_cuda_smoke_times_with_events_and_reports_peak_memory(tmp_path, suite):
    assert main(["--suite", suite, "--smoke", "--device", "cuda", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"{suite}.json").read_text())
    assert result["machine"]["device"].startswith("cuda")
    assert result["machine"]["device_name"] == torch.cuda.get_device_name()
    peaks = [m["peak_mib"] for c in result["cases"] for m in c["methods"]]
    assert peaks and all(p is not None and p >= 0 for p in peaks)
    assert "peak MiB" in (tmp_path / f"{suite}.md").read_text()


@pytest.mark.cuda
def test_cuda_samples_include_the_device_work():
    """An event-timed sample waits for the kernels it queued: a large matmul chain takes
    longer than the host needs to queue it."""
    a = torch.randn(4096, 4096, device="cuda")
    timings = time_interleaved(
        {"mm": lambda: a @ a @ a @ a}, repeats=3, device=torch.device("cuda")
    )
    assert timings["mm"]["median_ms"] > 0.5


def test_cases_are_timed_outside_any_torch_function_mode(monkeypatch, tmp_path):
    """A mode (such as torch.device(...) as a context) adds about 1 us to every torch call,
    which would tax the methods with many small operations; the CPU run enters none."""
    from gradkit import _bench
    from gradkit._bench._case import Case, Method

    seen = []

    def method():
        seen.append(torch._C._is_torch_function_mode_enabled())
        return torch.ones(2)

    case = Case("probe", "probe", {}, [Method("m", "m", method)], ("m",), "m", torch.float64)
    monkeypatch.setitem(_bench.SUITES, "func", lambda: [case])
    result = _bench.run_suite("func", mode="smoke")
    assert seen and not any(seen)
    assert result["cases"][0]["key"] == "probe"

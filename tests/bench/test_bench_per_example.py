"""Smoke tests of the ``per_example`` benchmark suite: it runs, writes its JSON and markdown,
every result agrees with the torch.func reference, and the memory subprocesses report numbers.
Timing and memory targets are never asserted (machines are noisy).

The ``gpt2`` model (Hugging Face GPT-2, position ids broadcast over the batch) runs where
``transformers`` is installed; a method that raises or disagrees must fail the run."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

import gradkit
from gradkit._bench import _parser, main
from gradkit._bench._case import Settings, run_case
from gradkit._bench._per_example_hand import hand_written
from gradkit._bench._per_example_problems import make_problem
from gradkit._bench._per_example_runner import Runner, Variant
from gradkit._bench.per_example import (
    _PEERS,
    MODELS,
    _case,
    build_cases,
    measure_memory,
    memory_child,
    quantities,
)

pytestmark = pytest.mark.cpu_only  # the benchmark harness times and measures on the CPU

PEERS = {
    "backpack": importlib.util.find_spec("backpack") is not None,
    "opacus": importlib.util.find_spec("opacus") is not None,
}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
RUN = [m for m in MODELS if m != "gpt2" or HAS_TRANSFORMERS]


def _check_peers(case):
    """Each installed peer is timed, or left out with a note saying what it raised."""
    methods = {m["key"] for m in case["methods"]}
    for peer, installed in PEERS.items():
        if not installed:
            assert peer not in methods, (case["key"], peer)
        elif peer not in methods:
            why = [n for n in case["notes"] if n.startswith(f"{_PEERS[peer]} fails on")]
            why += [n for n in case["notes"] if n.startswith(f"{_PEERS[peer]} refuses")]
            assert why and " raised " in why[0], (case["key"], peer, case["notes"])


@pytest.mark.slow
# the compiled case: torch.compile's own warnings (see tests/per_example/test_compile.py)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_per_example_suite_smoke(tmp_path, capsys):
    assert main(["--suite", "per_example", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "per_example.json").read_text(encoding="utf-8"))
    markdown = (tmp_path / "per_example.md").read_text(encoding="utf-8")
    assert result["suite"] == "per_example"
    assert result["config"]["memory"] is False  # off unless asked, in smoke and quick runs
    keys = [c["key"] for c in result["cases"]]
    assert keys == [f"{m}_{q}" for m in RUN for q in quantities(m)]
    assert set(quantities("gpt2")) >= {"variance", "batch_l2"}

    mismatches = [
        (c["key"], m["key"], m["max_abs_diff"])
        for c in result["cases"]
        for m in c["methods"]
        if m["agree"] is False
    ]
    assert mismatches == []
    assert result["summary"]["all_agree"] is True
    compiled = result["cases"][-1]
    assert compiled["key"] == "compiled_variance_batch_l2"
    assert [m["key"] for m in compiled["methods"]] == [
        "plain_compiled",
        "gradkit_compiled",
        "plain",
        "gradkit",
    ]
    assert [m["agree"] for m in compiled["methods"]] == [None, True, None, True]
    assert [t["name"] for t in compiled["targets"]] == [
        "compiled tracked / compiled plain",
        "eager tracked / eager plain",
        "compiled plain / eager plain",
    ]
    for case in result["cases"][:-1]:
        methods = {m["key"]: m for m in case["methods"]}
        assert methods["plain"]["ratio"] == pytest.approx(1.0)
        assert methods["plain"]["agree"] is None  # timed for scale, nothing to compare
        assert methods["gradkit"]["agree"] is True
        assert methods["torch_func"]["agree"] is True
        if not case["key"].startswith("gpt2"):  # these models take every installed peer
            for peer, installed in PEERS.items():
                assert (peer in methods) == installed, (case["key"], peer)
        _check_peers(case)
        # the hand-written reference: on the nn.Sequential models, never a peer
        assert ("hand" in methods) == (not case["key"].startswith("gpt2")), case["key"]
        if "hand" in methods:
            assert methods["hand"]["agree"] is True
            hand = methods["hand"]["label"]
            by_name = {t["name"]: t for t in case["targets"]}
            assert by_name["gradkit / the fastest peer"]["denominator"] != hand
            assert by_name["gradkit / hand-written (no goal)"]["denominator"] == hand
            assert by_name["gradkit / hand-written (no goal)"]["pass"] is None
        assert case["targets"][0]["name"].startswith("gradkit ")
        for t in case["targets"]:
            assert t["ratio"] > 0
            assert t["pass"] in (True, False, None)
    judged = {(c["key"], t["target"]) for c in result["cases"] for t in c["targets"] if t["target"]}
    assert ("mlp_variance", 1.5) in judged and ("3c3d_batch_grad", 1.6) in judged
    assert ("cnn_variance", 1.6) in judged and ("cnn_variance", 1.0) in judged  # fastest peer

    assert "## Summary" in markdown
    assert "| method | x baseline |" in markdown
    assert "Numerical agreement: all results agree." in markdown
    assert "## Summary" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["mlp", "seq", "3c3d", "cnn"])
def test_the_hand_written_reference_agrees_with_the_loop(key):
    """The hand-written method computes every quantity the suite asks, as the float64
    one-example-at-a-time loop does (a reference the speed goals are measured against)."""
    p = make_problem(key, 0, batch=5)
    p.model.double()
    p.x = p.x.double()
    if p.y.is_floating_point():
        p.y = p.y.double()
    grads = list(gradkit.testing.per_example_grads(p.model, p.loss_fn, p.x, p.y).values())
    expected = {
        "batch_grad": grads,
        "second_moment": [g.square().mean(0) for g in grads],
        "variance": [g.var(0, unbiased=False) for g in grads],
        "batch_l2": sum(g.flatten(1).square().sum(1) for g in grads),
    }
    for quantity in quantities(key):
        label, step = hand_written(p, quantity)
        assert label.startswith("hand-written")
        for _ in range(2):  # the second call reuses the per-example gradients' buffers
            got, want = step(), expected[quantity]
            if quantity == "batch_l2":
                got, want = [got], [want]
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_hand_written_reference_covers_plain_sequential_models_only():
    assert hand_written(make_problem("mlp", 0, 2), "variance") is not None
    p = make_problem("mlp", 0, 2)
    p.model = torch.nn.ModuleList(list(p.model))  # not a Sequential: no hand-written forward
    assert hand_written(p, "variance") is None
    p = make_problem("cnn", 0, 2)
    p.model[0].groups = 2  # a grouped convolution: not covered
    assert hand_written(p, "variance") is None


def test_quick_runs_time_plain_and_gradkit_only():
    quick = Runner(make_problem("mlp", 0, 2), peers=False)
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
    assert _parser().parse_args([]).memory is None  # main: on for full runs only
    assert _parser().parse_args(["--memory"]).memory is True
    assert _parser().parse_args(["--quick", "--no-memory"]).memory is False


def test_models_flag(tmp_path, capsys):
    assert _parser().parse_args([]).models is None
    assert _parser().parse_args(["--models", "gpt2", "mlp"]).models == ["gpt2", "mlp"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["--models", "resnet"])
    with pytest.raises(SystemExit):  # the other suites have no models to choose from
        main(["--suite", "func", "--models", "mlp", "--smoke", "--out", str(tmp_path)])
    assert "--models: expected --suite per_example" in capsys.readouterr().err
    assert not (tmp_path / "func.json").exists()


def test_models_flag_runs_only_those_models(tmp_path):
    argv = ["--suite", "per_example", "--models", "seq", "--smoke", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "per_example.json").read_text(encoding="utf-8"))
    assert [c["key"] for c in result["cases"]] == [f"seq_{q}" for q in quantities("seq")]
    assert result["config"]["models"] == ["seq"]
    assert result["summary"]["all_agree"] is True


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_gpt2_cases_agree_with_torch_func(tmp_path):
    """GPT-2 as its users call it: gradkit must agree with torch.func's per-example gradients
    (the run exits 1 if gradkit raises or disagrees)."""
    argv = ["--suite", "per_example", "--models", "gpt2", "--smoke", "--out", str(tmp_path)]
    code = main(argv)
    result = json.loads((tmp_path / "per_example.json").read_text(encoding="utf-8"))
    cases = {c["key"]: c for c in result["cases"]}
    assert list(cases) == [f"gpt2_{q}" for q in quantities("gpt2")]
    failures = {
        (key, m["key"]): (m["max_abs_diff"], [n for n in c["notes"] if "raised" in n])
        for key, c in cases.items()
        for m in c["methods"]
        if m["agree"] is False
    }
    assert failures == {}
    assert code == 0
    for case in cases.values():
        methods = {m["key"]: m for m in case["methods"]}
        assert methods["gradkit"]["agree"] is True and methods["torch_func"]["agree"] is True
        assert case["setup"]["input"] == "4x64"
        assert 0.9e6 < case["setup"]["parameters"] < 1.1e6
        assert any("[1, T]" in n for n in case["notes"])
        _check_peers(case)
        assert case["targets"][0]["target"] is not None  # the goal is judged


def test_gpt2_is_skipped_with_a_note_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cases = build_cases("quick", ("seq", "gpt2"))
        assert [c.key for c in cases] == [f"seq_{q}" for q in quantities("seq")]
        for case in cases:
            assert any(n.startswith("The `gpt2` cases are skipped") for n in case.notes)
        with pytest.raises(ValueError, match="no case left to run.*transformers"):
            build_cases("quick", ("gpt2",))
    with pytest.raises(ValueError, match="expected names of"):
        build_cases("quick", ("resnet",))


def test_transformers_is_imported_only_to_build_gpt2():
    code = (
        "import sys, gradkit._bench.per_example as pe; "
        "assert 'transformers' not in sys.modules; "
        "pe.make_problem('mlp', 0, 2); assert 'transformers' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_raising_gradkit_is_a_mismatch_and_its_goal_is_not_judged(monkeypatch):
    runner = Runner(make_problem("mlp", 0, 4), peers=False)
    grads = runner.func_grads()

    def broken(*args, **kwargs):
        raise gradkit.GradkitError("per_example.track: model: broken on purpose")

    monkeypatch.setattr(gradkit.per_example, "track", broken)
    case = _case(runner, "variance", grads, "quick")
    result = run_case(case, Settings(repeats=1, warmup=1, min_sample_s=0.0))
    methods = {m["key"]: m for m in result["methods"]}
    assert methods["gradkit"]["agree"] is False and methods["gradkit"]["max_abs_diff"] is None
    assert result["agreement"]["all_agree"] is False
    assert result["targets"][0]["target"] is None and result["targets"][0]["pass"] is None
    assert any(n.startswith("gradkit raised GradkitError in ") for n in result["notes"])
    assert any("broken on purpose" in n for n in result["notes"])


def test_a_peer_that_raises_is_left_out_with_a_note(monkeypatch):
    runner = Runner(make_problem("mlp", 0, 4), peers=False)
    grads = runner.func_grads()
    variants = runner.variants("variance")

    def refuse():
        raise NotImplementedError("no rule for this layer")

    variants["opacus"] = Variant("Opacus something", refuse)
    monkeypatch.setattr(runner, "variants", lambda quantity: variants)
    result = run_case(
        _case(runner, "variance", grads, "quick"), Settings(repeats=1, warmup=1, min_sample_s=0.0)
    )
    assert [m["key"] for m in result["methods"]] == ["plain", "gradkit"]
    assert result["agreement"]["all_agree"] is True
    note = next(n for n in result["notes"] if n.startswith("Opacus fails on this model"))
    assert "`Opacus something` raised NotImplementedError in " in note
    assert "no rule for this layer" in note


def test_the_timed_rounds_start_after_the_convolution_methods_are_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gradkit times its convolution methods on the first tracked steps: the case runs those
    steps before its rounds, and says so in a note."""
    from gradkit.per_example.rules import _conv

    monkeypatch.setattr(_conv, "_CHOICE", {})
    monkeypatch.setattr(_conv, "_TRIALS", {})
    runner = Runner(make_problem("cnn", 0, 4), peers=False)
    case = _case(runner, "batch_l2", runner.func_grads(), "quick")
    assert not _conv._TRIALS and len(_conv._CHOICE) == 2  # the CNN's two convolutions
    # 2 x 8 blocks in 15 steps (one step ends one shape's timing and starts the other's),
    # the first of them the case's first call
    steps = 2 * _conv._RUNS * len(_conv._METHODS) - 2
    assert any(f"{steps} steps ran before the timed rounds" in note for note in case.notes)

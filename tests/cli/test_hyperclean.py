"""``gradkit hyperclean``: the quick run cleans (better than the baseline, F1 well above
chance) and writes its report and results.json; options are checked; local MNIST copies are
read from .npz (never unpickled) or IDX files; the demo's RTHO run is sane."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradkit._digits import load_digits
from gradkit.cli import main
from gradkit.cli._hyperclean import QUICK_HYPER_STEPS
from gradkit.cli._hyperclean_data import DataError, load_source, make_split, read_idx
from gradkit.cli._hyperclean_demo import rtho_run

pytestmark = pytest.mark.cpu_only  # the CLI runs its own jobs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ["weights_histogram.png", "outer_loss.png", "accuracy.png"]
KEYS = ("baseline_accuracy", "oracle_accuracy", "cleaned_accuracy", "f1", "precision", "recall")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "hyper.md"


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with _one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["hyperclean", "--no-progress", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """One in-process ``gradkit hyperclean --quick``: (out, run folder, stdout)."""
    out = tmp_path_factory.mktemp("hyperclean_out")
    code, stdout, stderr = _run(["--quick", "--out", str(out), "--seed", "0"])
    assert code == 0, stderr
    (run,) = out.iterdir()
    return out, run, stdout


@pytest.fixture(scope="module")
def results(quick_run: tuple[Path, Path, str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((quick_run[1] / "results.json").read_text())
    return data


def test_writes_only_the_run_folder(quick_run: tuple[Path, Path, str]) -> None:
    out, run, _ = quick_run
    assert [p.name for p in out.iterdir()] == [run.name]
    assert sorted(p.name for p in run.iterdir()) == sorted(["report.md", "results.json", *FIGURES])
    for name in FIGURES:
        assert (run / name).read_bytes()[:8] == PNG_MAGIC


def test_quick_run_cleans(results: dict[str, Any]) -> None:
    for key in KEYS:
        assert 0.0 <= results[key] <= 1.0, key
    assert results["cleaned_accuracy"] > results["baseline_accuracy"]
    assert results["oracle_accuracy"] > results["baseline_accuracy"]
    assert results["f1"] > 0.75  # flagging at random scores about 0.5
    assert results["precision"] > 0.9
    assert results["corrupted"] == 224 and results["radius"] == 225
    data = results["data"]
    assert (data["train"], data["validation"], data["test"]) == (449, 449, 899)
    assert "scaled by 1797/20,000" in data["description"]
    weights = torch.tensor(results["weights"])
    assert len(weights) == 449 and float(weights.min()) >= 0 and float(weights.max()) <= 1
    assert float(weights.sum()) <= results["radius"] + 1e-3
    corrupted = torch.zeros(449, dtype=torch.bool)
    corrupted[results["corrupted_indices"]] = True
    assert float(weights[corrupted].mean()) < 0.2 < 0.8 < float(weights[~corrupted].mean())
    history = results["history"]
    assert len(history["outer_loss"]) == results["config"]["hyper_steps"] == QUICK_HYPER_STEPS
    assert history["outer_loss"][-1] < 0.8 * history["outer_loss"][0]
    assert results["config"]["inner_steps"] == 100


def test_docs_quote_the_quick_run(results: dict[str, Any]) -> None:
    """docs/hyper.md states what ``--quick`` runs and what it gives: both come from this run
    (the accuracies are counts over 899 test examples, so four decimals are exact)."""
    text = " ".join(DOCS.read_text(encoding="utf-8").split())
    config = results["config"]
    settings = re.search(
        r"`--quick`: T = (\d+), (\d+) hyper-steps, hyper learning rate ([\d.]+),", text
    )
    assert settings is not None, "docs/hyper.md no longer states the --quick settings"
    assert settings.groups() == (
        str(config["inner_steps"]),
        str(config["hyper_steps"]),
        f"{config['hyper_lr']:g}",
    )
    quoted = re.search(
        r"`gradkit hyperclean --quick` \(T = (\d+), (\d+) hyper-steps, hyper learning rate "
        r"([\d.]+), [^)]*\) gives ([\d.]+) / ([\d.]+) / ([\d.]+) and F1 ([\d.]+)\.",
        text,
    )
    assert quoted is not None, "docs/hyper.md no longer quotes the --quick results"
    accuracies = ("baseline_accuracy", "oracle_accuracy", "cleaned_accuracy")
    assert quoted.groups() == (
        *settings.groups(),
        *(f"{results[k]:.4f}" for k in accuracies),
        f"{results['f1']:.3f}",
    )


def test_report_has_the_table_and_every_figure(quick_run: tuple[Path, Path, str]) -> None:
    text = (quick_run[1] / "report.md").read_text(encoding="utf-8")
    assert text.startswith("# gradkit hyperclean")
    for row in ("baseline (all weights 1)", "oracle (corrupted examples removed)", "hyper-cleaned"):
        assert row in text
    for name in FIGURES:
        assert f"]({name})" in text
    assert "{{figure:" not in text


def test_prints_a_summary(quick_run: tuple[Path, Path, str]) -> None:
    _, run, stdout = quick_run
    assert "hyper-cleaned test accuracy" in stdout
    assert f"report: {run / 'report.md'}" in stdout


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["hyperclean", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--quick", "--out", "--data", "--seed", "--threads", "--hyper-steps"):
        assert option in text
    assert "--inner-steps" in text


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--hyper-steps", "0"], "--hyper-steps"),
        (["--inner-steps", "ten"], "--inner-steps"),
        (["--threads", "0"], "--threads"),
        (["--seed", "-1"], "--seed"),
        (["--bogus"], "--bogus"),
        (["--quick", "extra"], "extra"),
    ],
)
def test_bad_options_exit_two_and_name_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["hyperclean", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_out_that_is_a_file_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "taken"
    afile.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["hyperclean", "--quick", "--out", str(afile)])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err


# -- local MNIST copies ------------------------------------------------------------------------


def _fake_mnist(n_train: int = 120, n_test: int = 60, seed: int = 0) -> dict[str, np.ndarray]:
    """Separable 6x6 'images' of 3 classes as uint8, MNIST's layout."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for part, n in (("train", n_train), ("test", n_test)):
        y = rng.integers(0, 3, n).astype(np.uint8)
        x = rng.integers(0, 60, (n, 6, 6)).astype(np.uint8)
        for c in range(3):
            x[y == c, c * 2 : c * 2 + 2, :] += 180
        arrays[f"x_{part}"], arrays[f"y_{part}"] = x, y
    return arrays


def _write_idx(path: Path, array: np.ndarray, *, gz: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    raw = header + array.astype(">u1").tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def test_npz_copy_runs_with_the_paper_split_capped_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "mnist.npz"
    np.savez(path, **_fake_mnist())
    out = tmp_path / "runs"
    code, _, err = _run(
        ["--data", str(path), "--out", str(out), "--hyper-steps", "3", "--inner-steps", "20"]
    )
    assert code == 0, err
    (run,) = out.iterdir()
    res = json.loads((run / "results.json").read_text())
    assert (res["data"]["train"], res["data"]["validation"], res["data"]["test"]) == (60, 60, 60)
    assert res["data"]["features"] == 36 and res["data"]["classes"] == 3
    assert res["corrupted"] == 30 and math.isfinite(res["cleaned_accuracy"])


def test_idx_folder_reads_like_the_npz(tmp_path: Path) -> None:
    arrays = _fake_mnist()
    names = {
        "x_train": "train-images-idx3-ubyte",
        "y_train": "train-labels-idx1-ubyte",
        "x_test": "t10k-images-idx3-ubyte.gz",
        "y_test": "t10k-labels-idx1-ubyte.gz",
    }
    for key, name in names.items():
        _write_idx(tmp_path / name, arrays[key], gz=name.endswith(".gz"))
    np.testing.assert_array_equal(read_idx(tmp_path / names["x_train"]), arrays["x_train"])
    npz = tmp_path / "copy.npz"
    np.savez(npz, **arrays)
    a, b = load_source(str(tmp_path)), load_source(str(npz))
    for x, y in ((a.x, b.x), (a.y, b.y), (a.test_x, b.test_x), (a.test_y, b.test_y)):
        assert x is not None and y is not None and torch.equal(x, y)
    assert float(a.x.max()) <= 1.0 and a.x.shape == (120, 36)
    split = make_split(a, 0, quick=True)
    assert split.sizes == (60, 60, 60) and int(split.corrupted.sum()) == 30
    flipped = split.corrupted
    assert bool((split.y_train[flipped] != split.y_train_true[flipped]).all())
    assert bool((split.y_train[~flipped] == split.y_train_true[~flipped]).all())


def test_unusable_data_is_refused_without_unpickling(tmp_path: Path) -> None:
    pickled = tmp_path / "objects.npz"
    arrays: dict[str, Any] = _fake_mnist()
    arrays["y_train"] = np.array([object()] * 120, dtype=object)
    np.savez(pickled, **arrays)
    with pytest.raises(DataError, match="plain numeric arrays"):
        load_source(str(pickled))
    missing_key = tmp_path / "partial.npz"
    np.savez(missing_key, x_train=np.zeros((4, 2)), y_train=np.zeros(4, dtype=np.int64))
    with pytest.raises(DataError, match="missing x_test, y_test"):
        load_source(str(missing_key))
    with pytest.raises(DataError, match="MNIST.s four IDX files"):
        load_source(str(tmp_path))
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(DataError, match="expected an .npz file"):
        load_source(str(tmp_path / "data.csv"))
    bad = tmp_path / "bad-idx"
    bad.write_bytes(b"\x00\x00\x08\x01" + struct.pack(">i", 10) + b"\x00" * 3)
    with pytest.raises(DataError, match="the header says"):
        read_idx(bad)
    code, _, err = _run(["--data", str(pickled), "--out", str(tmp_path / "runs")])
    assert code == 2 and "--data" in err
    assert not (tmp_path / "runs").exists()


def test_split_of_the_digits_follows_the_seed() -> None:
    source = load_source(None)
    a, b, c = (make_split(source, s, quick=False) for s in (0, 0, 1))
    assert torch.equal(a.y_train, b.y_train) and torch.equal(a.corrupted, b.corrupted)
    assert not torch.equal(a.corrupted, c.corrupted)
    assert a.sizes == (449, 449, 899) and a.num_classes == 10


# -- the demo's RTHO run -------------------------------------------------------------------------


def test_demo_rtho_run_tunes_within_the_boxes() -> None:
    data = load_digits(0, max_train=200, max_test=100)
    with _one_thread():
        run = rtho_run(data, steps=30, seed=0)
    assert run["inner_steps"] == [10, 20, 30]
    assert len(run["lr"]) == len(run["momentum"]) == 4
    assert run["lr"][0] == pytest.approx(0.02) and run["momentum"][0] == pytest.approx(0.5)
    assert all(1e-3 <= v <= 0.2 for v in run["lr"]) and all(0 <= v <= 0.9 for v in run["momentum"])
    assert run["lr"][-1] != run["lr"][0]
    for curve in run["validation_loss"].values():
        assert len(curve) == 3 and all(math.isfinite(v) for v in curve)
    assert all(0 <= a <= 1 for a in run["test_accuracy"].values())

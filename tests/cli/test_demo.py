"""``gradkit demo --quick``: it trains, and the report, figures and metrics are sane."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradkit._scope import torch_scope
from gradkit.cli import main
from gradkit.cli._demo import SECTIONS
from gradkit.cli._sections import section_title

pytestmark = pytest.mark.cpu_only  # the CLI runs its own jobs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = [
    "training_curves.png",
    "gradient_stats.png",
    "sharpness.png",
    "accumulation.png",
    "saliency.png",
    "hessian_power_iteration.png",
    "rtho.png",
]


class _FakeTTY(io.StringIO):
    """stderr as a terminal: the progress bars are drawn into it."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def quick_run_with_progress(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path, str, str]:
    """One in-process quick demo shared by the tests, its progress drawn on a (fake) terminal:
    (out, run folder, stdout, stderr)."""
    out = tmp_path_factory.mktemp("demo_out")
    buffer, terminal = io.StringIO(), _FakeTTY()
    # Without --threads the demo leaves torch's thread count as it is. One thread is the fast
    # setting for this small model, and the only one that stays fast when other processes
    # share the cores (intra-op threads then wait on each other at every op).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            pytest.MonkeyPatch.context() as env,
            contextlib.redirect_stdout(buffer),
            contextlib.redirect_stderr(terminal),
        ):
            env.setenv("TERM", "xterm")
            for name in ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "NO_COLOR", "FORCE_COLOR"):
                env.delenv(name, raising=False)
            code = main(["demo", "--quick", "--out", str(out), "--seed", "0"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, terminal.getvalue()
    (run,) = out.iterdir()
    return out, run, buffer.getvalue(), terminal.getvalue()


@pytest.fixture(scope="module")
def quick_run(quick_run_with_progress: tuple[Path, Path, str, str]) -> tuple[Path, Path, str]:
    """(out, run folder, stdout) of the shared quick demo."""
    return quick_run_with_progress[:3]


@pytest.fixture(scope="module")
def metrics(quick_run: tuple[Path, Path, str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((quick_run[1] / "metrics.json").read_text())
    return data


def test_writes_only_the_run_folder(quick_run: tuple[Path, Path, str]) -> None:
    out, run, _ = quick_run
    assert [p.name for p in out.iterdir()] == [run.name]
    names = sorted(p.name for p in run.iterdir())
    assert names == sorted(["report.md", "metrics.json", *FIGURES])
    for name in FIGURES:
        assert (run / name).read_bytes()[:8] == PNG_MAGIC


def test_report_has_sections_and_links_every_figure(quick_run: tuple[Path, Path, str]) -> None:
    text = (quick_run[1] / "report.md").read_text(encoding="utf-8")
    headings = (
        "# gradkit demo",
        "## Setup",
        "## Training",
        "## Statistics of individual gradients",
        "## Differentiation showcase",
        "## Hyperparameters by gradient",
    )
    for heading in headings:
        assert heading in text
    for name in FIGURES:
        assert f"]({name})" in text
    assert "{{figure:" not in text
    assert 'mode="auto"` picked **reverse**' in text


def test_gradient_statistics_recorded_over_training(metrics: dict[str, Any]) -> None:
    records = metrics["statistics_of_individual_gradients"]["records"]
    assert len(records) >= 10
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    for r in records:
        # one step's unbiased parts; its ratio is undefined (null) where |G|^2 is not resolved
        assert r["trace"] > 0 and math.isfinite(r["signal"])
        want = r["trace"] / r["signal"] if r["signal"] > 0 else None
        assert r["noise_scale"] == (pytest.approx(want, rel=1e-12) if want else None)
        assert set(r["layers"]) == {"0", "2", "5", "7"}
    assert any(r["signal"] > 0 for r in records)


def test_accumulation_is_exact_and_naive_is_not(metrics: dict[str, Any]) -> None:
    check = metrics["exact_accumulation"]["exactness"]
    assert check["max_abs_diff"] < 1e-5 * max(1.0, check["max_abs_gradient"])
    assert check["naive_max_abs_diff"] > 100 * check["max_abs_diff"]
    history = metrics["exact_accumulation"]["adaptive_history"]
    assert history and all(1 <= h["num_micro"] <= 16 for h in history)


def test_sharpness_recorded(metrics: dict[str, Any]) -> None:
    sharp = metrics["sharpness_over_training"]
    assert len(sharp["steps"]) >= 3
    assert all(math.isfinite(v) and v > 0 for v in sharp["top_eigenvalue"])


def test_metrics_are_sane(metrics: dict[str, Any]) -> None:
    assert metrics["mode"] == "quick"
    final = metrics["training"]["final"]
    assert final["test_accuracy"] > 0.5  # chance is 0.1
    assert all(math.isfinite(final[k]) for k in ("train_loss", "test_loss"))
    assert len(metrics["training"]["epochs"]) == 2

    jac = metrics["differentiation_showcase"]["jacobian"]
    assert jac["shape"] == [10, 8, 8]
    assert jac["auto_mode"] == "reverse"
    assert jac["max_abs_difference_between_modes"] < 1e-4

    hess = metrics["differentiation_showcase"]["hessian"]
    assert hess["num_parameters"] == metrics["setup"]["parameters"]
    assert hess["top_eigenvalue"] > 0 and math.isfinite(hess["top_eigenvalue"])
    assert 0 < hess["gradient_norm"] < 1e3
    assert len(hess["eigenvalue_history"]) == hess["power_steps"]

    cost = metrics["differentiation_showcase"]["hvp_cost"]
    assert set(cost["seconds"]) == {"gradient", "hvp", "hvp_operator"}
    assert all(s > 0 for s in cost["seconds"].values())
    assert cost["ratio_to_gradient"]["gradient"] == pytest.approx(1.0)
    assert cost["hvp_over_gradient"] > 0


def test_prints_a_summary(quick_run: tuple[Path, Path, str]) -> None:
    _, run, stdout = quick_run
    assert "final test accuracy" in stdout
    assert f"report: {run / 'report.md'}" in stdout


def test_torch_scope_restores_threads_and_rng() -> None:
    before_threads = torch.get_num_threads()
    before_rng = torch.get_rng_state()
    with torch_scope(1):
        assert torch.get_num_threads() == 1
        torch.manual_seed(123)
        torch.rand(3)
    assert torch.get_num_threads() == before_threads
    assert torch.equal(torch.get_rng_state(), before_rng)


def test_demo_in_ci_without_stdin_or_terminal(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env["CI"] = "true"
    argv = ["demo", "--quick", "--epochs", "1", "--threads", "1", "--out", str(tmp_path)]
    # the real command line in a child process, with the report cut to its first two sections
    # (the full quick run is the module fixture's)
    script = (
        "import sys; from gradkit.cli import _demo, main; "
        "_demo.SECTIONS[:] = [_demo.setup_section, _demo.training_section]; "
        "raise SystemExit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout + proc.stderr  # no progress redraws, no colours
    (run,) = tmp_path.iterdir()
    data = json.loads((run / "metrics.json").read_text())
    assert data["setup"]["threads"] == 1
    assert len(data["training"]["epochs"]) == 1


def test_progress_is_shown_for_training_and_every_section(
    quick_run_with_progress: tuple[Path, Path, str, str],
) -> None:
    _, _, stdout, stderr = quick_run_with_progress
    assert "training" in stderr
    titles = [section_title(section) for section in SECTIONS]
    assert len(set(titles)) == len(titles) == 7
    for title in titles:
        assert f" {title}" in stderr, title
    assert "hyper-cleaning, hyper-step" in stderr  # the long section says what it is doing
    assert "RTHO tuning" in stderr
    assert f"{len(titles)}/{len(titles)}" in stderr
    assert "\x1b[" not in stdout  # the bars go to stderr only

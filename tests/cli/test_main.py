"""The ``gradkit`` command line: parsing, exit codes, info, bench and hyperclean dispatch."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import gradkit
from gradkit.cli import main
from gradkit.cli._info import PEERS, collect_info, format_info, peer_version

pytestmark = pytest.mark.cpu_only  # the CLI runs its own jobs

COMMANDS = ["demo", "info", "bench", "hyperclean"]


def test_info_prints_versions_and_peers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert gradkit.__version__ in out
    assert f"torch threads  {torch.get_num_threads()}" in out
    for dist, _, _ in PEERS:
        assert dist in out


def test_collect_info_reports_installed_and_missing_peers() -> None:
    info = collect_info()
    assert info["torch"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["peers"]["matplotlib"] not in (None, "unknown")
    assert peer_version("no-such-dist-xyz", "no_such_module_xyz") is None
    assert "not installed" in format_info({**info, "peers": {"opacus": None}})


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradkit {gradkit.__version__}"


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)], ids=["gradkit", *COMMANDS])
def test_help_exits_zero(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    assert f"usage: gradkit {' '.join(command)}".strip() in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["demo", "--bogus"], "--bogus"),
        (["demo", "--epochs", "0"], "--epochs"),
        (["demo", "--epochs", "two"], "--epochs"),
        (["demo", "--threads", "-1"], "--threads"),
        (["demo", "--seed", "x"], "--seed"),
        (["info", "--verbose"], "--verbose"),
        (["--nope"], "--nope"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_bad_input_exits_two_and_names_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_out_that_is_a_file_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "taken"
    afile.write_text("x")
    for out in (afile, afile / "below"):
        with pytest.raises(SystemExit) as exc:
            main(["demo", "--quick", "--no-progress", "--out", str(out)])
        assert exc.value.code == 2
        assert "--out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_no_command_prints_help_and_returns_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: gradkit" in capsys.readouterr().err


def test_hyperclean_with_unusable_data_returns_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such.npz"
    assert main(["hyperclean", "--quick", "--no-progress", "--data", str(missing)]) == 2
    assert "--data" in capsys.readouterr().err


def test_bench_passes_the_remaining_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    monkeypatch.setitem(sys.modules, "gradkit._bench", types.SimpleNamespace(main=fake_main))
    assert main(["bench", "--quick", "--only", "jacobian", "x"]) == 7
    assert main(["bench", "--", "--help"]) == 7
    assert main(["bench"]) == 7
    assert seen == [["--quick", "--only", "jacobian", "x"], ["--help"], []]


@pytest.mark.parametrize(
    ("missing", "expected"), [("gradkit._bench", "not part of"), ("opacus", "gradkit[bench]")]
)
def test_bench_without_runner_or_peers_returns_two(
    missing: str, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr("gradkit.cli._main.importlib.import_module", fail)
    assert main(["bench", "--quick"]) == 2
    assert expected in capsys.readouterr().err


def test_bench_runner_without_main_returns_two(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "gradkit._bench", types.SimpleNamespace())
    assert main(["bench"]) == 2
    assert "gradkit._bench" in capsys.readouterr().err


def _ci_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env["CI"] = "true"
    return env


def test_python_m_gradkit_info() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradkit", "info"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=_ci_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert torch.__version__ in proc.stdout
    assert proc.stderr == ""

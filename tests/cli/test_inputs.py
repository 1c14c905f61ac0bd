"""Command-line options of every ``gradkit`` command: a bad value gives one line and exit 2
before anything runs (no traceback, no folder made, the benchmark runner never called), and the
help text is printed as written and quotes the budgets the code uses."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import types
from pathlib import Path

import pytest

from gradkit.cli import main
from gradkit.cli._hyperclean import QUICK_HYPER_STEPS, QUICK_INNER_STEPS, HypercleanConfig
from gradkit.cli._main import build_parser
from gradkit.cli._options import MAX_EPOCHS, MAX_STEPS, MAX_THREADS
from gradkit.cli._sections import DemoConfig

pytestmark = pytest.mark.cpu_only  # the CLI runs its own jobs


def _exit_code(argv: list[str]) -> tuple[int, str]:
    """``main(argv)``'s exit status (returned or raised) and its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, err.getvalue()


def _last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["demo", "--epochs", "-3"], ("--epochs", "1 to 1,000", "'-3'")),
        (["demo", "--epochs", str(MAX_EPOCHS + 1)], ("--epochs", "1 to 1,000")),
        (["demo", "--threads", "99999999999"], ("--threads", "1 to 1,024")),
        (["demo", "--threads", "0"], ("--threads", "1 to 1,024")),
        (["demo", "--seed", str(2**32)], ("--seed", "0 to 2**32 - 1")),
        (["hyperclean", "--threads", "100000000000"], ("--threads", "1 to 1,024")),
        (["hyperclean", "--inner-steps", "1e3"], ("--inner-steps", "'1e3'")),
        (["hyperclean", "--inner-steps", str(MAX_STEPS + 1)], ("--inner-steps", "100,000")),
        (["hyperclean", "--hyper-steps", "-1"], ("--hyper-steps", "1 to 100,000")),
        (["hyperclean", "--hyper-steps", "10**9"], ("--hyper-steps", "'10**9'")),
        (["bench", "--", "--suite", "nope"], ("--suite", "invalid choice")),
    ],
)
def test_bad_numbers_and_choices_exit_two_before_running(
    argv: list[str], words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradkit import _bench

    calls: list[object] = []
    monkeypatch.setattr(_bench, "run_suite", lambda *a, **k: calls.append(a))
    code, stderr = _exit_code(argv)
    assert code == 2
    line = _last_line(stderr)
    for word in words:
        assert word in line, line
    assert not calls


def _fake_runner(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 0

    monkeypatch.setitem(sys.modules, "gradkit._bench", types.SimpleNamespace(main=fake_main))
    return seen


def _out_cases(tmp_path: Path) -> list[tuple[str, str]]:
    afile = tmp_path / "taken"
    afile.write_text("x")
    cases = [
        ("", "got ''"),
        ("runs\x00x", "runs\\x00x"),
        (str(afile / "below"), "is a file"),
        (str(tmp_path / ("n" * 300) / "x"), "File name too long"),
    ]
    if Path("/proc/self").is_dir():  # a folder no one can create folders in
        cases.append(("/proc/gradkit-no-such", "no new folder can be made in '/proc'"))
    return cases


@pytest.mark.parametrize("command", ["demo", "hyperclean", "bench"])
def test_unusable_out_exits_two_naming_it(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _fake_runner(monkeypatch)
    for out, words in _out_cases(tmp_path):
        argv = [command, "--out", out] + (
            ["--quick", "--no-progress"] if command != "bench" else []
        )
        code, stderr = _exit_code(argv)
        assert code == 2, (out, stderr)
        line = _last_line(stderr)
        assert "argument --out" in line and words in line, line
        assert "write to" in line or "remove the file" in line
    assert seen == []  # the runner never started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_writable_out_is_left_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_runner(monkeypatch)
    assert _exit_code(["bench", "--suite", "func", "--out", str(tmp_path / "new" / "deep")])[0] == 0
    assert seen == [["--suite", "func", "--out", str(tmp_path / "new" / "deep")]]
    assert list(tmp_path.iterdir()) == []  # the check made nothing


def _parsers() -> list[argparse.ArgumentParser]:
    parser, commands = build_parser()
    return [parser, *commands.values()]


def test_help_prints_percent_signs_once() -> None:
    for parser in _parsers():
        text = parser.format_help()
        assert "%%" not in text and "%(" not in text, parser.prog
    epilog = build_parser()[1]["hyperclean"].format_help()
    assert "25 % / 25 % / 50 %" in " ".join(epilog.split())


def _help_of(command: str) -> str:
    return " ".join(build_parser()[1][command].format_help().split())


def test_quick_help_quotes_the_budgets_the_code_uses() -> None:
    quick = HypercleanConfig.from_args(
        out="runs",
        quick=True,
        data=None,
        seed=0,
        threads=1,
        progress=False,
        hyper_steps=None,
        inner_steps=None,
    )
    assert (quick.hyper_steps, quick.inner_steps) == (QUICK_HYPER_STEPS, QUICK_INNER_STEPS)
    text = _help_of("hyperclean")
    assert f"{QUICK_HYPER_STEPS} hyper-steps of {QUICK_INNER_STEPS} inner steps" in text
    assert f"or {QUICK_HYPER_STEPS} with --quick" in text
    assert f"or {QUICK_INNER_STEPS} with --quick" in text
    assert "a few seconds" not in text and re.search(r"about \d+ s on a free CPU core", text)

    demo = DemoConfig.from_args(
        out="runs", quick=True, epochs=None, seed=0, threads=1, progress=False
    )
    text = _help_of("demo")
    assert f"{demo.epochs} epochs on small subsets" in text
    assert f"or {demo.epochs} with --quick" in text
    assert "a few seconds" not in text and re.search(r"about \d+ s on a free CPU core", text)


def test_bounds_in_help_match_the_checks() -> None:
    for command, option, high in (
        ("demo", "--epochs", MAX_EPOCHS),
        ("demo", "--threads", MAX_THREADS),
        ("hyperclean", "--hyper-steps", MAX_STEPS),
        ("hyperclean", "--inner-steps", MAX_STEPS),
    ):
        assert f"1 to {high:,}" in _help_of(command), (command, option)
        assert _exit_code([command, option, str(high + 1)])[0] == 2

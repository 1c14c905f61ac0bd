"""``gradkit`` entry point: the argument parser and the dispatch to the commands.

Commands: ``demo`` (train a small CNN on the bundled digits, write a report), ``info``
(versions, device, optional peers), ``bench`` (gradkit against its peers; every argument after
``bench`` goes to the benchmark runner), ``hyperclean`` (data hyper-cleaning with
:mod:`gradkit.hyper`, writes a report), ``monitor-report`` (the plots of a
:class:`gradkit.monitor.GradientMonitor` log). Heavy or optional imports happen inside the commands,
so ``--help``, ``--version`` and ``info`` work on a bare install.

Exit status: 0 on success, 2 for bad command-line input or a command that cannot run here
(missing optional dependencies), 1 when a command fails while running. Bad input is refused
before anything runs, with one line on stderr that names the option, what was expected and
what was given, and what to do: argparse's checks (numbers with their bounds, choices), an
``--out`` under which no folder can be made (tried, not guessed from permission bits; for
``bench`` too), and a ``hyperclean --data`` file that cannot be used
(:mod:`gradkit.cli._hyperclean_files`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import cast

from gradkit._version import __version__
from gradkit.cli._options import (
    MAX_EPOCHS,
    MAX_STEPS,
    MAX_THREADS,
    bench_out,
    count,
    out_problem,
    seed,
)

__all__ = ["build_parser", "main"]

_DEMO_DEPS = (("matplotlib", "matplotlib"), ("rich", "rich"), ("sklearn", "scikit-learn"))


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``gradkit`` parser and its subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog="gradkit",
        description="gradkit: gradients beyond loss.backward() (Jacobians, Hessians, "
        "per-example statistics, exact accumulation, hypergradients).",
    )
    parser.add_argument("--version", action="version", version=f"gradkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, argparse.ArgumentParser] = {}

    demo = sub.add_parser(
        "demo",
        help="train a small CNN on the bundled digits and write a report",
        description="Train a small CNN on scikit-learn's bundled digits (no download), then "
        "write <OUT>/<timestamp>/report.md with plots, a differentiation "
        "showcase (input Jacobian, Hessian eigenvalue, HVP cost) and metrics.json. "
        "A full run takes about 40 s on a free CPU core, --quick about 12 s.",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="2 epochs on small subsets, shorter sections (a smoke run: about 12 s on a free "
        "CPU core instead of 40 s)",
    )
    demo.add_argument(
        "--epochs",
        type=count(MAX_EPOCHS),
        metavar="N",
        help=f"training epochs, 1 to {MAX_EPOCHS:,} (default: 6, or 2 with --quick)",
    )
    demo.add_argument(
        "--out",
        default="runs",
        metavar="DIR",
        help="folder for run outputs; each run gets DIR/<timestamp>/ (default: runs)",
    )
    demo.add_argument(
        "--seed",
        type=seed,
        default=0,
        metavar="S",
        help="seed for the split, initialization and batch order, 0 to 2**32 - 1 (default: 0)",
    )
    demo.add_argument(
        "--threads",
        type=count(MAX_THREADS),
        metavar="T",
        default=1,
        help=f"torch CPU threads for the run, 1 to {MAX_THREADS:,} (default: 1, the fastest for "
        "this small model, and much the fastest when other processes share the cores)",
    )
    demo.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )
    commands["demo"] = demo

    commands["info"] = sub.add_parser(
        "info",
        help="versions, device, threads and installed optional peers",
        description="Print gradkit/torch/numpy/python versions, the device, torch's thread "
        "count and which optional peers are installed (paste it in bug reports).",
    )

    commands["bench"] = sub.add_parser(
        "bench",
        usage="%(prog)s [-h] [ARGS ...]",
        help="gradkit against its peers, side by side",
        description="Run the benchmarks (gradkit against BackPACK, Opacus, higher, torchopt "
        "and torch.func). Every argument after 'bench' is passed to the "
        "benchmark runner; 'gradkit bench -- --help' shows the runner's options.",
        epilog="Needs the bench extra: pip install 'gradkit[bench]'. 'gradkit bench --quick' "
        "(all suites, few repeats) takes about 1.5 minutes on a free CPU core; a full run "
        "much longer.",
        allow_abbrev=False,
    )

    clean = sub.add_parser(
        "hyperclean",
        help="data hyper-cleaning on digits: learn per-example weights that drop bad labels",
        description="Data hyper-cleaning (Franceschi et al. 2017, section 5.1): half of the "
        "training labels are replaced by a wrong class; per-example weights in [0, 1] (sum <= R) "
        "are learned by reverse-mode hypergradients so that softmax regression trained with "
        "them does well on a clean validation set. Writes <OUT>/<timestamp>/report.md (table "
        "and plots) and results.json.",
        epilog="Default data: scikit-learn's bundled digits (no download), split 25 % / 25 % "
        "/ 50 % as the paper's MNIST setup; a full run takes about 4 minutes on a free CPU core. "
        "--data takes a local MNIST copy: an .npz with x_train, y_train, x_test, y_test "
        "(integer labels 0..C-1; read without pickle) or a folder of IDX files.",
    )
    clean.add_argument(
        "--quick",
        action="store_true",
        help="20 hyper-steps of 100 inner steps (about 8 s on a free CPU core)",
    )
    clean.add_argument(
        "--out",
        default="runs",
        metavar="DIR",
        help="folder for run outputs; each run gets DIR/<timestamp>/ (default: runs)",
    )
    clean.add_argument(
        "--data",
        metavar="PATH",
        help="a local MNIST copy: .npz file or folder of IDX files (default: bundled digits)",
    )
    clean.add_argument(
        "--seed",
        type=seed,
        default=0,
        metavar="S",
        help="seed for the split and the corrupted labels, 0 to 2**32 - 1 (default: 0)",
    )
    clean.add_argument(
        "--threads",
        type=count(MAX_THREADS),
        metavar="T",
        default=1,
        help=f"torch CPU threads for the run, 1 to {MAX_THREADS:,} (default: 1)",
    )
    clean.add_argument(
        "--hyper-steps",
        type=count(MAX_STEPS),
        metavar="N",
        help=f"hyper-steps (Adam steps on the weights), 1 to {MAX_STEPS:,} (default: 300, or 20 "
        "with --quick)",
    )
    clean.add_argument(
        "--inner-steps",
        type=count(MAX_STEPS),
        metavar="T",
        help=f"gradient-descent steps of each training, 1 to {MAX_STEPS:,} (default: 1000, or "
        "100 with --quick)",
    )
    clean.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )
    commands["hyperclean"] = clean

    report = sub.add_parser(
        "monitor-report",
        help="plots of a GradientMonitor's JSON-lines log",
        description="Turn the JSON-lines log of a gradkit.monitor.GradientMonitor into a report: "
        "<OUT>/<timestamp>/report.md with plots of the noise scale, gradient norm, per-example "
        "norm quantiles and CABS batch size over the steps, the median SNR and noise scale per "
        "layer, and metrics.json.",
        epilog="Needs matplotlib (the demo extra: pip install 'gradkit[demo]').",
    )
    report.add_argument(
        "log", metavar="LOG", help="the log file, or a folder holding one .jsonl file"
    )
    report.add_argument(
        "--out",
        default="runs",
        metavar="DIR",
        help="folder for run outputs; each report gets DIR/<timestamp>/ (default: runs)",
    )
    commands["monitor-report"] = report
    return parser, commands


def _demo_extra_missing(command: str) -> bool:
    """Say on stderr which packages of the demo extra ``command`` lacks; False if none."""
    missing = [dist for module, dist in _DEMO_DEPS if importlib.util.find_spec(module) is None]
    if missing:
        print(
            f"gradkit {command}: needs {', '.join(missing)}; install the demo extra: "
            "pip install 'gradkit[demo]'",
            file=sys.stderr,
        )
    return bool(missing)


def _cmd_info(args: argparse.Namespace) -> int:
    from gradkit.cli._info import run_info

    return run_info()


def _cmd_demo(args: argparse.Namespace) -> int:
    if _demo_extra_missing("demo"):
        return 2
    from gradkit.cli._console import print_summary
    from gradkit.cli._demo import run_demo
    from gradkit.cli._sections import DemoConfig

    config = DemoConfig.from_args(
        out=args.out,
        quick=args.quick,
        epochs=args.epochs,
        seed=args.seed,
        threads=args.threads,
        progress=not args.no_progress,
    )
    start = time.perf_counter()
    report = run_demo(config)
    print_summary(report, time.perf_counter() - start)
    return 0


_NO_RUNNER = "gradkit bench: the benchmark runner (gradkit._bench) is not part of this installation"


def _cmd_bench(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    try:
        module = importlib.import_module("gradkit._bench")
    except ModuleNotFoundError as err:
        if err.name in ("gradkit._bench", "gradkit"):
            print(_NO_RUNNER, file=sys.stderr)
        else:
            print(
                f"gradkit bench: needs {err.name!r}; install the bench extra: "
                "pip install 'gradkit[bench]'",
                file=sys.stderr,
            )
        return 2
    runner = getattr(module, "main", None)
    if not callable(runner):  # e.g. a folder without the runner's __init__.py
        print(_NO_RUNNER + " (gradkit._bench has no main)", file=sys.stderr)
        return 2
    return int(cast(Callable[[list[str]], int], runner)(rest))


def _cmd_hyperclean(args: argparse.Namespace) -> int:
    if _demo_extra_missing("hyperclean"):
        return 2
    from gradkit.cli._hyperclean import HypercleanConfig
    from gradkit.cli._hyperclean_data import DataError
    from gradkit.cli._hyperclean_report import print_hyperclean_summary
    from gradkit.cli._hyperclean_run import run_hyperclean

    config = HypercleanConfig.from_args(
        out=args.out,
        quick=args.quick,
        data=args.data,
        seed=args.seed,
        threads=args.threads,
        progress=not args.no_progress,
        hyper_steps=args.hyper_steps,
        inner_steps=args.inner_steps,
    )
    try:
        directory, results = run_hyperclean(config)
    except DataError as err:
        _say("hyperclean", str(err))
        return 2
    print_hyperclean_summary(directory, results)
    return 0


def _cmd_monitor_report(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        _say(
            "monitor-report",
            "needs matplotlib; install the demo extra: pip install 'gradkit[demo]'",
        )
        return 2
    from gradkit.cli._monitor_report import LogError, monitor_report

    try:
        path = monitor_report(args.log, args.out)
    except LogError as err:
        _say("monitor-report", str(err))
        return 2
    print(f"report: {path}")
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _cmd_demo,
    "info": _cmd_info,
    "bench": _cmd_bench,
    "hyperclean": _cmd_hyperclean,
    "monitor-report": _cmd_monitor_report,
}


def main(argv: list[str] | None = None) -> int:
    """Run the ``gradkit`` command line; returns the exit status.

    ``--help`` and ``--version`` exit through ``SystemExit(0)`` and bad arguments through
    ``SystemExit(2)``, as argparse does.

    Examples:
        >>> main(["hyperclean", "--inner-steps", "0"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    parser, commands = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        parser.print_help(sys.stderr)
        return 2
    if rest and args.command != "bench":
        commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    if rest[:1] == ["--"]:
        rest = rest[1:]
    args.rest = rest
    out = args.out if args.command in ("demo", "hyperclean", "monitor-report") else None
    if args.command == "bench":
        out = bench_out(rest)
    what = "result files" if args.command == "bench" else "run folders"
    problem = None if out is None else out_problem(out, what)
    if problem:
        commands[args.command].error(f"argument --out: {problem}")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        _say(args.command, "interrupted")
        return 130
    except (OSError, FloatingPointError, MemoryError) as err:
        _say(args.command, str(err) or type(err).__name__)
        return 1


def _say(command: str, text: str) -> None:
    """Print ``gradkit COMMAND: text`` to stderr on one line."""
    print(f"gradkit {command}: {' '.join(text.split())}", file=sys.stderr)

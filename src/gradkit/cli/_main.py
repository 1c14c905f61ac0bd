"""``gradkit`` entry point: the argument parser and the dispatch to the commands.

Commands: ``demo`` (train a small CNN on the bundled digits, write a report), ``info``
(versions, device, optional peers), ``bench`` (gradkit against its peers; every argument after
``bench`` goes to the benchmark runner), ``hyperclean`` (data hyper-cleaning with
:mod:`gradkit.hyper`, writes a report). Heavy or optional imports happen inside the commands,
so ``--help``, ``--version`` and ``info`` work on a bare install.

Exit status: 0 on success, 2 for bad command-line input (argparse's convention, and a
``hyperclean --data`` file that cannot be used) or a command that cannot run here (missing
optional dependencies), 1 when a command fails while running.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from typing import cast

from gradkit._version import __version__

__all__ = ["build_parser", "main"]

_DEMO_DEPS = (("matplotlib", "matplotlib"), ("rich", "rich"), ("sklearn", "scikit-learn"))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, 2**32), got {text!r}")
    return value


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
        "showcase (input Jacobian, Hessian eigenvalue, HVP cost) and metrics.json.",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="2 epochs on small subsets (a smoke run of a few seconds)",
    )
    demo.add_argument(
        "--epochs",
        type=_positive_int,
        metavar="N",
        help="training epochs (default: 6, or 2 with --quick)",
    )
    demo.add_argument(
        "--out",
        default="runs",
        metavar="DIR",
        help="folder for run outputs; each run gets DIR/<timestamp>/ (default: runs)",
    )
    demo.add_argument(
        "--seed",
        type=_seed,
        default=0,
        metavar="S",
        help="seed for the split, initialization and batch order (default: 0)",
    )
    demo.add_argument(
        "--threads",
        type=_positive_int,
        metavar="T",
        default=1,
        help="torch CPU threads for the run (default: 1, the fastest for this small model, "
        "and much the fastest when other processes share the cores)",
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
        epilog="Needs the bench extra: pip install 'gradkit[bench]'.",
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
        epilog="Default data: scikit-learn's bundled digits (no download), split 25 %% / 25 %% "
        "/ 50 %% as the paper's MNIST setup. --data takes a local MNIST copy: an .npz with "
        "x_train, y_train, x_test, y_test (read without pickle) or a folder of IDX files.",
    )
    clean.add_argument(
        "--quick",
        action="store_true",
        help="40 hyper-steps of 100 inner steps (a few seconds)",
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
        type=_seed,
        default=0,
        metavar="S",
        help="seed for the split and the corrupted labels (default: 0)",
    )
    clean.add_argument(
        "--threads",
        type=_positive_int,
        metavar="T",
        default=1,
        help="torch CPU threads for the run (default: 1)",
    )
    clean.add_argument(
        "--hyper-steps",
        type=_positive_int,
        metavar="N",
        help="hyper-steps (Adam steps on the weights; default: 300, or 40 with --quick)",
    )
    clean.add_argument(
        "--inner-steps",
        type=_positive_int,
        metavar="T",
        help="gradient-descent steps of each training (default: 1000, or 100 with --quick)",
    )
    clean.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )
    commands["hyperclean"] = clean
    return parser, commands


def _missing(deps: Sequence[tuple[str, str]]) -> list[str]:
    return [dist for module, dist in deps if importlib.util.find_spec(module) is None]


def _cmd_info(args: argparse.Namespace) -> int:
    from gradkit.cli._info import run_info

    return run_info()


def _cmd_demo(args: argparse.Namespace) -> int:
    missing = _missing(_DEMO_DEPS)
    if missing:
        print(
            f"gradkit demo: needs {', '.join(missing)}; install the demo extra: "
            "pip install 'gradkit[demo]'",
            file=sys.stderr,
        )
        return 2
    from gradkit.cli._console import print_summary
    from gradkit.cli._demo import DemoConfig, run_demo

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
    if rest[:1] == ["--"]:
        rest = rest[1:]
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
    missing = _missing(_DEMO_DEPS)
    if missing:
        print(
            f"gradkit hyperclean: needs {', '.join(missing)}; install the demo extra: "
            "pip install 'gradkit[demo]'",
            file=sys.stderr,
        )
        return 2
    from gradkit.cli._hyperclean import HypercleanConfig
    from gradkit.cli._hyperclean_data import DataError
    from gradkit.cli._hyperclean_report import print_hyperclean_summary, run_hyperclean

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
        print(f"gradkit hyperclean: {err}", file=sys.stderr)
        return 2
    print_hyperclean_summary(directory, results)
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _cmd_demo,
    "info": _cmd_info,
    "bench": _cmd_bench,
    "hyperclean": _cmd_hyperclean,
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
    args.rest = rest
    if args.command in ("demo", "hyperclean"):
        problem = _out_problem(args.out)
        if problem:
            commands[args.command].error(f"argument --out: {problem}")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"gradkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except (OSError, FloatingPointError) as err:
        print(f"gradkit {args.command}: {err}", file=sys.stderr)
        return 1


def _out_problem(out: str) -> str | None:
    """Why ``out`` cannot hold run folders (None if it can, or can be created)."""
    from pathlib import Path

    if not out.strip():
        return "expected a folder path, got an empty string"
    path = Path(out)
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                return f"expected a folder, but {str(candidate)!r} is a file"
            return None
    return None

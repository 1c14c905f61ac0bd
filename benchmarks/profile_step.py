"""Where one step's time goes, per method of the per-example suite: wall time per step, the
host's time to issue it, kernel time, kernel launches and aten calls (nested ones included).

    python benchmarks/profile_step.py --device cuda            # the default cases
    python benchmarks/profile_step.py --case 3c3d:variance --table gradkit

On a GPU a step whose kernel time is far below its wall time is launch-bound: the host's work
per step (Python, dispatch, launches) decides, not the kernels. Models, data and methods are the
suite's own (``gradkit bench --suite per_example``), TF32 off as there.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from gradkit._bench._per_example_problems import make_problem
from gradkit._bench._per_example_runner import Runner
from gradkit._precision import full_float32

CASES = ["3c3d:variance", "mlp:variance", "cnn:batch_l2", "seq:batch_grad"]
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}


def measure(
    fn: Callable[[], object], device: torch.device, steps: int = 30
) -> tuple[dict[str, float], Any]:
    """Per step: synchronized wall time and the host's time to issue it (ms), kernel time
    (ms), kernel launches and aten calls, from ``steps`` timed calls and 5 profiled ones; and
    the profiler's table of those 5."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(5):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    issued = time.perf_counter() - start
    sync()
    wall = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            fn()
        sync()
    events = prof.key_averages()
    kernel_us = sum(
        e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    figures = {
        "wall_ms": wall / steps * 1e3,
        "issue_ms": issued / steps * 1e3,
        "kernel_ms": kernel_us / 5e3,
        "launches": sum(e.count for e in events if e.key in LAUNCHES) / 5,
        "aten_calls": sum(e.count for e in events if e.key.startswith("aten::")) / 5,
    }
    return figures, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--case", nargs="+", default=CASES, help="model:quantity, e.g. mlp:variance"
    )
    parser.add_argument("--table", nargs="*", default=[], help="methods whose op table to print")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    build = torch.device(device) if device.type != "cpu" else contextlib.nullcontext()
    with full_float32(device.type == "cuda"):
        for case in args.case:
            key, quantity = case.split(":")
            torch.manual_seed(0)
            with build:
                runner = Runner(make_problem(key, 1, None), peers=True)
            print(f"\n{key} {quantity} on {device}")
            for name, variant in runner.variants(quantity).items():
                m, events = measure(variant.fn, device)
                print(
                    f"  {name:14s} wall {m['wall_ms']:7.3f} ms  issue {m['issue_ms']:7.3f} ms  "
                    f"kernels {m['kernel_ms']:6.3f} ms  launches {m['launches']:6.1f}  "
                    f"aten calls {m['aten_calls']:6.1f}"
                )
                if name in args.table:
                    by = (
                        "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
                    )
                    print(events.table(sort_by=by, row_limit=15, max_name_column_width=45))


if __name__ == "__main__":
    main()

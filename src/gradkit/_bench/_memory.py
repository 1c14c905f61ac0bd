"""Peak memory of one computation, measured in a fresh process (the suites' ``--memory``).

A suite gives a ``memory_child(argv)`` entry that builds its problem, runs one variant and
prints one JSON line; :func:`run_child` starts it with a fixed thread count and reads that line.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Any

__all__ = ["peak_rss_bytes", "run_child"]


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (``VmHWM``; ``ru_maxrss`` where /proc lacks it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def run_child(module: str, args: list[str], threads: int, what: str) -> dict[str, Any]:
    """Run ``module.memory_child(args)`` in a fresh interpreter with ``threads`` threads and
    return the JSON object it printed last; ``what`` names the run in the error if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    code = f"import sys; from {module} import memory_child; memory_child(sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what}: the memory subprocess failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result

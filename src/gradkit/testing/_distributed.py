"""Launching a script as several torch.distributed ranks on this machine, one process each,
as ``torchrun`` would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the
environment, a free port on loopback): for gloo tests on CPU in CI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: str | Path, args: Sequence[str] = (), *, world_size: int = 2, timeout: float = 120.0
) -> list[str]:
    """Run ``python script *args`` as ``world_size`` ranks; return each rank's output.

    Each rank calls ``torch.distributed.init_process_group("gloo")`` (the rendezvous comes from
    the environment). Raises ``RuntimeError`` with the rank's output if any rank fails, and
    kills the others after ``timeout`` seconds instead of hanging.
    """
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs: list[str] = []
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            text = out.decode(errors="replace")
            if p.returncode != 0:
                raise RuntimeError(
                    f"run_ranks({script}): rank {rank} exited with {p.returncode}:\n{text}"
                )
            outputs.append(text)
    finally:  # reap every rank: one left running when another failed is killed, then waited
        for p in procs:  # for (else its Popen warns "still running" when collected)
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
    return outputs

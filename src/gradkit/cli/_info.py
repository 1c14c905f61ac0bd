"""``gradkit info``: versions, device, threads and which optional peers are installed.

Peers are looked up with :func:`importlib.util.find_spec` and :mod:`importlib.metadata`, so
nothing heavy is imported just to report that it is there. Plain text on purpose: ``info`` must
work on a bare install (torch and numpy only), which is when people need it most.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
from typing import TextIO, TypedDict

__all__ = ["PEERS", "Info", "collect_info", "format_info", "peer_version", "run_info"]

#: Optional packages gradkit works with: (distribution name, import name, used for).
PEERS: tuple[tuple[str, str, str], ...] = (
    ("backpack-for-pytorch", "backpack", "bench"),
    ("opacus", "opacus", "bench"),
    ("higher", "higher", "bench"),
    ("torchopt", "torchopt", "bench"),
    ("scipy", "scipy", "bench, to_scipy()"),
    ("matplotlib", "matplotlib", "demo"),
    ("rich", "rich", "demo"),
    ("scikit-learn", "sklearn", "demo"),
)


class Info(TypedDict):
    """What ``gradkit info`` reports (stable keys, for tests and bug reports)."""

    gradkit: str
    torch: str
    numpy: str
    python: str
    platform: str
    cuda_available: bool
    cuda_version: str | None
    cuda_devices: list[str]
    mps_available: bool
    torch_threads: int
    peers: dict[str, str | None]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def peer_version(distribution: str, module: str) -> str | None:
    """The installed version of a peer, ``"unknown"`` if importable without metadata,
    ``None`` if absent.

    Examples:
        >>> peer_version("no-such-dist-xyz", "no_such_module_xyz") is None
        True
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return None
    return _version(distribution) or "unknown"


def collect_info() -> Info:
    """The facts ``gradkit info`` prints (peers map to a version or ``None``)."""
    import torch

    from gradkit import __version__

    cuda = torch.cuda.is_available()
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    )
    mps = getattr(torch.backends, "mps", None)
    return {
        "gradkit": __version__,
        "torch": torch.__version__,
        "numpy": _version("numpy") or "not installed",
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_devices": devices,
        "mps_available": bool(mps is not None and mps.is_available()),
        "torch_threads": torch.get_num_threads(),
        "peers": {dist: peer_version(dist, mod) for dist, mod, _ in PEERS},
    }


def format_info(info: Info) -> str:
    """Render :func:`collect_info`'s result as aligned plain text."""
    if info["cuda_available"]:
        cuda = f"yes, CUDA {info['cuda_version']}: " + "; ".join(
            f"cuda:{i} {name}" for i, name in enumerate(info["cuda_devices"])
        )
    else:
        cuda = "no"
    rows: list[tuple[str, object]] = [
        ("gradkit", info["gradkit"]),
        ("torch", info["torch"]),
        ("numpy", info["numpy"]),
        ("python", info["python"]),
        ("platform", info["platform"]),
        ("cuda", cuda),
        ("mps", "yes" if info["mps_available"] else "no"),
        ("torch threads", info["torch_threads"]),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", "optional peers:"]
    peers = info["peers"]
    pwidth = max(len(d) for d, _, _ in PEERS)
    for dist, _, used in PEERS:
        version = peers.get(dist)
        shown = version if version is not None else "not installed"
        lines.append(f"  {dist:<{pwidth}}  {shown:<14}  ({used})")
    return "\n".join(lines)


def run_info(stream: TextIO | None = None) -> int:
    """Print the environment report; returns the exit status (0)."""
    print(format_info(collect_info()), file=stream or sys.stdout)
    return 0

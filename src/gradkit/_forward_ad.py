"""Forward-mode AD without torch's load-time deprecation noise.

The first dual tensor of a process makes torch import its forward-AD decompositions, which are
registered through ``torch.jit.script``; torch 2.9+ warns that ``torch.jit.script`` is deprecated
at that moment. The warning concerns torch's internals, not the caller's code, so gradkit loads
the decompositions once, with that one warning silenced, before its first forward-mode product.
Every other warning passes through.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings

_loaded = False


def load_decompositions() -> None:
    """Load torch's forward-AD decompositions once, without their deprecation warning.

    >>> load_decompositions()  # idempotent, cheap after the first call
    """
    global _loaded
    if _loaded:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`torch.jit.script` is deprecated", category=DeprecationWarning
        )
        # what torch.autograd.forward_ad.make_dual imports on first use (a module import, so
        # it also works inside a dual level, where a probe make_dual would nest levels)
        if os.environ.get("PYTORCH_JIT", "1") == "1" and __debug__:
            with contextlib.suppress(ImportError):
                importlib.import_module("torch._decomp.decompositions_for_jvp")
    _loaded = True

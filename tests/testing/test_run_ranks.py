"""``gradkit.testing.run_ranks``: a failing rank is reported, and the others are killed and
reaped, not left running (a collected Popen of a live process warns, which pytest turns into
an error in whatever test runs then)."""

from __future__ import annotations

import gc
import pathlib
import time
import warnings

import pytest

from gradkit.testing import run_ranks

pytestmark = pytest.mark.cpu_only  # processes on this machine


def test_a_failing_rank_is_reported_and_the_others_are_reaped(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(3)\ntime.sleep(60)\n"
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with pytest.raises(RuntimeError, match="rank 0 exited with 3"):
            run_ranks(script, timeout=30)
        gc.collect()  # a Popen of a process left running would warn here
    assert time.perf_counter() - start < 20  # the sleeping rank was killed, not waited out

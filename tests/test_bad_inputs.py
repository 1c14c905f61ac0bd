"""Every misuse gets the right number or a clear error: the table of bad inputs.

Each row (``tests/bad_inputs/rows_*.py``) is one misuse of a public entry point. A row that must
fail asserts the exception type and the words its message must contain (the argument or module,
what was wrong, what to do) and, where it names state, that the failing call left it unchanged.
A row that must succeed compares its result with an oracle inside ``run``.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import bad_inputs
from bad_inputs._case import Case


def _rows() -> list[Case]:
    rows: list[Case] = []
    for info in sorted(pkgutil.iter_modules(bad_inputs.__path__), key=lambda m: m.name):
        if info.name.startswith("rows_"):
            module = importlib.import_module(f"{bad_inputs.__name__}.{info.name}")
            rows.extend(module.ROWS)
    return rows


ROWS = _rows()


def test_the_table_is_large_and_ids_are_unique() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(ROWS) >= 60
    packages = {row.id.split(".")[0] for row in ROWS}
    assert {"accumulate", "curvature", "func", "hyper", "optim", "per_example", "cli"} <= packages


@pytest.mark.parametrize("case", ROWS, ids=[row.id for row in ROWS])
def test_bad_input(case: Case) -> None:
    if case.raises is None:
        case.run()
        return
    before = [t.detach().clone() for t in case.unchanged()] if case.unchanged else []
    with pytest.raises(case.raises) as info:
        case.run()
    message = str(info.value).lower()
    device = str(torch.get_default_device())
    missing = [w for w in case.words if w.replace("{device}", device).lower() not in message]
    assert not missing, f"message lacks {missing}: {info.value}"
    if case.unchanged is not None:
        after = case.unchanged()
        assert len(after) == len(before)
        for a, b in zip(after, before, strict=True):
            assert torch.equal(a, b), "a failing call changed the user's state"

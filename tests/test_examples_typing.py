"""The README's and the docs' examples type-check under ``mypy --strict`` as written.

Each page's Python (plain blocks and doctest lines, in order, the namespace the page runs in) is
one module. ``--allow-untyped-calls`` is the one relaxation: torch 2.13 leaves some of its own
methods unannotated (``Tensor.backward``, ``Tensor.split``), which no gradkit signature can fix.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_only  # static type checks

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_code(page: pathlib.Path) -> str:
    """The Python of a page: fenced blocks as they are, doctest blocks by their ``>>>`` lines."""
    code: list[str] = []
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        lines = block.splitlines()
        if not any(line.lstrip().startswith(">>>") for line in lines):
            code.extend(lines)
            continue
        for line in lines:
            stripped = line.lstrip()
            if stripped.startswith((">>> ", "... ")):
                code.append(stripped[4:])
            elif stripped in (">>>", "..."):
                code.append("")
    return "\n".join(code) + "\n"


def test_every_page_has_examples() -> None:
    assert all(page_code(page).strip() for page in PAGES)


def test_examples_pass_mypy_strict(tmp_path: pathlib.Path) -> None:
    for page in PAGES:
        (tmp_path / f"{page.stem}.py").write_text(page_code(page))
    mypy = pytest.importorskip("mypy")
    assert mypy
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--allow-untyped-calls",
            "--ignore-missing-imports",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / ".cache"),
            "--config-file",
            "",
            *sorted(str(p) for p in tmp_path.glob("*.py")),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr

"""Check that the documentation site's API reference covers every public package: each module
in ``gradkit.__all__`` has its page ``docs/api/<name>.md`` with a ``::: gradkit.<name>``
directive, listed in mkdocs.yml's nav (run by `make docs` before the build).

Exits 1 with one line per missing page.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import gradkit

ROOT = Path(__file__).resolve().parents[1]


def missing_pages() -> list[str]:
    nav = (ROOT / "mkdocs.yml").read_text()
    problems = []
    packages = ["gradkit"] + [
        f"gradkit.{name}"
        for name in gradkit.__all__
        if isinstance(getattr(gradkit, name), types.ModuleType)
    ]
    for package in packages:
        page = f"api/{package.rsplit('.', 1)[-1]}.md"
        path = ROOT / "docs" / page
        if not path.is_file() or f"::: {package}\n" not in path.read_text() + "\n":
            problems.append(f"{package}: no docs/{page} with '::: {package}'")
        elif page not in nav:
            problems.append(f"{package}: docs/{page} is not in mkdocs.yml's nav")
    return problems


if __name__ == "__main__":
    problems = missing_pages()
    for problem in problems:
        print(f"check_api_pages: {problem}", file=sys.stderr)
    sys.exit(1 if problems else 0)

"""Check what `make dist` built: one wheel and one sdist of gradkit, both at the version of
src/gradkit/_version.py (the one place it is written), the wheel with the files a user needs.

Usage: python tools/check_dist.py DIST_DIR. Exits 1 with one line per problem.
"""

from __future__ import annotations

import ast
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_version() -> str:
    """``__version__`` of src/gradkit/_version.py, read without importing gradkit (or torch)."""
    tree = ast.parse((ROOT / "src" / "gradkit" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise SystemExit("check_dist: no __version__ in src/gradkit/_version.py")


def check(dist: Path) -> list[str]:
    version = source_version()
    problems: list[str] = []
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if [w.name for w in wheels] != [f"gradkit-{version}-py3-none-any.whl"]:
        problems.append(f"expected gradkit-{version}-py3-none-any.whl, found {wheels}")
    if [s.name for s in sdists] != [f"gradkit-{version}.tar.gz"]:
        problems.append(f"expected gradkit-{version}.tar.gz, found {sdists}")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            info = f"gradkit-{version}.dist-info"
            meta = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
            if (meta["Name"], meta["Version"]) != ("gradkit", version):
                problems.append(f"{wheel.name}: METADATA says {meta['Name']} {meta['Version']}")
            for needed in ("gradkit/__init__.py", "gradkit/py.typed", "gradkit/cli/__init__.py"):
                if needed not in names:
                    problems.append(f"{wheel.name}: {needed} is missing")
            entry_points = zf.read(f"{info}/entry_points.txt").decode()
            if "gradkit = gradkit.cli:main" not in entry_points:
                problems.append(f"{wheel.name}: no `gradkit` console script")
            if any(not n.startswith(("gradkit/", info + "/")) for n in names):
                extra = sorted(n for n in names if not n.startswith(("gradkit/", info)))
                problems.append(f"{wheel.name}: files outside the package: {extra[:5]}")
    for sdist in sdists:
        with tarfile.open(sdist) as tf:
            member = tf.extractfile(f"gradkit-{version}/PKG-INFO")
            pkg_info = Parser().parsestr(member.read().decode()) if member else None
        if pkg_info is None or pkg_info["Version"] != version:
            problems.append(f"{sdist.name}: PKG-INFO version is not {version}")
    return problems


def main(argv: list[str]) -> int:
    dist = Path(argv[1] if len(argv) > 1 else "dist")
    problems = check(dist)
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_dist: {dist}: wheel and sdist of gradkit {source_version()}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

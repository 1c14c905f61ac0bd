"""Every public name shows its public module; help(), reprs and docs never name a private one."""

from __future__ import annotations

import inspect
import pydoc
import types

import gradkit


def _public(module: types.ModuleType, seen: set[str]) -> list[tuple[str, object]]:
    names: list[tuple[str, object]] = []
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            if obj.__name__ not in seen:
                seen.add(obj.__name__)
                names.extend(_public(obj, seen))
        elif inspect.isclass(obj) or inspect.isfunction(obj):
            names.append((f"{module.__name__}.{name}", obj))
    return names


PUBLIC = _public(gradkit, {"gradkit"})


def test_the_walk_reaches_every_package() -> None:
    reached = {path.rsplit(".", 1)[0] for path, _ in PUBLIC}
    for package in ("accumulate", "curvature", "func", "hyper", "optim", "per_example", "testing"):
        assert f"gradkit.{package}" in reached
    assert len(PUBLIC) > 80


def test_every_public_name_has_its_public_module() -> None:
    wrong = [
        f"{path}: {obj.__module__}"  # type: ignore[attr-defined]
        for path, obj in PUBLIC
        if obj.__module__ != path.rsplit(".", 1)[0]  # type: ignore[attr-defined]
    ]
    assert not wrong, wrong


def test_help_names_the_public_module() -> None:
    text = pydoc.render_doc(gradkit.accumulate.Accumulator, renderer=pydoc.plaintext)
    assert "gradkit.accumulate" in text
    # the class's own header (Python 3.12's pydoc also names each method's defining module)
    header = text.split("Methods defined here")[0]
    assert "gradkit.accumulate._" not in header
    for path, obj in PUBLIC:
        assert pydoc.locate(path) is obj, path

"""The tests themselves run on the device under test, not only on the CPU.

With ``GRADKIT_TEST_DEVICE=cuda`` every test body runs under ``with torch.device("cuda")``, so
what a test creates lands on the GPU. Three things written in a test escape that and fail there
(or test the CPU instead) although the CPU run passes, so a static walk over ``tests/`` stands
in for the GPU run on every machine:

* ``torch.Generator()`` is a CPU generator, which a draw on another default device refuses:
  name the device, ``torch.Generator(torch.get_default_device())``;
* a tensor, module or generator built at import time (module level, a class body, a decorator's
  or a default argument's value) is built before the test's device applies: it is a CPU one
  mixed with the test's; build it in a function, a fixture or a lambda called by the test;
* ``torch.autocast("cpu", ...)`` casts nothing on another device: use the ``device`` fixture's
  ``device.type``.

Modules marked ``cpu_only`` (skipped on other devices) may do all but the first, and so may
tensors made on the ``meta`` device. The walk sees torch's names as the module imports them
(``nn``, ``F``, ``T = torch.tensor``), not tensors a helper function returns.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FACTORIES = {
    "arange",
    "as_tensor",
    "cat",
    "empty",
    "empty_like",
    "empty_strided",
    "eye",
    "from_numpy",
    "full",
    "full_like",
    "Generator",
    "linspace",
    "logspace",
    "normal",
    "ones",
    "ones_like",
    "rand",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "randperm",
    "scalar_tensor",
    "stack",
    "tensor",
    "zeros",
    "zeros_like",
}
AUTOCASTS = {"torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast"}


def _name(node: ast.expr) -> str:
    """``torch.nn.Linear`` for the expression ``torch.nn.Linear``; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _name(node.value)
        return f"{owner}.{node.attr}" if owner else ""
    return ""


class _Module:
    """One source file: its tree, and torch's names as it spells them (``nn`` for
    ``torch.nn``, ``T`` for ``torch.tensor`` after ``T = torch.tensor``)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tree = ast.parse(source)
        self.aliases: dict[str, str] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    self.aliases[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], self.resolve(node.value)
                if isinstance(target, ast.Name) and value.startswith("torch."):
                    self.aliases[target.id] = value

    def resolve(self, node: ast.expr) -> str:
        """The full dotted name of what ``node`` names (``torch.nn.Linear`` for
        ``nn.Linear``), or "" for an expression that is no name."""
        head, _, rest = _name(node).partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    @property
    def cpu_only(self) -> bool:
        """A module-level ``pytestmark`` that names ``cpu_only``."""
        for node in self.tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(_name(t) == "pytestmark" for t in targets):
                return "cpu_only" in (ast.get_source_segment(self.source, node) or "")
        return False

    def builds_on_a_device(self, call: ast.Call) -> bool:
        """A torch tensor factory, a generator or an ``nn`` call, not on the meta device."""
        name = self.resolve(call.func)
        owner, _, attr = name.rpartition(".")
        builds = name.startswith("torch.nn.") or (owner == "torch" and attr in FACTORIES)
        return builds and not _on_meta(call)

    def autocasts_the_cpu(self, call: ast.Call) -> bool:
        if self.resolve(call.func) not in AUTOCASTS:
            return False
        first = call.args[:1] + [k.value for k in call.keywords if k.arg == "device_type"]
        return any(isinstance(a, ast.Constant) and a.value == "cpu" for a in first)


def _on_meta(call: ast.Call) -> bool:
    return any(
        k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value == "meta"
        for k in call.keywords
    )


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)


def _import_time_calls(node: ast.AST) -> Iterator[ast.Call]:
    """The calls made when the module is imported: not those in function or lambda bodies."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = node.args
        evaluated: list[ast.expr] = [*args.defaults, *(d for d in args.kw_defaults if d)]
        if not isinstance(node, ast.Lambda):
            evaluated += node.decorator_list
        for expr in evaluated:
            yield from _import_time_calls(expr)
        return
    if isinstance(node, ast.Call):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _import_time_calls(child)


def problems(source: str, name: str = "<source>") -> list[str]:
    """``name:line: what`` for each thing in ``source`` that pins a test to the CPU."""
    module = _Module(source)
    calls = [node for node in ast.walk(module.tree) if isinstance(node, ast.Call)]
    found = [
        (call.lineno, "torch.Generator() is a CPU generator: name its device")
        for call in calls
        if module.resolve(call.func) == "torch.Generator" and not (call.args or call.keywords)
    ]
    if not module.cpu_only:
        for stmt in module.tree.body:
            if _is_main_guard(stmt):
                continue
            for call in _import_time_calls(stmt):
                if module.builds_on_a_device(call):
                    what = ast.unparse(call.func)
                    found.append((call.lineno, f"{what}(...) at import time, on the CPU"))
        found += [
            (call.lineno, "autocast on the CPU: use the device's type")
            for call in calls
            if module.autocasts_the_cpu(call)
        ]
    return [f"{name}:{line}: {what}" for line, what in sorted(found)]


def test_tests_build_their_tensors_on_the_device_under_test() -> None:
    paths = sorted(TESTS.rglob("*.py"))
    assert len(paths) > 50  # the walk finds the tests at all
    found = []
    for path in paths:
        found += problems(path.read_text(), path.relative_to(TESTS.parent).as_posix())
    assert not found, (
        "test code that pins tensors to the CPU, and fails (or tests the CPU) when "
        "GRADKIT_TEST_DEVICE names another device:\n" + "\n".join(found)
    )


def test_a_generator_without_a_device_is_found() -> None:
    source = "import torch\n\ndef test_it():\n    g = torch.Generator()\n"
    assert problems(source) == ["<source>:4: torch.Generator() is a CPU generator: name its device"]
    assert not problems(source.replace("Generator()", "Generator(torch.get_default_device())"))
    cpu_only = "import pytest\n\npytestmark = pytest.mark.cpu_only\n" + source
    assert problems(cpu_only) == [
        "<source>:7: torch.Generator() is a CPU generator: name its device"
    ]


def test_tensors_and_modules_built_at_import_time_are_found() -> None:
    source = """\
import pytest
import torch
import torch.nn.functional as F
from torch import nn

X = torch.randn(3)
META = (torch.zeros(3, device="meta"), nn.Linear(2, 2, device="meta"))
LINEAR = lambda: nn.Linear(2, 2)
T = torch.tensor
PAIR = (T([0, 1]), F.relu)

class Case:
    weight = torch.nn.Parameter(torch.ones(2))

    def make(self):
        return torch.ones(2)

@pytest.mark.parametrize("t", [torch.tensor(1.0)])
def test_it(t, w=torch.eye(2), *, g=torch.Generator("cpu")):
    return torch.arange(3) + T(1)

if __name__ == "__main__":
    torch.ones(1)
"""
    assert [p.split(": ", 1)[0] for p in problems(source)] == [
        "<source>:6",  # module level
        "<source>:10",  # an alias of a factory
        "<source>:13",  # a class body: the parameter and the tensor in it
        "<source>:13",
        "<source>:18",  # a decorator
        "<source>:19",  # argument defaults
        "<source>:19",
    ]
    cpu_only = "import pytest\n\npytestmark = pytest.mark.cpu_only\n" + source
    assert not problems(cpu_only)


def test_autocast_on_the_cpu_is_found() -> None:
    source = """\
import torch

def test_it(device):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pass
    with torch.amp.autocast(device_type="cpu"):
        pass
    with torch.autocast(device.type, dtype=torch.bfloat16):
        pass
"""
    assert [p.split(": ", 1)[0] for p in problems(source)] == ["<source>:4", "<source>:6"]
    assert not problems("import pytest\npytestmark = [pytest.mark.cpu_only]\n" + source)

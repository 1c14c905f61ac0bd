"""Tensors a function uses without taking them as arguments, for :func:`custom_gradient`.

Two halves:

* before the call, :class:`CaptureCache` lists candidates: tensors requiring grad in the
  function's closure, in the globals its code names, in the ``self`` of a bound method, in
  ``functools.partial`` arguments, the parameters of modules found there (a few levels deep),
  tensors nested in list or dict arguments, and every tensor seen used before;
* during the forward, :class:`Recorder` (a ``TorchFunctionMode``) records the tensors requiring
  grad that reach a torch function. The forward of an ``autograd.Function`` runs without grad,
  so those are exactly the captured tensors (or views of them, mapped to their base).
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from gradkit._errors import describe

__all__ = ["CaptureCache", "Recorder", "label"]

_DEPTH = 3
_MAX_ITEMS = 256


def label(t: torch.Tensor) -> str:
    """A tensor in a message: its kind, shape and dtype."""
    kind = "Parameter" if isinstance(t, nn.Parameter) else "Tensor"
    return (
        f"{kind}(shape={tuple(t.shape)}, dtype={t.dtype})" if kind == "Parameter" else describe(t)
    )


def _root(t: torch.Tensor) -> torch.Tensor:
    while t._base is not None:
        t = t._base
    return t


class Recorder(TorchFunctionMode):
    """Records, in order of first use, the tensors requiring grad passed to torch functions,
    other than ``exclude`` (ids of the arguments) and views of them."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self._exclude = exclude
        self._seen: dict[int, torch.Tensor] = {}

    @property
    def used(self) -> list[torch.Tensor]:
        return list(self._seen.values())

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                root = _root(t)
                if id(t) not in self._exclude and id(root) not in self._exclude:
                    self._seen.setdefault(id(root), root)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):  # made inside the function (torch.ones(..., requires_grad=True))
            if isinstance(t, torch.Tensor) and id(_root(t)) not in self._seen:
                self._exclude.add(id(t))
        return out


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


class _Scan:
    """Candidates by id with a name for messages (``lin.weight``, ``W``, ``args[0][1]``)."""

    def __init__(self) -> None:
        self.found: dict[int, tuple[str, torch.Tensor]] = {}
        self._seen: set[int] = set()

    def visit(self, obj: Any, name: str, depth: int) -> None:
        if id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                self.found.setdefault(id(obj), (name, obj))
            return
        if isinstance(obj, nn.Module):
            for n, p in obj.named_parameters():
                self.visit(p, f"{name}.{n}", 0)
            return
        if depth <= 0:
            return
        if isinstance(obj, (list, tuple)) and len(obj) <= _MAX_ITEMS:
            for i, item in enumerate(obj):
                self.visit(item, f"{name}[{i}]", depth - 1)
        elif isinstance(obj, dict) and len(obj) <= _MAX_ITEMS:
            for key, item in obj.items():
                self.visit(item, f"{name}[{key!r}]", depth - 1)
        elif isinstance(obj, types.MethodType):
            self.visit(obj.__self__, "self", depth - 1)
            self.visit(obj.__func__, name, depth)
        elif isinstance(obj, functools.partial):
            self.visit(obj.func, name, depth - 1)
            self.visit(list(obj.args), f"{name}.args", depth - 1)
            self.visit(dict(obj.keywords), f"{name}.keywords", depth - 1)
        elif isinstance(obj, types.FunctionType):
            self._function(obj, depth)

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        code = fn.__code__
        for var, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            self.visit(value, var, depth - 1)
        for var in dict.fromkeys(_code_names(code)):
            if var in fn.__globals__:
                value = fn.__globals__[var]
                if not isinstance(value, types.ModuleType):
                    self.visit(value, var, depth - 1)
        for i, default in enumerate(fn.__defaults__ or ()):
            self.visit(default, f"default {i}", depth - 1)


class CaptureCache:
    """The candidates for captured tensors of one decorated function, and the tensors its
    forward was seen to use (remembered by weak reference)."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self._f = f
        self._seen: list[weakref.ref[torch.Tensor]] = []

    def remember(self, tensors: list[torch.Tensor]) -> None:
        self._seen = [r for r in self._seen if r() is not None]
        known = {id(r()) for r in self._seen}
        self._seen += [weakref.ref(t) for t in tensors if id(t) not in known]

    def candidates(self, args: tuple[Any, ...]) -> tuple[list[torch.Tensor], dict[int, str]]:
        """Tensors requiring grad that ``f`` may use besides its tensor arguments, and their
        names."""
        scan = _Scan()
        scan.visit(self._f, getattr(self._f, "__name__", "f"), _DEPTH + 1)
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                scan.visit(a, f"argument {i}", _DEPTH)
        for r in self._seen:
            t = r()
            if t is not None and t.requires_grad:
                scan.found.setdefault(id(t), (label(t), t))
        own = {id(a) for a in args if isinstance(a, torch.Tensor)}
        kept = [(n, t) for key, (n, t) in scan.found.items() if key not in own]
        return [t for _, t in kept], {id(t): n for n, t in kept}

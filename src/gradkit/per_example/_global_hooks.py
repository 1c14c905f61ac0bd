"""Forward hooks registered for every module (``torch.nn.modules.module.
register_module_forward_hook``), watched while a ``track`` block is open.

Such a hook runs before each module's own forward hooks, so before the tracker's: one that
returns a replaced output hands the tracker the replacement, while a layer's rule reads the
gradient of the layer's own output (a global hook returning ``2 * output`` left the Linear
rule's second moment 3.7 off, silently). While a block is open, each global forward hook is
wrapped (:class:`Watched`, under its own id, so that its handle still removes it): a replaced
output of a layer that a rule reads is refused, by name; hooks that return None (observers
such as ``torch.utils.module_tracker.ModuleTracker``) run as they are. The fallback re-runs a
module with every hook, so it reads the output they leave and is not refused. Hooks are
unwrapped when no block is open any more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as _module

from gradkit._errors import GradkitError, message

__all__ = ["Watched", "unwatch", "watch"]


class Watched:
    """A global forward hook that refuses to replace the output of a layer that a rule reads
    (``reader(module)``: its label, or None)."""

    __slots__ = ("hook", "reader")

    def __init__(self, hook: Callable[..., Any], reader: Callable[[nn.Module], str | None]):
        self.hook = hook
        self.reader = reader

    def __call__(self, module: nn.Module, *rest: Any) -> Any:
        result = self.hook(module, *rest)
        if result is not None and result is not rest[-1]:
            label = self.reader(module)
            if label is not None:
                name = getattr(self.hook, "__qualname__", repr(self.hook))
                raise GradkitError(
                    message(
                        "per_example.track(model, ...)",
                        f"the output of {label}",
                        "the layer's own output, which its per-example rule differentiates",
                        f"an output replaced by the global forward hook {name} "
                        "(register_module_forward_hook), which runs before the tracker's",
                        "return None from that hook while tracking, or register it on the "
                        "module (module.register_forward_hook) before the track block: such a "
                        "hook runs after the tracker's",
                    )
                )
        return result


def watch(reader: Callable[[nn.Module], str | None]) -> None:
    """Wrap every global forward hook not yet wrapped (a no-op without any)."""
    hooks = _module._global_forward_hooks
    for key, hook in list(hooks.items()):
        if not isinstance(hook, Watched):
            hooks[key] = Watched(hook, reader)


def unwatch() -> None:
    """Give every wrapped global forward hook back as it was registered."""
    hooks = _module._global_forward_hooks
    for key, hook in list(hooks.items()):
        if isinstance(hook, Watched):
            hooks[key] = hook.hook

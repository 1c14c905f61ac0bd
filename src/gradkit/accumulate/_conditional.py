"""TensorFlow's ConditionalAccumulator semantics, with the traps fixed (to be written)."""

from __future__ import annotations

__all__: list[str] = []

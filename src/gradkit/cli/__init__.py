"""The ``gradkit`` command line."""

from gradkit.cli._main import main

__all__ = ["main"]

"""A griffe extension for the documentation site (`make docs`): gradkit's docstrings are Google
style with a few reStructuredText constructs (``:func:`x```, ``:math:`x```, ``.. math::``),
which mkdocstrings would show as raw text. This rewrites them into the Markdown the site
renders, when griffe loads the docstrings; the source is untouched.

* ``:func:`~gradkit.func.jacobian``` (any role naming an object) -> ```jacobian```; without the
  ``~``, the full name; ``:class:`text <target>``` -> ```text```.
* ``:math:`x``` -> ``$x$`` and a ``.. math::`` directive (its text on the same line and/or the
  indented lines below) -> a ``$$ ... $$`` block; pymdownx.arithmatex and MathJax typeset both.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc|const):`([^`]+)`")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_MATH_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<rest>.*)$")


def _name(text: str) -> str:
    """The text a role shows: ``title <target>`` -> title, ``~a.b.c`` -> c, ``!x`` -> x."""
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
    if titled:
        return titled.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text.lstrip(".")


def _math_blocks(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH_DIRECTIVE.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        body = [match.group("rest").strip()] if match.group("rest").strip() else []
        i += 1
        # the directive's content: the lines below indented deeper than it (blank lines inside)
        end = i
        while end < len(lines) and (
            not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > len(indent)
        ):
            end += 1
        while end > i and not lines[end - 1].strip():
            end -= 1
        body += [line.strip() for line in lines[i:end] if line.strip()]
        i = end
        if out and out[-1].strip():
            out.append("")
        out.extend([f"{indent}$$", *(f"{indent}{b}" for b in body if b), f"{indent}$$"])
        if i < len(lines) and lines[i].strip():
            out.append("")
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    """Rewrite the reStructuredText constructs of a docstring into Markdown.

    Examples:
        >>> rst_to_markdown("See :func:`~gradkit.func.jacobian` and :math:`\\\\mu`.")
        'See `jacobian` and $\\\\mu$.'
        >>> print(rst_to_markdown("Text:\\n\\n.. math:: a = b\\n\\nMore."))
        Text:
        <BLANKLINE>
        $$
        a = b
        $$
        <BLANKLINE>
        More.
    """
    text = _MATH_ROLE.sub(lambda m: f"${m.group(1).strip()}$", text)
    text = _ROLE.sub(lambda m: f"`{_name(m.group(1))}`", text)
    return _math_blocks(text)


class RstToMarkdown(Extension):
    """Rewrite every loaded docstring with :func:`rst_to_markdown`."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)

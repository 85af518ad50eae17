"""Google-style docstring parsing: the summary and the description of each argument.

Tool schemas need exactly two things from a docstring, the text before the first section and one
description per argument, so this is a small parser rather than a dependency. transformers ships one too
(`parse_google_format_docstring`), but its argument splitting changed between the releases we support
(5.17 reads `x (int): ...` and a continuation line such as `Example: ...` as new arguments), and a tool's
schema must not depend on the installed transformers.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

# Section headers that end the summary; "Args" and its synonyms open the argument block.
_ARGS_HEADERS = {"args", "arguments", "parameters", "params"}
_SECTION_RE = re.compile(r"^(\w[\w ]*):\s*$")
# "name: text", "name (type): text", "*args: text", "**kwargs (dict): text"
_ARG_RE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^()]*\))?\s*:(.*)$")


@dataclass(frozen=True)
class Docstring:
    """The parts of a Google-style docstring a tool schema uses."""

    summary: str
    args: dict[str, str] = field(default_factory=dict)
    returns: str | None = None


def parse_docstring(doc: str | None) -> Docstring:
    """Parse a Google-style docstring.

    The summary is everything before the first section header (blank lines folded into spaces).
    An argument's description may continue on following lines indented deeper than its name.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    returns: list[str] = []
    section: str | None = None
    arg_indent: int | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION_RE.match(line)
        if header and indent == 0:
            section = header.group(1).strip().lower()
            arg_indent = current = None
            continue
        if section is None:
            summary.append(stripped)
        elif section in _ARGS_HEADERS and stripped:
            arg = _ARG_RE.match(stripped)
            if arg and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = arg.group(1)
                args[current] = arg.group(2).strip()
            elif current is not None:
                args[current] = f"{args[current]} {stripped}".strip()
        elif section in {"returns", "return", "yields"} and stripped:
            returns.append(stripped)
    return Docstring(
        summary=" ".join(" ".join(summary).split()),
        args=args,
        returns=" ".join(returns) or None,
    )

"""What a parser makes of a model's reply, and the interface every model family's parser implements.

A reply is the text a model generated for one assistant turn. Its parser, chosen by model family (see
`tools.parsers.detect`), splits it into the assistant message a chat template renders back:

    ParsedMessage(content, reasoning, tool_calls, errors)

A tool call the parser cannot read is never dropped silently: its text stays in `content`, a `ParseError`
(family, kind, message) says what was wrong, the rollout loop counts it (`ToolStats.record_parse_errors`)
and, by default, sends the model `parser.error_message(parsed)`, a tool-role message it can act on.

Formats that carry every argument as a string (the XML families) type each value from the tool's JSON
schema with `typed_value`, which reuses the executor's safe coercions (`tools.validation.coerce`).

The rollout loop talks to a parser through `parse()` and `error_message()`; nothing here knows about
tokens, chat templates or the trainer.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tools.calls import ToolCall
from tools.errors import ToolError
from tools.schema import Tool
from tools.validation import coerce

# How much of the offending text a ParseError keeps: enough for the model to recognise its call.
_SNIPPET_CHARS = 200


class ParseErrorKind(enum.StrEnum):
    """Why a tool call could not be read."""

    BAD_JSON = "bad_json"  # the call's JSON does not parse
    BAD_ARGUMENTS = "bad_arguments"  # the arguments are not an object of named values (or repeat a name)
    MISSING_NAME = "missing_name"  # the call names no function
    UNCLOSED_TAG = "unclosed_tag"  # a call opened and never closed in a reply that ended normally
    TRUNCATED = "truncated"  # the reply hit the token limit inside a call


@dataclass(frozen=True)
class ParseError:
    """One tool call that could not be read.

    Attributes:
        family: The parser family that read the reply (`qwen`, `qwen_xml`, `llama`, `mistral`, `glm`).
        kind: What went wrong.
        message: What is wrong, in words the model can act on.
        text: The start of the offending text, as the model wrote it.
    """

    family: str
    kind: ParseErrorKind
    message: str
    text: str = ""


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant reply split into what a chat template renders.

    Attributes:
        content: The visible text, with the text of every unreadable call kept in place.
        reasoning: The thinking part (`<think>...</think>`), or None when the reply has none.
        tool_calls: The calls that were read, in the order written; arguments are dicts.
        errors: One entry per call that could not be read.
        truncated: Whether the reply was cut by the token limit.
    """

    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = ()
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """Whether every tool call in the reply was read."""
        return not self.errors

    def to_message(self) -> dict[str, Any]:
        """The assistant message in the OpenAI-style form chat templates read.

        `reasoning_content` is set only when the reply has reasoning, and `tool_calls` only when it calls
        tools: some templates test for the key's presence (Llama 3.1 renders any message with a
        `tool_calls` key as a call, and refuses an empty list).
        """
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        return message


class UnknownToolCallFormat(ToolError, LookupError):
    """No tool-call parser fits: the chat template shows no known family's markers, or the family named in
    the configuration does not exist."""


class ToolCallParser(ABC):
    """Reads one model family's tool-call format.

    Subclasses set `family`, `stop_markers` (end-of-turn text a decoded reply may end with) and
    `call_format` (one call written in the family's format, shown to the model after a parse error), and
    implement `_parse_calls`. Parsers are stateless and safe to share between rollouts.

    Example:
        >>> parser = get_parser("qwen")
        >>> parsed = parser.parse(text, tools=toolset, truncated=not finished)
        >>> stats.record_parse_errors(parsed.errors)
        >>> if parsed.errors:
        ...     messages.append(parser.error_message(parsed))

    Args:
        reasoning: Split a `<think>...</think>` block off the reply into `reasoning`. A reply with only a
            closing `</think>` (the template opened the block in the prompt) is reasoning up to that tag.
    """

    family: ClassVar[str]
    stop_markers: ClassVar[tuple[str, ...]] = ()
    call_format: ClassVar[str]

    def __init__(self, *, reasoning: bool = False):
        self.reasoning = reasoning

    def parse(
        self, text: str, *, tools: Mapping[str, Tool] | None = None, truncated: bool = False
    ) -> ParsedMessage:
        """Split a reply into content, reasoning and tool calls.

        Args:
            text: The decoded reply, with or without its end-of-turn token.
            tools: The rollout's tools by name (a `Toolset`), to type string-valued arguments from their
                schemas; None leaves such values as strings.
            truncated: Whether generation stopped at the token limit rather than at an end-of-turn token;
                an unfinished call is then reported as `truncated` rather than `unclosed_tag`.
        """
        text = self._strip_stop_markers(text)
        reasoning = None
        if self.reasoning:
            reasoning, text = split_reasoning(text)
        content, calls, errors = self._parse_calls(text, tools or {}, truncated)
        calls = [
            call if call.id is not None else ToolCall(call.name, call.arguments, default_call_id(index))
            for index, call in enumerate(calls)
        ]
        # Only newlines are trimmed: templates put those around content, and spaces the model wrote are
        # kept so that the message re-renders as generated where the template allows it.
        return ParsedMessage(content.strip("\n"), reasoning, tuple(calls), tuple(errors), truncated)

    def error_message(
        self, parsed: ParsedMessage, *, role: str = "tool", tool_call_id: str | None = None
    ) -> dict[str, Any] | None:
        """The message telling the model which calls could not be read and how to write one; None when
        every call was read.

        Args:
            parsed: The reply as parsed.
            role: The message's role: a tool result by default; "user" for templates that accept tool
                messages only after a reply with calls (Mistral's check the turn order).
            tool_call_id: Id to answer, for templates that require one on every tool message (Mistral's
                need nine alphanumeric characters; `default_call_id` makes such ids).
        """
        if not parsed.errors:
            return None
        lines = ["Error: a tool call in your reply could not be read, so it was not run."]
        for error in parsed.errors:
            lines.append(f"- {error.message}")
            if error.text:
                lines.append(f"  The call began: {error.text}")
        lines.append(f"Write each tool call exactly like this:\n{self.call_format}")
        message: dict[str, Any] = {"role": role, "content": "\n".join(lines)}
        if tool_call_id is not None:
            message["tool_call_id"] = tool_call_id
        return message

    @abstractmethod
    def _parse_calls(
        self, text: str, tools: Mapping[str, Tool], truncated: bool
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        """Return the content (unreadable calls kept in it), the calls read, and the errors."""

    def _scan_tagged(
        self,
        text: str,
        truncated: bool,
        read: Callable[[str, str], list[ToolCall] | ParseError],
        tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
        closing_at: Callable[[str, int], int | None] | None = None,
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        """Walk the `<tool_call>...</tool_call>` blocks of a reply (the Qwen, Qwen-XML and GLM formats).

        `read(body, block)` turns one closed block into calls or an error; text outside the blocks, and every
        block that fails, becomes content. A block that never closes is `unclosed_tag`, or `truncated` when it
        runs to the end of a reply cut by the token limit. `closing_at(text, body_start)` may find where a
        well-formed body's closing tag is (a JSON body whose strings hold the tags, say); else the first
        closing tag ends the block.
        """
        opening, closing = tags
        scan = Scan()
        pos = 0
        while (start := text.find(opening, pos)) >= 0:
            scan.content.append(text[pos:start])
            body_start = start + len(opening)
            known = closing_at(text, body_start) if closing_at is not None else None
            end = known if known is not None else text.find(closing, body_start)
            reopened = text.find(opening, body_start) if known is None else -1
            if reopened >= 0 and (end < 0 or reopened < end):
                # Another call starts before this one closed: this one was left open.
                scan.content.append(text[start:reopened])
                scan.errors.append(
                    self._unfinished(f"a {opening} tag", text[start:reopened], truncated=False)
                )
                pos = reopened
                continue
            if end < 0:
                scan.content.append(text[start:])
                scan.errors.append(self._unfinished(f"a {opening} tag", text[start:], truncated))
                return scan.result()
            pos = end + len(closing)
            block = text[start:pos]
            outcome = read(text[body_start:end], block)
            if isinstance(outcome, ParseError):
                scan.content.append(block)
                scan.errors.append(outcome)
            else:
                scan.calls.extend(outcome)
        scan.content.append(text[pos:])
        return scan.result()

    def _error(self, kind: ParseErrorKind, message: str, text: str = "") -> ParseError:
        return ParseError(self.family, kind, message, snippet(text))

    def _unfinished(self, what: str, text: str, truncated: bool) -> ParseError:
        """The error for a call that never closed: cut by the token limit, or simply left open."""
        if truncated:
            return self._error(
                ParseErrorKind.TRUNCATED,
                f"the reply reached the token limit inside {what}; write shorter calls",
                text,
            )
        return self._error(ParseErrorKind.UNCLOSED_TAG, f"{what} was opened but never closed", text)

    def _strip_stop_markers(self, text: str) -> str:
        stripped = True
        while stripped:
            stripped = False
            for marker in self.stop_markers:
                if text.endswith(marker):
                    text = text[: -len(marker)]
                    stripped = True
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reasoning={self.reasoning})"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split `<think>reasoning</think>rest` into (reasoning, rest); (None, text) when there is none.

    A reply that closes `</think>` without opening it began inside a block the prompt opened (Qwen3.5,
    GLM-4.7): everything before the tag is reasoning. A reply that opens `<think>` and never closes it was
    cut while thinking: all of it is reasoning.
    """
    close = text.find("</think>")
    if close >= 0:
        start = text.find("<think>", 0, close)
        after = text[close + len("</think>") :]
        if start < 0:
            return text[:close].strip("\n"), after
        return text[start + len("<think>") : close].strip("\n"), text[:start] + after
    leading = text.lstrip()
    if leading.startswith("<think>"):
        return leading[len("<think>") :].strip("\n"), ""
    return None, text


def typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """Type an argument sent as text (XML formats) from its JSON schema; the text itself when no schema
    applies or no lossless reading fits.

    Strings stay as written; `null`/`None` becomes None where the schema allows null; numbers, booleans
    (either spelling, `true` or Python's `True`), arrays and objects are read with the executor's coercions.
    """
    if schema is None:
        return raw
    if raw.strip() in ("null", "None") and _allows_null(schema) and not _allows(schema, "string"):
        return None
    return coerce(raw, schema)


def default_call_id(index: int) -> str:
    """An id for the index-th call of a reply whose format carries none: nine alphanumeric characters
    (`call00000`), which every supported template accepts (Mistral's require exactly that)."""
    return f"call{index:05d}"


def snippet(text: str) -> str:
    """The start of `text`, cut to a length fit for an error message."""
    text = text.strip()
    return text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 3] + "..."


def parameter_schema(tools: Mapping[str, Tool], tool_name: str, parameter: str) -> Mapping[str, Any] | None:
    """The JSON schema of one parameter of one tool, or None when either is unknown."""
    tool = tools.get(tool_name)
    if tool is None:
        return None
    schema = tool.parameters.get("properties", {}).get(parameter)
    return schema if isinstance(schema, Mapping) else None


def _types(schema: Mapping[str, Any]) -> set[str]:
    kinds = schema.get("type")
    found = {kinds} if isinstance(kinds, str) else set(kinds or ())
    for option in schema.get("anyOf", ()):
        if isinstance(option, Mapping):
            found |= _types(option)
    return found


def _allows(schema: Mapping[str, Any], kind: str) -> bool:
    return kind in _types(schema)


def _allows_null(schema: Mapping[str, Any]) -> bool:
    return _allows(schema, "null")


@dataclass
class Scan:
    """Accumulates a parser's output while it walks a reply."""

    content: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)

    def result(self) -> tuple[str, list[ToolCall], list[ParseError]]:
        return "".join(self.content), self.calls, self.errors

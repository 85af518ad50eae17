"""The start-up check of a chat template: does rendering a growing conversation keep its earlier tokens?

A rollout's prompt at turn k+1 is the prompt of turn k, the tokens generated at turn k, and the new
messages. Rendering it incrementally (appending only what the new messages add) is right only when the
template is prefix-preserving at the points where a rollout grows, which `check_template` tests on a probe
conversation (system, user, assistant turns with reasoning and parallel tool calls, tool results, a second
user message) under the run's chat_template_kwargs (with thinking turned off, the replies carry no
reasoning, as the model's would not):

    generation prompt   render(msgs[:k], gen prompt) is a prefix of render(msgs[:k+1]) for every assistant
                        message k: the reply continues the prompt it was generated from
    appending           render(msgs[:k+1]) is a prefix of render(msgs[:j], gen prompt) for every later j:
                        whatever follows a reply never re-renders it or anything before it
    window              rendering just the head (messages up to the last user message), the reply and the
                        new messages gives the same new text as rendering everything; then a turn costs
                        the size of what it adds, not of the whole conversation

The first two must hold for the text; appending must also hold for the tokens (a later turn never changes
earlier ones). At the generation prompt only the text must continue: a reply's ids are kept as sampled,
and where a fresh tokenization of prompt and reply would differ (an empty think block after a prompt that
ends in "<think>\\n": "\\n" + "\\n" against "\\n\\n") that is a note, and the renderer's drift check
counts it. Where a template cannot render parallel calls (Llama 3.1 accepts one call per message) a probe
with single calls is used. The check also measures `close`, the text the template puts after an assistant
message's content (`<|im_end|>\\n` for Qwen), with which the renderer closes a reply the template would
write differently.

`ChatRenderer` runs this once at start-up; `check_agreement` compares a training template with the
original on the turn being generated, before the renderer swaps one in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RenderText = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool], str]
Tokenize = Callable[[str], list[int]]

PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city."},
                    "days": {"type": "integer", "description": "How many days ahead."},
                },
                "required": ["city"],
            },
        },
    }
]

_SENTINEL = "PROBEREPLYTEXT"


@dataclass(frozen=True)
class TemplateCheck:
    """What the start-up check found.

    Attributes:
        preserving: Prefix-preserving at every point a rollout grows: a reply's text continues its prompt,
            and nothing that follows a reply changes its text or tokens, or anything before it.
        window: Rendering a window (head, reply, new messages) gives the same new text as a full render.
        close: The text the template renders after an assistant message's content.
        failures: One line per failed comparison, naming the message and the first differing text.
        notes: Findings that do not stop incremental rendering: a reply whose tokens differ from a fresh
            tokenization of its prompt plus its text (an empty think block after a prompt that ends in
            `<think>\\n`: "\\n" + "\\n" against "\\n\\n"), and where the window differs.
    """

    preserving: bool
    window: bool
    close: str
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def probe_conversation(*, parallel_calls: bool = True, reasoning: bool = True) -> list[dict[str, Any]]:
    """The conversation the check renders: two user queries, tool calls and their results, and reasoning
    on every reply (none when `reasoning` is False, as when the generation prompt closes the think block)."""

    def call(index: int, arguments: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"call{index:05d}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }

    def result(index: int, content: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"call{index:05d}", "name": "get_weather", "content": content}

    def reply(content: str, thought: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
        return message

    first_calls = [call(0, {"city": "Paris"}), call(1, {"city": "Rome"})]
    first_results = [result(0, "Sunny, 24 C."), result(1, "Rain, 17 C.")]
    if not parallel_calls:
        first_calls, first_results = first_calls[:1], first_results[:1]
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is the weather in Paris and Rome?"},
        reply("Let me look that up.", "I should call the weather tool.", first_calls),
        *first_results,
        reply("Paris is sunny; Rome is rainy.", ""),
        {"role": "user", "content": "And in Oslo the day after tomorrow?"},
        reply("", "One more call.", [call(2, {"city": "Oslo", "days": 2})]),
        result(2, "Snow, -3 C."),
        reply("It will snow in Oslo.", "Done."),
    ]


def check_template(render_text: RenderText, tokenize: Tokenize) -> TemplateCheck:
    """Check a template (through `render_text(messages, tools, add_generation_prompt)`) on the probe."""
    probe, error = _renderable_probe(render_text)
    if probe is None:
        failure = f"the template cannot render the probe conversation: {error}"
        return TemplateCheck(False, False, "", (failure,))
    failures: list[str] = []
    notes: list[str] = []
    window_ok = True
    cache: dict[tuple[int, bool], str] = {}

    def full(end: int, generation: bool) -> str:
        if (end, generation) not in cache:
            cache[end, generation] = render_text(probe[:end], PROBE_TOOLS, generation)
        return cache[end, generation]

    for k in _assistant_indexes(probe):
        prompt, replied = full(k, True), full(k + 1, False)
        if not replied.startswith(prompt):
            failures.append(
                f"the reply at message {k} does not continue its prompt: {_diff(prompt, replied)}"
            )
            continue
        if (token_at := _token_difference(prompt, replied, tokenize)) is not None:
            notes.append(f"the reply at message {k} re-tokenizes its prompt's end (token {token_at})")
        for j in range(k + 2, len(probe) + 1):
            if probe[j - 1]["role"] == "assistant":
                continue
            later = full(j, True)
            if not later.startswith(replied):
                failures.append(
                    f"message {k} (a reply) changes once {j} messages follow: {_diff(replied, later)}"
                )
                continue
            if (token_at := _token_difference(replied, later, tokenize)) is not None:
                failures.append(
                    f"message {k} (a reply) changes tokens once {j} messages follow (token {token_at})"
                )
            if any(m["role"] == "assistant" for m in probe[k + 1 : j]):
                continue
            head = probe[: head_end(probe, k)]
            head_text = render_text(head, PROBE_TOOLS, True)
            windowed = render_text([*head, *probe[k:j]], PROBE_TOOLS, True)
            expected = later[len(prompt) :]
            added = windowed[len(head_text) :] if windowed.startswith(head_text) else windowed
            if added != expected:
                window_ok = False
                notes.append(
                    f"window: messages {k}..{j - 1} after the head render as {_diff(expected, added)}"
                )
    preserving = not failures
    close = _close_text(render_text, probe)
    return TemplateCheck(preserving, preserving and window_ok, close, tuple(failures), tuple(notes))


def check_agreement(original: RenderText, training: RenderText) -> list[str]:
    """Where a training template renders the turn being generated differently from the original.

    Compared on the probe: the first prompt, each assistant reply rendered as the last message, and the
    messages that follow a reply. Earlier turns are not compared: that is where a training template may
    (and is meant to) differ. An empty list means the model sees the same prompt format as with its own
    template.
    """
    probe, error = _renderable_probe(original)
    if probe is None:
        return [f"the original template cannot render the probe conversation: {error}"]
    differences: list[str] = []
    first_user = next(i for i, m in enumerate(probe) if m["role"] == "user")
    prompts = [render(probe[: first_user + 1], PROBE_TOOLS, True) for render in (original, training)]
    if prompts[0] != prompts[1]:
        differences.append(f"the first prompt: {_diff(*prompts)}")
    for k in _assistant_indexes(probe):
        for template_name, render in (("original", original), ("training", training)):
            if not render(probe[: k + 1], PROBE_TOOLS, False).startswith(
                render(probe[:k], PROBE_TOOLS, True)
            ):
                differences.append(f"the {template_name} template's reply at message {k} breaks its prompt")
        if differences:
            return differences
        replies = [
            r(probe[: k + 1], PROBE_TOOLS, False)[len(r(probe[:k], PROBE_TOOLS, True)) :]
            for r in (original, training)
        ]
        if replies[0] != replies[1]:
            differences.append(f"the reply at message {k}: {_diff(*replies)}")
        end = next((j for j in range(k + 1, len(probe)) if probe[j]["role"] == "assistant"), len(probe))
        followers = []
        for render in (original, training):
            replied, later = (
                render(probe[: k + 1], PROBE_TOOLS, False),
                render(probe[:end], PROBE_TOOLS, True),
            )
            followers.append(later[len(replied) :] if later.startswith(replied) else None)
        first, second = followers
        if first is not None and second is not None and first != second:
            differences.append(f"the messages after message {k}: {_diff(first, second)}")
    return differences


def head_end(messages: Sequence[Mapping[str, Any]], reply_index: int) -> int:
    """End of the head a window keeps: through the last user message before the reply (all before it
    when there is none). The head carries what templates read from the start of a conversation: the
    system message, the tools, and the user query that reasoning and tool results are placed after."""
    for index in range(reply_index - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index + 1
    return reply_index


# --- internals ----------------------------------------------------------------------------------------


def _renderable_probe(render_text: RenderText) -> tuple[list[dict[str, Any]] | None, str]:
    """The probe in the richest form the template renders: parallel calls if it can, reasoning unless
    its generation prompt already closes the think block (thinking turned off)."""
    error = ""
    for parallel in (True, False):
        probe = probe_conversation(parallel_calls=parallel)
        try:
            start = probe[:2]
            generation = render_text(start, PROBE_TOOLS, True)[len(render_text(start, PROBE_TOOLS, False)) :]
            if "</think>" in generation:
                probe = probe_conversation(parallel_calls=parallel, reasoning=False)
            render_text(probe, PROBE_TOOLS, False)
        except Exception as exc:  # any template error: try the simpler probe, then report it
            error = f"{type(exc).__name__}: {exc}"
            continue
        return probe, ""
    return None, error


def _assistant_indexes(messages: Sequence[dict[str, Any]]) -> list[int]:
    return [index for index, message in enumerate(messages) if message["role"] == "assistant"]


def _token_difference(before: str, after: str, tokenize: Tokenize) -> int | None:
    """Where the tokens of `after` stop extending those of `before` (its text prefix); None if they do."""
    before_ids, after_ids = tokenize(before), tokenize(after)
    if after_ids[: len(before_ids)] == before_ids:
        return None
    same = (i for i, (a, b) in enumerate(zip(before_ids, after_ids, strict=False)) if a != b)
    return next(same, min(len(before_ids), len(after_ids)))


def _diff(a: str, b: str) -> str:
    """The first place two texts differ, with some context."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at character {at}: {a[max(0, at - 30) : at + 30]!r} became {b[max(0, at - 30) : at + 30]!r}"


def _close_text(render_text: RenderText, probe: list[dict[str, Any]]) -> str:
    head = probe[: head_end(probe, 2)]
    text = render_text([*head, {"role": "assistant", "content": _SENTINEL}], PROBE_TOOLS, False)
    at = text.rfind(_SENTINEL)
    return text[at + len(_SENTINEL) :] if at >= 0 else ""

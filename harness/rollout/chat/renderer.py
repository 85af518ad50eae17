"""Rendering a rollout's conversation to prompt token ids, incrementally where the template allows it.

`ChatRenderer` holds one model's chat template, its chat_template_kwargs and its tool-call parser; the
rollout loop builds one per run and asks it for a `Conversation` per rollout:

    renderer = ChatRenderer(tokenizer, chat_template_kwargs=config.chat_template_kwargs)
    conversation = renderer.start(prompt_messages, tools=toolset)
    while True:
        prompt_ids = conversation.prompt_ids()                     # what to send this turn
        turn = await generate_one_turn(prompt_ids)                 # TurnRecord
        parsed = renderer.parse(turn.output_ids, tools=toolset)
        conversation.add_reply(turn.output_ids, parsed.to_message())
        if not parsed.tool_calls and parsed.ok:
            break
        results = await executor.run(parsed.tool_calls, toolset)
        conversation.add_messages([tool_message(r) for r in results])
        if parsed.errors:
            conversation.add_messages([renderer.parser.error_message(parsed)])

At start-up the template is checked (`check.check_template`). When it is prefix-preserving, prompts are
built incrementally: the generated ids are kept exactly as sampled, and each turn tokenizes only the text
the template adds after the reply (the rest of the reply's closing, the new messages, the generation
prompt). When the template also passes the window check, that text is rendered from a window (the
messages up to the last user message, the reply, the new messages), so a turn costs what it adds rather
than the whole conversation. A `check_fraction` of incremental prompts is also rendered in full; any
difference is drift, counted in `stats`.

The generated ids stay as sampled whatever they are. When the template's rendering of the parsed reply
starts with the reply's text, the prompt continues with the rest of that rendering (for a reply cut by the
token limit: the closing of its think block and of the message). When it does not (whitespace the parser
normalised, a call laid out differently), the reply is closed as the template closes a message
(`TemplateCheck.close`) and the new messages follow; such a prompt differs from a full render, which the
drift check measures, but never from what the model saw.

A template that is not prefix-preserving is replaced by a packaged training template where one fits
(`templates.training_template_for`); otherwise every prompt is rendered in full and reconciliation forks
the samples where the history changed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.rollout.chat.check import TemplateCheck, check_agreement, check_template, head_end
from harness.rollout.chat.templates import training_template_for
from harness.rollout.reconcile import common_prefix_length
from tools.parsers import (
    ParsedMessage,
    ToolCallParser,
    UnknownToolCallFormat,
    parser_for_template,
    split_reasoning,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tools.toolset import Toolset

log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The chat template is missing, or rendered a conversation in a way the renderer cannot use."""


@dataclass
class RenderStats:
    """Rendering metrics over a logging window (one event loop; not thread-safe).

    chat/render_s                 mean seconds to build one prompt
    chat/incremental_frac         prompts built incrementally / prompts
    chat/render_check_count       incremental prompts also rendered in full
    chat/render_drift_count       of those, prompts that differed from the full render
    chat/render_drift_tokens_max  the most tokens by which one differed (past the common prefix)
    chat/reply_rewrite_count      replies whose text the template renders differently (kept as sampled)
    """

    prompts: int = 0
    incremental_prompts: int = 0
    checks: int = 0
    drifted: int = 0
    drift_tokens_max: int = 0
    rewritten_replies: int = 0
    render_s: float = 0.0

    def summary(self) -> dict[str, float]:
        """The window's metrics (see the class docstring); call `reset()` to start the next window."""
        return {
            "chat/render_s": self.render_s / self.prompts if self.prompts else math.nan,
            "chat/incremental_frac": self.incremental_prompts / self.prompts if self.prompts else math.nan,
            "chat/render_check_count": self.checks,
            "chat/render_drift_count": self.drifted,
            "chat/render_drift_tokens_max": self.drift_tokens_max,
            "chat/reply_rewrite_count": self.rewritten_replies,
        }

    def reset(self) -> None:
        """Start a new window."""
        for stat in dataclasses.fields(self):
            setattr(self, stat.name, stat.default)


class ChatRenderer:
    """Renders conversations with one model's chat template; one per run, shared by its rollouts.

    Args:
        tokenizer: The model's tokenizer.
        chat_template: A template to use instead of the tokenizer's.
        chat_template_kwargs: Extra template variables (e.g. `{"enable_thinking": False}`).
        tool_call_format: The tool-call parser family (`qwen`, `qwen_xml`, `llama`, `mistral`, `glm`),
            overriding the one detected from the template's markers.
        training_template: Swap in a packaged training template when the template is not
            prefix-preserving and one fits the model.
        incremental: Build prompts incrementally when the template is proven prefix-preserving; False
            renders every prompt in full.
        window: Render an incremental prompt's new text from a window of the conversation when the template
            passes the window check; False renders the whole conversation's text (still tokenizing only
            the new part).
        check_fraction: Fraction of incremental prompts also rendered in full to measure drift (0 to 1).
        eos_token_ids: Ids that end a reply; by default the tokenizer's eos and the family's end-of-turn
            tokens.
        seed: Seed for choosing which prompts are checked.

    Attributes:
        template: The Jinja source in use (the given one, or a training template in its place).
        template_name: Which one, in words, as logged.
        check: What the start-up check found for it.
        incremental: Whether prompts are built incrementally (else rendered in full every turn).
        window: Whether incremental prompts render a window rather than the whole conversation's text.
        parser: The tool-call parser, or None when the template shows no known format.
        eos_token_ids: The ids that end a reply.
        stats: Rendering metrics of the current logging window.

    Raises:
        ChatTemplateError: No template, or `check_fraction` outside [0, 1].
        UnknownToolCallFormat: `tool_call_format` names no parser family.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tool_call_format: str | None = None,
        training_template: bool = True,
        incremental: bool = True,
        window: bool = True,
        check_fraction: float = 0.02,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
    ):
        if not 0.0 <= check_fraction <= 1.0:
            raise ChatTemplateError(f"check_fraction must be between 0 and 1, got {check_fraction}")
        original = chat_template if chat_template is not None else tokenizer.chat_template
        if not isinstance(original, str) or not original.strip():
            raise ChatTemplateError(
                "the tokenizer has no chat template; pass chat_template (a Jinja string) to render with"
            )
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.check_fraction = check_fraction
        self.stats = RenderStats()
        self._rng = random.Random(seed)
        self._reasoning = "</think>" in original
        if tool_call_format is not None:
            self.parser: ToolCallParser | None = parser_for_template(original, family=tool_call_format)
        else:
            try:
                self.parser = parser_for_template(original)
            except UnknownToolCallFormat:
                self.parser = None  # fine without tools; `start` refuses tools
        self.eos_token_ids = (
            frozenset(eos_token_ids) if eos_token_ids is not None else self._default_eos_ids()
        )

        given = "the given chat template" if chat_template is not None else "the tokenizer's chat template"
        self.template, self.template_name, self.check = self._choose_template(
            original, given, training_template
        )
        self.incremental = incremental and self.check.preserving
        self.window = window and self.incremental and self.check.window
        mode = ("incremental (window)" if self.window else "incremental") if self.incremental else "full"
        log.info(
            "chat template: %s (sha1 %s), prefix-preserving: %s, rendering: %s, tool calls: %s",
            self.template_name,
            hashlib.sha1(self.template.encode()).hexdigest()[:10],
            "yes" if self.check.preserving else "no",
            mode,
            self.parser.family if self.parser else "none",
        )

    # --- rendering ------------------------------------------------------------------------------------

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Toolset | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for a whole conversation."""
        return self._render_text(list(messages), _schemas(tools), add_generation_prompt)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Toolset | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The token ids of a whole conversation, rendered in full."""
        return self._tokenize(
            self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        )

    def start(self, messages: Sequence[Mapping[str, Any]], *, tools: Toolset | None = None) -> Conversation:
        """A rollout's conversation, starting from its prompt messages."""
        if tools and self.parser is None:
            raise UnknownToolCallFormat(
                f"the chat template ({self.template_name}) shows no known tool-call format, so replies "
                "cannot be parsed for tool calls; set tool_call_format to the model's family"
            )
        return Conversation(self, messages, tools)

    def parse(self, output_ids: Sequence[int], *, tools: Toolset | None = None) -> ParsedMessage:
        """Parse a reply's token ids into an assistant message (see `tools.parsers`).

        A reply that does not end with one of `eos_token_ids` was cut by the token limit (`truncated`).
        """
        finished = bool(output_ids) and output_ids[-1] in self.eos_token_ids
        text = self._decode(output_ids[:-1] if finished else output_ids)
        if self.parser is not None:
            return self.parser.parse(text, tools=tools, truncated=not finished)
        reasoning, content = split_reasoning(text) if self._reasoning else (None, text)
        return ParsedMessage(content.strip("\n"), reasoning, truncated=not finished)

    # --- internals ------------------------------------------------------------------------------------

    def _render_text(
        self,
        messages: list[dict[str, Any]] | list[Mapping[str, Any]],
        schemas: list[dict[str, Any]] | None,
        gen: bool,
    ) -> str:
        return self._apply(self.template, self.template_name, messages, schemas, gen)

    def _apply(
        self, template: str, name: str, messages: Sequence[Mapping[str, Any]], schemas: Any, gen: bool
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=schemas,
                chat_template=template,
                add_generation_prompt=gen,
                tokenize=False,
                **self.chat_template_kwargs,
            )
        except Exception as exc:  # jinja2 errors and the template's raise_exception: say which template
            raise ChatTemplateError(
                f"{name} failed on {len(messages)} messages: {type(exc).__name__}: {exc}"
            ) from exc

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _default_eos_ids(self) -> frozenset[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for marker in self.parser.stop_markers if self.parser else ():
            token_id = self.tokenizer.convert_tokens_to_ids(marker)
            if isinstance(token_id, int) and self.tokenizer.convert_ids_to_tokens(token_id) == marker:
                ids.add(token_id)
        return frozenset(ids)

    def _choose_template(
        self, original: str, name: str, allow_training: bool
    ) -> tuple[str, str, TemplateCheck]:
        check = self._check(original, name)
        if check.preserving:
            return original, name, check
        log.warning("%s is not prefix-preserving: %s", name, check.failures[0] if check.failures else "")
        training = training_template_for(original) if allow_training else None
        if training is not None:
            training_name = f"training template '{training.name}'"
            training_check = self._check(training.text, training_name)
            differences = check_agreement(
                functools.partial(self._apply, original, name),
                functools.partial(self._apply, training.text, training_name),
            )
            if training_check.preserving and not differences:
                log.info("using the %s in its place", training_name)
                return training.text, training_name, training_check
            log.warning(
                "the training template '%s' does not fit this model (%s); rendering every prompt in full",
                training.name,
                (differences or list(training_check.failures) or ["?"])[0],
            )
        else:
            log.warning("no training template fits it; rendering every prompt in full, forks will follow")
        return original, name, check

    def _check(self, template: str, name: str) -> TemplateCheck:
        return check_template(functools.partial(self._apply, template, name), self._tokenize)

    def _should_check(self) -> bool:
        return self.check_fraction > 0 and self._rng.random() < self.check_fraction


@dataclass(frozen=True)
class _Reply:
    """The last reply as generated: its decoded text (end token included) and the end token's text."""

    text: str
    stop_text: str


class Conversation:
    """One rollout's messages and the token ids of its prompts (see the module docstring for the loop).

    Messages added with `add_messages` are pending until the next `prompt_ids()`; `add_reply` records the
    reply generated from that prompt. The lists `prompt_ids()` returns are not modified afterwards, so a
    TurnRecord may keep them.
    """

    def __init__(self, renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], tools: Toolset | None):
        self._renderer = renderer
        self._schemas = _schemas(tools)
        self._messages: list[dict[str, Any]] = []  # through the last reply
        self._pending: list[dict[str, Any]] = [dict(message) for message in messages]
        self._held: list[int] = []  # the last prompt and the reply's ids, as sampled
        self._reply: _Reply | None = None
        self._prompt: list[int] | None = None
        self._prompt_text = ""  # the full text of the current prompt, when it was rendered whole
        self._reply_prompt_text = ""  # the same for the prompt the last reply was generated from
        self._head: tuple[int, str] | None = None  # (head length, its text with generation prompt)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Every message so far, pending ones included."""
        return [*self._messages, *self._pending]

    def add_messages(self, messages: Iterable[Mapping[str, Any]]) -> None:
        """Append messages (tool results, a user turn) for the next prompt."""
        self._pending.extend(dict(message) for message in messages)
        self._prompt = None

    def prompt_ids(self) -> list[int]:
        """The token ids to generate the next reply from."""
        if self._prompt is not None:
            return self._prompt
        renderer = self._renderer
        started = time.perf_counter()
        if self._reply is None or not renderer.incremental:
            self._prompt_text = renderer._render_text(self.messages, self._schemas, True)
            prompt = renderer._tokenize(self._prompt_text)
        else:
            prompt = self._held + renderer._tokenize(self._suffix())
            renderer.stats.incremental_prompts += 1
            if renderer._should_check():
                self._check_drift(prompt)
        renderer.stats.prompts += 1
        renderer.stats.render_s += time.perf_counter() - started
        self._prompt = prompt
        return prompt

    def add_reply(self, output_ids: Sequence[int], message: Mapping[str, Any]) -> None:
        """Record the reply generated from the last `prompt_ids()`: its ids as sampled and its message.

        Raises:
            RuntimeError: No prompt was taken since the last reply.
        """
        if self._prompt is None:
            raise RuntimeError("add_reply() needs the prompt the reply was generated from: call prompt_ids()")
        renderer = self._renderer
        ids = list(output_ids)
        if renderer.incremental:  # the reply's text is only needed to find where the template continues
            finished = bool(ids) and ids[-1] in renderer.eos_token_ids
            self._reply = _Reply(renderer._decode(ids), renderer._decode(ids[-1:]) if finished else "")
            self._held = self._prompt + ids
        else:
            self._reply = _Reply("", "")
        self._reply_prompt_text = self._prompt_text
        self._messages += [*self._pending, dict(message)]
        self._pending = []
        self._prompt = None

    # --- internals ------------------------------------------------------------------------------------

    def _suffix(self) -> str:
        """The text to tokenize after the held ids: the reply's closing, the new messages, the gen prompt."""
        renderer, reply = self._renderer, self._reply
        assert reply is not None
        reply_at = len(self._messages) - 1
        if renderer.window:
            end = head_end(self._messages, reply_at)
            context = self._messages[:end]
            if self._head is None or self._head[0] != end:
                self._head = (end, renderer._render_text(context, self._schemas, True))
            before = self._head[1]
        else:
            context, before = self._messages[:reply_at], self._reply_prompt_text
        full = renderer._render_text(
            [*context, self._messages[reply_at], *self._pending], self._schemas, True
        )
        if not renderer.window:
            self._prompt_text = full
        if not full.startswith(before):
            raise ChatTemplateError(
                f"{renderer.template_name} re-rendered the prompt of the reply at message {reply_at}, though "
                "it passed the prefix check; render with incremental=False"
            )
        added = full[len(before) :]
        if added.startswith(reply.text):
            return added[len(reply.text) :]
        # The template writes this reply differently: keep the sampled ids, close the reply as the template
        # does after a message's content, then append what the template renders after the reply.
        renderer.stats.rewritten_replies += 1
        replied = renderer._render_text([*context, self._messages[reply_at]], self._schemas, False)
        if not (replied.startswith(before) and full.startswith(replied)):
            raise ChatTemplateError(
                f"{renderer.template_name} re-rendered the reply at message {reply_at} once messages "
                "followed, though it passed the prefix check; render with incremental=False"
            )
        close, after = renderer.check.close, full[len(replied) :]
        if reply.stop_text and reply.stop_text in close:
            closing = close[close.index(reply.stop_text) + len(reply.stop_text) :]
        else:
            closing = close
            if reply.stop_text and after.startswith(reply.stop_text):
                after = after[len(reply.stop_text) :]  # the reply's end token opens the next message (GLM)
        return closing + after

    def _check_drift(self, prompt: list[int]) -> None:
        renderer = self._renderer
        full = renderer._tokenize(renderer._render_text(self.messages, self._schemas, True))
        renderer.stats.checks += 1
        if full == prompt:
            return
        common = common_prefix_length(full, prompt)
        differing = max(len(full), len(prompt)) - common
        renderer.stats.drifted += 1
        renderer.stats.drift_tokens_max = max(renderer.stats.drift_tokens_max, differing)
        log.debug(
            "incremental prompt drifts from the full render by %d tokens after position %d: %r vs %r",
            differing,
            common,
            renderer._decode(prompt[common : common + 12]),
            renderer._decode(full[common : common + 12]),
        )


def _schemas(tools: Toolset | None) -> list[dict[str, Any]] | None:
    return tools.schemas() if tools else None

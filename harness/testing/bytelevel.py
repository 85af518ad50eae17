"""Byte-level BPE pieces shared by the offline tokenizers: the split regex, byte spelling, wrapping."""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Regex, Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# Qwen2's pre-tokenizer split: like GPT-4's cl100k pattern but digits are split one by one.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """Map each byte to the printable character that stands for it in byte-level BPE vocabularies.

    This is the GPT-2 convention that `tokenizers`' ByteLevel pre-tokenizer and decoder use: printable Latin-1
    bytes map to themselves, the rest to code points from U+0100 on, so every token is a visible string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for offset, byte in enumerate(shifted):
        mapping[byte] = chr(0x100 + offset)
    return dict(sorted(mapping.items()))


def bytes_to_token(data: bytes) -> str:
    """Spell raw token bytes the way a byte-level BPE vocabulary stores them."""
    table = _byte_to_unicode()
    return "".join(table[b] for b in data)


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Split with Qwen's regex, then map bytes to byte-level characters, as Qwen2's tokenizer.json does."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def add_tokens_in_order(tokenizer: Tokenizer, tokens: tuple[tuple[str, bool], ...]) -> None:
    """Append added tokens one at a time, so ids follow the given order, keeping each one's special flag."""
    for content, special in tokens:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])


def wrap_tokenizer(tokenizer_json: str, chat_template: str | None) -> PreTrainedTokenizerFast:
    """A fresh transformers tokenizer (callers may mutate it) from a serialized `tokenizers` tokenizer."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        padding_side="left",
        # Cleaning up "tokenization spaces" (" ." -> ".") would break decode(encode(x)) == x.
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer

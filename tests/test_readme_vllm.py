"""The README's `vllm serve` commands: flags that work together (finding 5 of the vLLM issue: vLLM refuses
runtime LoRA updating with several API servers), and the adapter-sync command is the one the vllm test
layer starts its server with."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def vllm_commands() -> list[list[str]]:
    """Each bash block of the README that runs `vllm serve`, as shell words (continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks if "vllm serve" in block]


def flag_value(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def test_runtime_adapters_are_never_shown_with_several_api_servers():
    commands = vllm_commands()
    assert len(commands) >= 2, "the README shows a merged-sync and an adapter-sync command"
    adapter = [words for words in commands if "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in words]
    assert adapter, "no adapter-sync command"
    for words in adapter:
        assert int(flag_value(words, "--api-server-count") or 1) == 1, words
        assert "--enable-lora" in words and int(flag_value(words, "--max-loras") or 0) >= 6, words


def test_the_adapter_sync_command_has_the_flags_the_vllm_layer_runs_with():
    source = (Path(__file__).parent / "vllm_server.py").read_text()
    (words,) = [w for w in vllm_commands() if "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in w]
    flags = [word for word in words if word.startswith("--")]
    tested = set(re.findall(r'"(--[a-z-]+)"', source))
    untested = [flag for flag in flags if flag not in tested]
    assert not untested, f"README flags the vllm layer never starts vLLM with: {untested}"
    assert '"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"' in source and '"VLLM_SERVER_DEV_MODE": "1"' in source

"""What lets the examples run offline on a CPU: a tiny random model, and a reward that spreads its groups.

A random model never solves a task, so every rollout of a group scores the same, every group is dropped
(zero reward std) and no training step ever fills. `spread_reward` gives such groups a small spread;
the examples add it only when they run the tiny model, never with a real one.

    python examples/tiny.py /tmp/tiny-model     # save the tiny model, e.g. for `harness train --set model=`
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any


def save_tiny_model(directory: str | None = None) -> str:
    """Save a tiny random Qwen3 and its tokenizer (built offline by harness.testing); returns the folder."""
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    directory = directory or tempfile.mkdtemp(prefix="tiny-model-")
    build_tiny_qwen3().save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory


def spread_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """0.1 times the fraction of letters in the completion's text: varies between random completions."""
    rewards = []
    for completion in completions:
        text = "".join(str(message.get("content") or "") for message in completion)
        rewards.append(0.1 * sum(ch.isalpha() for ch in text) / max(len(text), 1))
    return rewards


if __name__ == "__main__":
    print(save_tiny_model(sys.argv[1] if len(sys.argv) > 1 else None))

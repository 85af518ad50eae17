"""reverse-words: reverse the order of the words of a sentence, and submit it (an example plugin).

The whole of a third-party environment: a class with reset, tools and get_reward, a manifest, and one
entry point in pyproject.toml.
"""

from __future__ import annotations

import random
from typing import Any

from environments import Environment, Manifest

SENTENCES = (
    "the quick brown fox jumps",
    "agents learn from their own mistakes",
    "a sandbox keeps the host safe",
    "reward shapes what the policy does",
)


class ReverseWordsEnv(Environment):
    """Reverse the words of a sentence and submit the result."""

    manifest = Manifest(
        name="reverse-words",
        version="0.1.0",
        description="Reverse the order of the words of a sentence; reward 1.0 for the exact reversal.",
        reward_names=("exact",),
    )

    def reset(self, seed: int | None = None, **row: Any) -> str:
        self.sentence = random.Random(seed).choice(SENTENCES)
        self.answer: str | None = None
        return f"Reverse the order of the words in: {self.sentence!r}, then submit it."

    def submit(self, text: str) -> str:
        """Submit the sentence with its words reversed.

        Args:
            text: The words of the sentence in reverse order, separated by single spaces.
        """
        self.answer = text
        return "Submitted."

    def get_reward(self) -> float:
        return float(self.answer == " ".join(reversed(self.sentence.split())))

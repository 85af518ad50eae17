"""counter: the reference's increment example, with an environment-owned reward.

The model must bring a counter from 0 to a target by calling `increment`; the reward is 1.0 when the
counter ends exactly on the target. The smallest environment there is: a test bed for the plumbing
(reset, a stateful tool, get_reward) more than a task worth training on.
"""

from __future__ import annotations

import random
from typing import Any

from environments.base import Environment
from environments.manifest import Manifest


class CounterEnv(Environment):
    """Bring a counter to a target with the `increment` tool."""

    manifest = Manifest(
        name="counter",
        version="1.0.0",
        description="Increment a counter to a target; reward 1.0 when it ends exactly on the target.",
        reward_names=("reached_target",),
    )

    def reset(self, target: int | None = None, seed: int | None = None, **row: Any) -> str | None:
        """Start at 0. The target comes from the row, else from `seed` (same seed, same target)."""
        self.counter = 0
        self.target = int(target) if target is not None else random.Random(seed).randint(1, 6)
        if "prompt" in row:
            return None  # the dataset's prompt already says what to do
        return f"Increment the counter by {self.target}, using the increment tool."

    def increment(self, step: int) -> int:
        """Add to the counter and return its new value.

        Args:
            step: How much to add (may be negative).
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)

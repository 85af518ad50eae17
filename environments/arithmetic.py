"""arithmetic: answer a generated arithmetic problem, with a calculator tool.

Each episode is one problem, such as "What is 37 * 48 - 112?", generated from a seed so that every
rollout of a group gets the same problem (give rows a `seed` column: `ArithmeticEnv.dataset(n)` makes
such rows). The model has two tools: `calculator` (exact arithmetic, tools/calculator.py) and `submit`;
the reward is 1.0 when the submitted answer equals the exact value, else 0.0. Problems are sized so that
mental arithmetic usually fails and the calculator usually succeeds: the environment teaches tool use.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

from environments.base import Environment
from environments.manifest import Manifest
from tools.calculator import CalculatorError, calculator, evaluate

_OPERATORS = ("+", "-", "*")


def make_problem(seed: int | None, num_operands: int = 3) -> tuple[str, Fraction]:
    """An expression of `num_operands` two- and three-digit numbers, and its exact value."""
    rng = random.Random(seed)
    parts = [str(rng.randint(10, 999))]
    for _ in range(num_operands - 1):
        parts += [rng.choice(_OPERATORS), str(rng.randint(10, 99))]
    expression = " ".join(parts)
    return expression, evaluate(expression)


class ArithmeticEnv(Environment):
    """Solve `expression` with the calculator, then submit the answer."""

    manifest = Manifest(
        name="arithmetic",
        version="1.0.0",
        description="Compute a generated arithmetic problem with a calculator tool; reward 1.0 for the exact "
        "answer.",
        tools=("calculator", "submit"),
        tool_timeout_s=10.0,
        reward_names=("correct",),
    )

    def reset(self, seed: int | None = None, num_operands: int = 3, **row: Any) -> str:
        self.expression, self.answer = make_problem(seed, num_operands)
        self.submitted: str | None = None
        self.calculator_calls = 0
        return (
            f"What is {self.expression}? Use the calculator tool to compute it, then call submit with the "
            "answer."
        )

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(17 + 3) * 4".
        """
        self.calculator_calls += 1
        return calculator(expression)

    def submit(self, answer: str) -> str:
        """Submit the final answer; the last submission counts.

        Args:
            answer: The value, as a number (e.g. "1234" or "-7.5").
        """
        self.submitted = answer
        return "Answer recorded."

    def get_reward(self) -> float:
        if self.submitted is None:
            return 0.0
        try:
            return float(evaluate(self.submitted) == self.answer)
        except CalculatorError:
            return 0.0

    @classmethod
    def dataset(cls, num_rows: int, *, seed: int = 0) -> Any:
        """A `datasets.Dataset` of `num_rows` problem seeds (column `seed`), one problem per row."""
        from datasets import Dataset

        rng = random.Random(seed)
        return Dataset.from_dict({"seed": [rng.randrange(1 << 31) for _ in range(num_rows)]})

"""The calculator tool on hand-written expressions, including hostile ones."""

from __future__ import annotations

import pytest

from tools import Tool
from tools.calculator import CalculatorError, calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("17 * 23", "391"),
        ("(17 + 3) * 4 / 5", "16"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333333333"),
        ("-2 ** 3", "-8"),
        ("2 ** -2", "0.25"),
        ("7 // 2 + 7 % 2", "4"),
        ("0.1 + 0.2", "0.3"),
        (" 12 ", "12"),
        ("10 ** 100 - 10 ** 100", "0"),
    ],
)
def test_arithmetic_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "needle"),
    [
        ("__import__('os').system('true')", "is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("2 ** 0.5", "whole-number exponents"),
        ("99999 ** 999", "more than 1000 digits"),
        ("1" * 600, "at most 500"),
        ("1 << 3", "not supported"),
        ("'a' * 3", "is not allowed"),
    ],
)
def test_hostile_or_invalid_expressions_are_refused_with_a_reason(expression, needle):
    with pytest.raises(CalculatorError) as info:
        calculator(expression)
    assert needle in str(info.value)


def test_calculator_is_a_valid_tool():
    tool = Tool.from_callable(calculator)
    assert tool.parameters["required"] == ["expression"]

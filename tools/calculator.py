"""A calculator tool: exact arithmetic on model-written expressions, without `eval`.

The expression is parsed with `ast` and only numbers, + - * / // % **, unary signs and parentheses are
evaluated; anything else (names, calls, attributes) is refused with a message saying what is allowed.
Work is bounded so an expression like `9**9**9` cannot stall the process: exponents and operand sizes are
capped before computing.
"""

from __future__ import annotations

import ast
import math
import operator
import threading
from collections.abc import Callable
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1_000
MAX_INT_DIGITS = 1_000
# Tools run in threads, many at once. CPython 3.11 keeps the AST constructor's recursion depth in state
# shared by the interpreter's threads, and threaded programs see a rare spurious "SystemError: AST
# constructor recursion depth mismatch" from ast.parse (python/cpython#106905; once in our CI): calculator
# calls parse one at a time (an expression is at most MAX_EXPRESSION_CHARS, so the wait is microseconds).
_PARSE_LOCK = threading.Lock()

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its result would be too large."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(17 + 3) * 4 / 5".

    Returns:
        The value: an integer when it is whole, else a fraction's decimal value.
    """
    return format_number(evaluate(expression))


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, or CalculatorError saying what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return _eval(tree.body)


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.12g}"
    return text if math.isfinite(float(value)) else str(value)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        assert isinstance(node.value, int | float)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(op(left, right))
    allowed = "numbers, + - * / // % **, and parentheses"
    raise CalculatorError(f"'{ast.unparse(node)}' is not allowed; use only {allowed}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    # |base| ** |exponent| has about |exponent| * digits(base) digits: refuse before computing it
    digits = max(len(str(abs(base.numerator))), len(str(base.denominator)))
    if digits * abs(exponent) > MAX_INT_DIGITS:
        raise CalculatorError(f"result would have more than {MAX_INT_DIGITS} digits")
    return base ** int(exponent)


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_INT_DIGITS:
        raise CalculatorError(f"result has more than {MAX_INT_DIGITS} digits")
    return value

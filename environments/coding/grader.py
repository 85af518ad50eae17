"""Grading a coding task's solution by its hidden tests, in a fresh sandbox the policy never touched.

    result = await grade(task, source, spec)      # GradeResult(passed=7, total=8, ...)
    result.fraction                               # 0.875: the coding environment's reward

The policy works in its own sandbox, where it could edit or delete anything it sees. So grading never
happens there: the solution's source is copied out and a new sandbox of the same spec is started. Each
hidden test then runs as its own command in a fresh directory with a fresh copy of solution.py
(`runner.py`: it calls the function on the test's inputs and reports the value as one line of JSON), and
whatever the test left running is killed before the next. The verdict is decided here, in the trusted
process: the expected outputs never enter the sandbox, the reported value crosses as plain data (one JSON
object, capped in size; anything else fails the test), and the comparison runs on it outside any process
the solution's code ran in. So a solution that forges a result, patches a test framework, prints fake
verdicts or monkeypatches builtins scores only what it computes. Expected outputs come from the task's
reference solution, run on the host once per task (our own code, not the policy's).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.coding.tasks import CodingTask
from sandboxes.backends import create_sandbox
from sandboxes.base import Sandbox, SandboxSpec

RUNNER_SOURCE = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
CASE_TIMEOUT_S = 5.0
MAX_RESULT_BYTES = 1 << 20


@dataclass(frozen=True)
class GradeResult:
    """How a solution did on a task's hidden tests."""

    passed: int
    total: int
    errors: list[str] = field(default_factory=list)  # why each failed test failed, in test order

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


_EXPECTED: dict[str, tuple[Any, ...]] = {}


def expected_outputs(task: CodingTask) -> tuple[Any, ...]:
    """The reference solution's outputs on the hidden inputs, as JSON values (computed once per task)."""
    if task.name not in _EXPECTED:
        namespace: dict[str, Any] = {}
        exec(compile(task.reference, f"<reference {task.name}>", "exec"), namespace)  # our own reference
        function = namespace[task.function]
        _EXPECTED[task.name] = tuple(
            json.loads(json.dumps(function(*copy.deepcopy(list(case))))) for case in task.cases
        )
    return _EXPECTED[task.name]


async def grade(
    task: CodingTask, source: str, spec: SandboxSpec, *, case_timeout_s: float = CASE_TIMEOUT_S
) -> GradeResult:
    """Run the task's hidden tests against `source` in a fresh sandbox of `spec`.

    Sandbox failures (one that will not start, or dies) raise SandboxError: they are infrastructure
    failures, not a score. A solution that fails, hangs or misbehaves scores what it passed.
    """
    async with create_sandbox(spec) as sandbox:
        return await grade_in(sandbox, task, source, case_timeout_s=case_timeout_s)


async def grade_in(
    sandbox: Sandbox, task: CodingTask, source: str, *, case_timeout_s: float = CASE_TIMEOUT_S
) -> GradeResult:
    """The hidden tests of `task` against `source`, each in a fresh directory of `sandbox`."""
    expected = expected_outputs(task)
    errors = []
    for index, (args, wanted) in enumerate(zip(task.cases, expected, strict=True)):
        directory = f".grading/case-{index}"
        await sandbox.write_file(f"{directory}/solution.py", source)
        result = await sandbox.exec(
            ["python3", "-I", "-c", RUNNER_SOURCE],
            stdin=json.dumps({"function": task.function, "args": list(args)}),
            cwd=directory,
            timeout_s=case_timeout_s,
            max_output_bytes=MAX_RESULT_BYTES,
        )
        await sandbox.kill_all()  # whatever the test left running cannot touch the next one
        if result.timed_out:
            errors.append(f"timed out after {case_timeout_s:g} s")
            continue
        outcome = _outcome(result.stdout, result.stdout_truncated)
        if not outcome.get("ok"):
            errors.append(outcome.get("error") or "the test failed")
        elif not same(outcome.get("value"), wanted, task.compare):
            errors.append("wrong answer")
        else:
            errors.append("")
    failures = [error for error in errors if error]
    return GradeResult(len(errors) - len(failures), len(errors), failures)


def _outcome(stdout: str, truncated: bool) -> dict[str, Any]:
    """The one JSON object a test reports; a failure for anything else (nothing, garbage, several)."""
    if truncated:
        return {"ok": False, "error": "the test reported more than 1 MiB"}
    try:
        value = json.loads(stdout)
    except (ValueError, RecursionError):
        return {"ok": False, "error": "the test process gave no result (it exited, was killed or lied)"}
    if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
        return {"ok": False, "error": "the test process gave no result (it exited, was killed or lied)"}
    return value


def same(value: Any, expected: Any, compare: str) -> bool:
    """Whether a reported value passes: "exact" JSON equality (booleans are not numbers, 2 == 2.0),
    "float" (relative 1e-6), or "unordered" (a list equal to the expected one up to order)."""
    if compare == "float":
        return _close(value, expected)
    if compare == "unordered":
        if not isinstance(value, list) or not isinstance(expected, list):
            return False

        def key(item: Any) -> str:
            return json.dumps(item, sort_keys=True)

        return sorted(value, key=key) == sorted(expected, key=key)
    return _equal(value, expected)


def _equal(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(expected, int | float):
        return isinstance(value, int | float) and value == expected
    if isinstance(expected, list):
        return isinstance(value, list) and len(value) == len(expected) and all(map(_equal, value, expected))
    if isinstance(expected, dict):
        return (
            isinstance(value, dict)
            and value.keys() == expected.keys()
            and all(_equal(value[key], expected[key]) for key in expected)
        )
    return type(value) is type(expected) and value == expected


def _close(value: Any, expected: Any) -> bool:
    if isinstance(expected, list):
        return isinstance(value, list) and len(value) == len(expected) and all(map(_close, value, expected))
    if isinstance(expected, dict):
        return (
            isinstance(value, dict)
            and value.keys() == expected.keys()
            and all(_close(value[k], expected[k]) for k in expected)
        )
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        return math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-9)
    return bool(value == expected)

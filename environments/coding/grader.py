"""Grading a coding task's solution by its hidden tests, in a fresh sandbox the policy never touched.

    result = await grade(task, source, spec)      # GradeResult(passed=7, total=8, ...)
    result.fraction                               # 0.875: the coding environment's reward

The policy works in its own sandbox, where it could edit or delete anything it sees. So grading never
happens there: the solution's source is copied out, a new sandbox of the same spec is started, and the
runner (`runner.py`) executes each hidden test in a child process, comparing results with expected
outputs it keeps to itself (see runner.py for how a hostile solution is contained). The hidden tests
never exist on disk in either sandbox. Expected outputs come from the task's reference solution, run
on the host once per task (our own code, not the policy's).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.coding.tasks import CodingTask
from sandboxes.backends import create_sandbox
from sandboxes.base import SandboxSpec

RUNNER_SOURCE = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
CASE_TIMEOUT_S = 5.0


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
    job = {
        "source": source,
        "function": task.function,
        "cases": [list(case) for case in task.cases],
        "expected": list(expected_outputs(task)),
        "compare": task.compare,
        "timeout_s": case_timeout_s,
    }
    budget_s = case_timeout_s * len(task.cases) + 30.0
    async with create_sandbox(spec) as sandbox:
        result = await sandbox.exec(
            ["python3", "-I", "-c", RUNNER_SOURCE], stdin=json.dumps(job), timeout_s=budget_s
        )
    summary = _last_json_line(result.stdout)
    if summary is None:
        detail = result.stderr.strip()[-300:] or f"exit code {result.exit_code}"
        return GradeResult(0, len(task.cases), [f"the grader produced no result: {detail}"] * len(task.cases))
    errors = [outcome.get("error", "") for outcome in summary["results"] if not outcome["passed"]]
    return GradeResult(summary["passed"], summary["total"], errors)


def _last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and {"passed", "total", "results"} <= value.keys():
            return value
    return None

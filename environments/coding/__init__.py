"""python-coding: write a Python function in a sandbox; the reward is the fraction of hidden tests passed.

Each episode is one task of `tasks.TASKS` (about 50 function-writing problems), picked by the row's
`task` column, or by `seed`. The model works in its own sandbox with the write_file, python and bash
tools and must leave its function in `solution.py`. When the episode ends, the solution is graded in a
fresh sandbox the policy never touched (`grader.py`), so it cannot edit or delete the tests, which never
exist in its sandbox anyway. The sandbox backend is "auto": Docker when an engine answers and has the
image, bubblewrap otherwise.
"""

from __future__ import annotations

import random
from typing import Any

from environments.base import Environment
from environments.coding.grader import GradeResult, grade
from environments.coding.tasks import TASKS, CodingTask
from environments.manifest import Manifest
from sandboxes.base import Limits, SandboxSpec
from sandboxes.errors import SandboxFileNotFound

TASKS_BY_NAME = {task.name: task for task in TASKS}
SOLUTION_FILE = "solution.py"


class CodingEnv(Environment):
    """Implement a function in solution.py; graded by hidden tests."""

    manifest = Manifest(
        name="python-coding",
        version="1.0.0",
        description="Write a Python function in a sandbox; reward = fraction of hidden tests passed, "
        "graded in a fresh sandbox.",
        sandbox=SandboxSpec(
            backend="auto", limits=Limits(cpus=1.0, memory_mb=512, pids=128, disk_mb=256), exec_timeout_s=30.0
        ),
        sandbox_tools=("write_file", "python", "bash"),
        tool_timeout_s=30.0,
        episode_timeout_s=600.0,
        reward_names=("tests_passed",),
    )

    def reset(self, task: str | None = None, seed: int | None = None, **row: Any) -> str:
        if task is not None and task not in TASKS_BY_NAME:
            raise ValueError(f"unknown coding task {task!r}; tasks are {', '.join(sorted(TASKS_BY_NAME))}")
        self.task: CodingTask = TASKS_BY_NAME[task] if task else random.Random(seed).choice(TASKS)
        self.last_grade: GradeResult | None = None
        return (
            f"{self.task.prompt}\n\nWrite the function in the file {SOLUTION_FILE} in the working directory, "
            f"with this signature:\n\n{self.task.signature}\n\nYou can run Python and shell commands to test "
            "it. Use only the standard library."
        )

    async def get_reward(self) -> float:
        try:
            source = (await self.sandbox.read_file(SOLUTION_FILE)).decode("utf-8", errors="replace")
        except SandboxFileNotFound:
            self.last_grade = GradeResult(0, len(self.task.cases), [f"no {SOLUTION_FILE} was written"])
            return 0.0
        self.last_grade = await grade(self.task, source, self.sandbox.spec)
        return self.last_grade.fraction

    @classmethod
    def dataset(cls, *, repeats: int = 1, seed: int = 0) -> Any:
        """A `datasets.Dataset` with one row per task (column `task`), shuffled, `repeats` times over."""
        from datasets import Dataset

        names = [task.name for task in TASKS] * repeats
        random.Random(seed).shuffle(names)
        return Dataset.from_dict({"task": names})

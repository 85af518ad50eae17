"""An example environment that uses a sandbox, and a scripted episode to try it without a model.

    python docs/examples/line_count_env.py

The task: a file of random lines is written into the rollout's sandbox; the model must find how many
lines contain a given word (with the `bash` sandbox tool) and call `answer`. The episode below plays the
model's part with fixed tool calls, through the same executor and tool schemas the trainer uses, on the
local (bubblewrap) backend or Docker, whichever `backend="auto"` finds.
"""

from __future__ import annotations

import random
from typing import Any

import anyio

from environments import Environment, Manifest, environment_tools, validate_environment
from sandboxes import Limits, SandboxError, SandboxSpec, create_sandbox
from tools import ToolCall, ToolExecutor

WORDS = ("alpha", "beta", "gamma", "delta")


class LineCountEnv(Environment):
    """Count the lines of data.txt that contain a word."""

    manifest = Manifest(
        name="line-count",
        version="0.1.0",
        description="Count matching lines of a file in a sandbox; reward 1.0 for the exact count.",
        tools=("answer",),
        sandbox=SandboxSpec(backend="auto", limits=Limits(memory_mb=256, pids=64), exec_timeout_s=10.0),
        sandbox_tools=("bash",),
        tool_timeout_s=20.0,
        episode_timeout_s=120.0,
        reward_names=("exact_count",),
        max_concurrent=32,
    )

    async def reset(self, seed: int | None = None, **row: Any) -> str:
        rng = random.Random(seed)
        self.word = rng.choice(WORDS)
        lines = [" ".join(rng.choices(WORDS, k=3)) for _ in range(rng.randint(20, 40))]
        self.expected = sum(self.word in line.split() for line in lines)
        self.answered: int | None = None
        await self.sandbox.write_file("data.txt", "\n".join(lines) + "\n")
        return f"How many lines of data.txt contain the word {self.word!r}? Use bash, then call answer."

    def answer(self, count: int) -> str:
        """Give your final answer.

        Args:
            count: The number of lines that contain the word.
        """
        self.answered = count
        return "Answer recorded."

    def get_reward(self) -> float:
        return float(self.answered == self.expected)


async def scripted_episode(seed: int = 0) -> float:
    manifest = validate_environment(LineCountEnv)  # the checks the registry and the trainer run
    env = LineCountEnv()
    async with create_sandbox(manifest.sandbox) as sandbox:  # the trainer leases one from a pool
        env.sandbox = sandbox
        print(await env.reset(seed=seed))
        toolset = environment_tools(env, manifest)  # answer, then bash bound to this sandbox
        print("tools:", toolset.names())
        with ToolExecutor(infrastructure_errors=(SandboxError,)) as executor:
            command = f"grep -cw {env.word} data.txt"
            (result,) = await executor.run([ToolCall("bash", {"command": command})], toolset)
            print("bash ->", result.status.value, repr(result.content))
            (result,) = await executor.run([ToolCall("answer", {"count": result.content.strip()})], toolset)
            print("answer ->", result.status.value, result.content)
        reward = env.get_reward()
        print("reward:", reward)
        return reward


if __name__ == "__main__":
    anyio.run(scripted_episode)

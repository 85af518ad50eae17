"""What an environment declares about itself: its manifest, validated before any training starts.

    @dataclass
    class CodingEnv(Environment):
        manifest = Manifest(
            name="python-coding",
            version="1.0.0",
            description="Write a function; graded by hidden tests in a fresh sandbox.",
            sandbox=SandboxSpec(backend="auto", limits=Limits(memory_mb=512)),
            sandbox_tools=("write_file", "python", "bash"),
            tool_timeout_s=30.0,
            episode_timeout_s=300.0,
            reward_names=("tests_passed",),
            max_concurrent=64,
        )

The trainer reads the manifest to provision sandboxes (one per rollout, from a pool keyed by the spec),
to cap concurrent instances, and to set tool timeouts; `harness envs show NAME` prints it. A class
without a manifest (the plain classes of the reference) gets a default one: its class name, all its
public methods as tools, no sandbox.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from environments.errors import InvalidEnvironment
from sandboxes.base import SandboxSpec

# The built-in sandbox tools an environment can expose by name (tools/sandboxed.py)
SANDBOX_TOOL_NAMES = ("bash", "python", "read_file", "write_file", "edit", "list_dir")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclass(frozen=True)
class Manifest:
    """An environment's declared needs and interface.

    Attributes:
        name: Registry name: lowercase letters, digits, '-', '_' and '.'.
        version: The environment's own version (a plugin's release, for reproducibility).
        description: One or two sentences for `harness envs list`.
        tools: Names of the methods exposed as tools; None exposes every public method.
        sandbox: The sandbox each rollout gets (None: no sandbox); its limits, image and backend.
        sandbox_tools: Built-in sandbox tools exposed alongside the methods, bound to the rollout's
            sandbox: any of bash, python, read_file, write_file, edit, list_dir.
        tool_timeout_s: Per-call timeout of this environment's tools.
        episode_timeout_s: Wall-time limit of one rollout in this environment; None for no limit.
        reward_names: Names of the rewards get_reward produces (for metrics); the class name if empty.
        max_concurrent: Most instances alive at once (None: bounded only by max_concurrent_rollouts).
    """

    name: str
    version: str = "0.0.0"
    description: str = ""
    tools: tuple[str, ...] | None = None
    sandbox: SandboxSpec | None = None
    sandbox_tools: tuple[str, ...] = ()
    tool_timeout_s: float = 60.0
    episode_timeout_s: float | None = None
    reward_names: tuple[str, ...] = ()
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not _NAME_RE.match(self.name):
            problems.append(f"name {self.name!r} must be lowercase letters, digits, '-', '_' or '.'")
        if not self.version:
            problems.append("version must not be empty")
        unknown = [tool for tool in self.sandbox_tools if tool not in SANDBOX_TOOL_NAMES]
        if unknown:
            problems.append(
                f"sandbox_tools {unknown} are not built-in tools ({', '.join(SANDBOX_TOOL_NAMES)})"
            )
        if self.sandbox_tools and self.sandbox is None:
            problems.append("sandbox_tools need a sandbox: set sandbox=SandboxSpec(...)")
        if self.sandbox is not None and not isinstance(self.sandbox, SandboxSpec):
            problems.append(f"sandbox must be a SandboxSpec, got {type(self.sandbox).__name__}")
        if not self.tool_timeout_s > 0:
            problems.append(f"tool_timeout_s must be positive, got {self.tool_timeout_s}")
        if self.episode_timeout_s is not None and not self.episode_timeout_s > 0:
            problems.append(f"episode_timeout_s must be positive or None, got {self.episode_timeout_s}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            problems.append(f"max_concurrent must be at least 1 or None, got {self.max_concurrent}")
        if problems:
            raise InvalidEnvironment(
                f"invalid manifest for environment {self.name!r}: " + "; ".join(problems)
            )
        # Accept lists where tuples are meant, and keep the dataclass hashable.
        for name in ("tools", "sandbox_tools", "reward_names"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def summary(self) -> dict[str, object]:
        """The manifest as plain data, for printing."""
        sandbox = None
        if self.sandbox is not None:
            limits = self.sandbox.limits
            sandbox = {
                "backend": self.sandbox.backend,
                "image": self.sandbox.image,
                "limits": {
                    "cpus": limits.cpus,
                    "memory_mb": limits.memory_mb,
                    "pids": limits.pids,
                    "network": "on" if limits.network else "none",
                    "cpu_time_s": limits.cpu_time_s,
                },
                "exec_timeout_s": self.sandbox.exec_timeout_s,
            }
        return {
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "sandbox": sandbox,
            "sandbox_tools": list(self.sandbox_tools),
            "tool_timeout_s": self.tool_timeout_s,
            "episode_timeout_s": self.episode_timeout_s,
            "reward_names": list(self.reward_names),
            "max_concurrent": self.max_concurrent,
        }

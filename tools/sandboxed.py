"""The built-in tools of a coding agent, each bound to one rollout's sandbox.

    tools = SandboxTools(sandbox, timeout_s=30.0)
    toolset = tools.toolset()                 # bash, python, read_file, write_file, edit, list_dir
    results = await executor.run(calls, toolset)

Every tool runs inside the sandbox (see `sandboxes/`), never on the host. A command that fails, or times
out, is an answer the model reads (its output, exit code and a note saying what happened), not an error;
a tool raises only for a misuse the model should correct (an `edit` whose text is not in the file, a path
that does not exist), which the executor turns into an error message for the model. A sandbox that dies
raises `SandboxDied`, which the executor also reports, and the rollout loop treats as an infrastructure
failure.

Timeouts: each command runs under `timeout_s` inside the sandbox (its whole process tree is killed when it
passes); the tool's own timeout in the executor is a little longer, so the model sees the sandbox's
"timed out" answer rather than the executor's.
"""

from __future__ import annotations

from typing import Protocol

from sandboxes.base import ExecResult, Sandbox
from tools.schema import Tool
from tools.toolset import Toolset

_EXECUTOR_SLACK_S = 10.0


class _SandboxLike(Protocol):
    """What the tools need of a sandbox (Sandbox provides it)."""

    async def exec(self, command: str | list[str], **kwargs: object) -> ExecResult: ...
    async def read_file(self, path: str, *, max_bytes: int = ...) -> bytes: ...
    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None: ...


class SandboxTools:
    """bash, python, read_file, write_file, edit and list_dir for one sandbox.

    Args:
        sandbox: The rollout's sandbox.
        timeout_s: Time limit of one command inside the sandbox.
        max_output_chars: Output cap the executor applies to these tools' answers.
        max_file_bytes: Largest file read_file and edit will read.
    """

    def __init__(
        self,
        sandbox: Sandbox | _SandboxLike,
        *,
        timeout_s: float = 60.0,
        max_output_chars: int = 16_384,
        max_file_bytes: int = 1 << 20,
    ):
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.max_file_bytes = max_file_bytes

    def toolset(self) -> Toolset:
        """The six tools, bound to this sandbox, with their timeouts and output caps."""
        return Toolset(
            Tool.from_callable(
                method, timeout_s=self.timeout_s + _EXECUTOR_SLACK_S, max_output_chars=self.max_output_chars
            )
            for method in (self.bash, self.python, self.read_file, self.write_file, self.edit, self.list_dir)
        )

    async def bash(self, command: str) -> str:
        """Run a bash command in the working directory and return its output and exit code.

        Args:
            command: The command line, run with `bash -c`. Each call starts a fresh shell: `cd` and
                variables do not carry over, and processes it leaves in the background are stopped.
        """
        return format_result(await self.sandbox.exec(["bash", "-c", command], timeout_s=self.timeout_s))

    async def python(self, code: str) -> str:
        """Run a Python program and return what it prints and its exit code.

        Args:
            code: The program's source, run with python3 in the working directory.
        """
        return format_result(await self.sandbox.exec(["python3", "-"], stdin=code, timeout_s=self.timeout_s))

    async def read_file(self, path: str) -> str:
        """Read a text file.

        Args:
            path: The file, relative to the working directory or absolute.
        """
        data = await self.sandbox.read_file(path, max_bytes=self.max_file_bytes)
        return data.decode("utf-8", errors="replace")

    async def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a text file, creating its directories.

        Args:
            path: The file, relative to the working directory or absolute.
            content: The complete new content of the file.
        """
        await self.sandbox.write_file(path, content)
        return f"wrote {len(content.encode('utf-8'))} bytes to {path}"

    async def edit(self, path: str, old: str, new: str) -> str:
        """Replace an exact piece of text in a file; the text must occur exactly once.

        Args:
            path: The file to change.
            old: The exact text to replace, including whitespace and indentation.
            new: The text to put in its place.
        """
        if not old:
            raise ValueError("old must not be empty; use write_file to create a file")
        text = (await self.sandbox.read_file(path, max_bytes=self.max_file_bytes)).decode("utf-8")
        count = text.count(old)
        if count != 1:
            where = "does not occur" if count == 0 else f"occurs {count} times"
            raise ValueError(f"the text to replace {where} in {path}; it must occur exactly once")
        await self.sandbox.write_file(path, text.replace(old, new, 1))
        return f"edited {path}: replaced {len(old)} characters with {len(new)}"

    async def list_dir(self, path: str = ".") -> str:
        """List a directory: one entry per line, directories marked with a trailing slash.

        Args:
            path: The directory, relative to the working directory or absolute.
        """
        result = await self.sandbox.exec(["ls", "-1Ap", "--", path], timeout_s=self.timeout_s)
        if result.exit_code != 0:
            raise FileNotFoundError(result.stderr.strip() or f"cannot list {path}")
        return result.stdout or "(empty)"


def format_result(result: ExecResult) -> str:
    """A command's result as the model reads it: output, then notes on exit code, timeout and truncation."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    notes = []
    if result.timed_out:
        notes.append(f"timed out after {result.duration_s:.1f} s and was killed")
    elif result.exit_code != 0:
        notes.append(f"exit code {result.exit_code}")
    if result.stdout_truncated or result.stderr_truncated:
        notes.append("output truncated")
    if notes:
        parts.append(f"[{'; '.join(notes)}]")
    return "\n".join(parts) if parts else "(no output)"

"""The exceptions of the tools package.

Each class also subclasses the stdlib error it refines, so callers can catch either, and each pickles with
all its fields (errors cross from the rollout worker process to the trainer).
"""

from __future__ import annotations


class ToolError(Exception):
    """Base class of every error raised by the tools package."""


class ToolDefinitionError(ToolError, TypeError):
    """A Python callable cannot be turned into a tool: a missing type hint or docstring, an unsupported type.

    Raised when a tool is registered, never while a rollout runs.
    """


class InvalidToolArguments(ToolError, ValueError):
    """The arguments a model sent for a tool call do not match the tool's schema.

    Attributes:
        tool: Name of the tool that was called.
        parameter: The offending parameter, or None when the problem is the arguments as a whole.
        problem: What is wrong, in words the model can act on.
    """

    def __init__(self, tool: str, parameter: str | None, problem: str):
        self.tool = tool
        self.parameter = parameter
        self.problem = problem
        where = f"parameter '{parameter}'" if parameter else "arguments"
        super().__init__(f"invalid arguments for tool '{tool}': {where}: {problem}")

    def __reduce__(self):
        return type(self), (self.tool, self.parameter, self.problem)

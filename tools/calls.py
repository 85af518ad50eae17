"""A tool call as the model sent it, and its result as the model will read it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ToolStatus(enum.StrEnum):
    """How a tool call ended. Every status but OK counts as a failed call."""

    OK = "ok"
    INVALID_ARGUMENTS = "invalid_arguments"  # the arguments did not match the schema; the tool did not run
    UNKNOWN_TOOL = "unknown_tool"  # no tool of that name in this rollout: a policy error
    ERROR = "error"  # the tool ran and raised
    TIMEOUT = "timeout"  # the tool did not finish within its timeout


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for.

    Attributes:
        name: The tool's name as the model wrote it.
        arguments: The arguments, as a dict or as the JSON text the model wrote.
        id: The call's id when the model's format carries one (OpenAI-style), else None.
    """

    name: str
    arguments: Mapping[str, Any] | str | None = None
    id: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call.

    Attributes:
        call: The call this answers.
        status: How it ended.
        content: What the model reads in the tool message: the output, or the error in words it can act on.
        latency_s: Wall time of the call as the rollout saw it, argument checks and queueing included.
        truncated: Whether `content` was cut to the output cap (the cut is marked in the text).
        error_type: For status ERROR, the exception's class name.
        infrastructure: Whether the failure is the infrastructure's, not the model's: the tool raised one
            of the executor's `infrastructure_errors` (a sandbox that died, say) or timed out.
    """

    call: ToolCall
    status: ToolStatus
    content: str
    latency_s: float
    truncated: bool = False
    error_type: str | None = None
    infrastructure: bool = False

    @property
    def name(self) -> str:
        return self.call.name

    @property
    def ok(self) -> bool:
        return self.status is ToolStatus.OK

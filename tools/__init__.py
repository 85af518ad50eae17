"""Tools: Python callables the model may call, their schemas, argument checks, and the executor.

This package knows nothing of the trainer: it turns callables into the schemas a chat template renders
(`Tool`, `Toolset`), checks and coerces the arguments a model sends (`bind_arguments`), runs the calls of a
turn with timeouts and output caps (`ToolExecutor`), and counts what happened (`ToolStats`).
"""

from tools.calls import ToolCall, ToolResult, ToolStatus
from tools.errors import InvalidToolArguments, ToolDefinitionError, ToolError
from tools.executor import ToolExecutor, render_output, truncate
from tools.metrics import ToolStats
from tools.sandboxed import SandboxTools
from tools.schema import Tool, from_json_value, function_schema
from tools.toolset import Toolset
from tools.validation import bind_arguments, coerce

__all__ = [
    "InvalidToolArguments",
    "SandboxTools",
    "Tool",
    "ToolCall",
    "ToolDefinitionError",
    "ToolError",
    "ToolExecutor",
    "ToolResult",
    "ToolStats",
    "ToolStatus",
    "Toolset",
    "bind_arguments",
    "coerce",
    "from_json_value",
    "function_schema",
    "render_output",
    "truncate",
]

"""Tools: Python callables the model may call, their schemas, argument checks, and the executor.

This package knows nothing of the trainer: it turns callables into the schemas a chat template renders
(`Tool`, `Toolset`), reads the calls out of a model's reply in its family's format (`tools.parsers`:
`parser_for_template`, `ParsedMessage`, `ParseError`), checks and coerces the arguments a model sends
(`bind_arguments`), runs the calls of a turn with timeouts and output caps (`ToolExecutor`), and counts what
happened (`ToolStats`).
"""

from tools.calls import ToolCall, ToolResult, ToolStatus
from tools.errors import InvalidToolArguments, ToolDefinitionError, ToolError
from tools.executor import ToolExecutor, render_output, truncate
from tools.metrics import ToolStats
from tools.parsers import (
    ParsedMessage,
    ParseError,
    ParseErrorKind,
    ToolCallParser,
    UnknownToolCallFormat,
    detect_family,
    get_parser,
    parser_for_template,
)
from tools.sandboxed import SandboxTools
from tools.schema import Tool, from_json_value, function_schema
from tools.toolset import Toolset
from tools.validation import bind_arguments, coerce

__all__ = [
    "InvalidToolArguments",
    "ParseError",
    "ParseErrorKind",
    "ParsedMessage",
    "SandboxTools",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolDefinitionError",
    "ToolError",
    "ToolExecutor",
    "ToolResult",
    "ToolStats",
    "ToolStatus",
    "Toolset",
    "UnknownToolCallFormat",
    "bind_arguments",
    "coerce",
    "detect_family",
    "from_json_value",
    "function_schema",
    "get_parser",
    "parser_for_template",
    "render_output",
    "truncate",
]

"""The public names of each package, so the API users rely on does not drift unnoticed."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "tools": {
        "InvalidToolArguments",
        "ParseError",
        "ParseErrorKind",
        "ParsedMessage",
        "SandboxTools",
        "Tool",
        "ToolCall",
        "ToolDefinitionError",
        "ToolError",
        "ToolExecutor",
        "ToolResult",
        "ToolStats",
        "ToolCallParser",
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
    },
    "harness": {
        "__version__",
        "AsyncGRPOConfig",
        "AsyncGRPOTrainer",
        "AsyncRolloutLoop",
        "GenerationClient",
        "Rollout",
        "RolloutGroup",
        "TrainingSequence",
        "TurnRecord",
    },
    "environments": {
        "DuplicateEnvironment",
        "Environment",
        "EnvironmentsError",
        "InvalidEnvironment",
        "Manifest",
        "PluginLoadError",
        "RoutedEnvironment",
        "RoutingError",
        "UnknownEnvironment",
        "check_routes",
        "entries",
        "environment_tools",
        "load",
        "load_manifest",
        "register",
        "reset_arguments",
        "resolve_environments",
        "route",
        "unregister",
        "validate_environment",
    },
    "sandboxes": {
        "RUN_ID",
        "EngineUnavailable",
        "ExecResult",
        "ImageNotFound",
        "InvalidSandboxConfig",
        "Limits",
        "PoolStats",
        "Sandbox",
        "SandboxClosed",
        "SandboxDied",
        "SandboxError",
        "SandboxFileError",
        "SandboxFileNotFound",
        "SandboxPool",
        "SandboxSpec",
        "SandboxStartError",
        "SandboxTimeout",
        "create_sandbox",
    },
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_all_is_exactly_the_public_api_and_every_name_resolves(package):
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC[package]
    for name in module.__all__:
        assert getattr(module, name) is not None

"""The `harness` command line: parse, then import only what the chosen command needs.

Arguments are parsed before any heavy import (torch, transformers), so `harness --help` and argument
errors answer at once. Each command's handler imports its own dependencies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Asynchronous GRPO training for LLM agents that call tools inside sandboxes.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    smoke = commands.add_parser(
        "smoke",
        help="check an installation end to end on tiny offline models (a few seconds on CPU)",
        description=(
            "Build the offline tiny tokenizer and a tiny Qwen3 model, render a tool-calling conversation, "
            "run a tool call through the executor, and train the model for a few steps on the conversation."
        ),
    )
    smoke.add_argument("--steps", type=int, default=5, help="optimizer steps to take (default: 5)")
    smoke.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")

    tools = commands.add_parser("tools", help="inspect tools")
    tools_commands = tools.add_subparsers(dest="tools_command", metavar="SUBCOMMAND", required=True)
    schema = tools_commands.add_parser(
        "schema",
        help="print the JSON schema the model sees for Python callables",
        description="Print the OpenAI-style function schema of each callable, as a chat template gets it.",
    )
    schema.add_argument("targets", nargs="+", metavar="MODULE:NAME", help="e.g. mypkg.tools:search")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from harness import __version__

        print(f"agent-harness {__version__}")
        return 0
    if args.command == "smoke":
        from harness.smoke import run_smoke

        return run_smoke(steps=args.steps, seed=args.seed)
    if args.command == "tools":
        return _tools_schema(args.targets)
    parser.print_help()
    return 0


def _tools_schema(targets: Sequence[str]) -> int:
    import importlib
    import json

    from tools import ToolError, function_schema

    schemas = []
    for target in targets:
        module_name, _, attr = target.partition(":")
        if not attr:
            print(f"error: {target!r} is not MODULE:NAME (e.g. mypkg.tools:search)", file=sys.stderr)
            return 2
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            schemas.append(function_schema(obj))
        except (ImportError, AttributeError, ToolError) as exc:
            print(f"error: {target}: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(schemas, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

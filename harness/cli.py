"""The `harness` command line: parse, then import only what the chosen command needs.

Arguments are parsed before any heavy import (torch, transformers), so `harness --help` and argument
errors answer at once. Each command's handler imports its own dependencies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, cast

from harness.server.cli import add_serve_command, run_serve

# Equal to sandboxes.image.DEFAULT_IMAGE (a test checks it); not imported, so that building the parser
# imports nothing from the sandboxes package.
_SANDBOX_IMAGE = "agent-harness/python:bookworm"


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

    commands.add_parser(
        "demo",
        help="the README's demo: SmolLM2-135M learns to call a calculator, on CPU (6-11 minutes on 2 cores)",
        add_help=False,  # `harness demo --help` shows the demo's own options (harness/recipes/demo.py)
    )

    tools = commands.add_parser("tools", help="inspect tools")
    tools_commands = tools.add_subparsers(dest="tools_command", metavar="SUBCOMMAND", required=True)
    schema = tools_commands.add_parser(
        "schema",
        help="print the JSON schema the model sees for Python callables",
        description="Print the OpenAI-style function schema of each callable, as a chat template gets it.",
    )
    schema.add_argument("targets", nargs="+", metavar="MODULE:NAME", help="e.g. mypkg.tools:search")

    train = commands.add_parser(
        "train",
        help="train from a TOML run spec (model, data, rewards, environments, [args])",
        description=(
            "Train with AsyncGRPOTrainer as a TOML run spec describes it (harness/train_config.py documents "
            "the keys). The resolved spec is written to output_dir/run_config.toml (or .json) and the "
            "logged metrics to output_dir/metrics.jsonl."
        ),
    )
    train.add_argument("config", metavar="CONFIG.toml", help="the run spec (.toml, or a resolved .json)")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, the value read as a TOML literal (repeatable): --set args.learning_rate=1e-5",
    )
    train.add_argument(
        "--dry-run", action="store_true", help="resolve and print the spec; load no model, train nothing"
    )
    train.add_argument(
        "--log-level",
        default="INFO",
        help="logging level (default: INFO: which server and weight sync a run uses and why, warnings)",
    )

    report = commands.add_parser(
        "report",
        help="write a run's HTML report: its curves and a browser of its saved rollouts",
        description=(
            "Read a run folder (metrics.jsonl or trainer_state.json, and the rollouts save_rollouts=True "
            "wrote under rollouts/) and write one self-contained HTML file; prints its path."
        ),
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    report.add_argument("--out", default=None, help="where to write it (default: RUN_DIR/report.html)")

    _add_sandbox_commands(commands)
    add_serve_command(commands)
    _add_envs_commands(commands)
    return parser


def _add_sandbox_commands(commands: argparse._SubParsersAction) -> None:
    sandbox = commands.add_parser("sandbox", help="build the sandbox image, remove what dead runs left")
    sandbox_commands = sandbox.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    build = sandbox_commands.add_parser(
        "build-image",
        help="build the sandbox base image (no registry needed)",
        description=(
            "Build the image sandboxes start from: by default a minimal Debian root filesystem with python3 "
            "and the user `sandbox` (uid 1000, home /workspace), made with debootstrap (needs root and a "
            "Debian mirror) and imported into the Docker engine of DOCKER_HOST. The root filesystem is "
            "cached under ~/.cache/agent-harness/images, so later builds take seconds. With --dockerfile or "
            "--pull the image comes from a Dockerfile or a registry instead, tagged as --tag."
        ),
    )
    build.add_argument(
        "--tag", default=_SANDBOX_IMAGE, help=f"image name to create (default: {_SANDBOX_IMAGE})"
    )
    build.add_argument("--suite", help="Debian suite to bootstrap (default: bookworm)")
    build.add_argument("--mirror", help="Debian mirror (default: http://deb.debian.org/debian)")
    build.add_argument(
        "--package",
        action="append",
        default=[],
        metavar="NAME",
        help="extra Debian package to install besides python3 (repeatable)",
    )
    build.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if the image exists (the cached root filesystem is reused; delete it to redo it)",
    )
    source = build.add_mutually_exclusive_group()
    source.add_argument(
        "--dockerfile", metavar="PATH", help="build from this Dockerfile (or directory) instead"
    )
    source.add_argument("--pull", metavar="NAME", help="pull NAME from its registry instead, and tag it")

    reap = sandbox_commands.add_parser(
        "reap",
        help="remove sandboxes whose owning process is gone",
        description=(
            "Remove sandbox containers (Docker) and local sandbox directories whose owner process on this "
            "host no longer runs, e.g. after a run was killed with SIGKILL. Only sandboxes carrying "
            "agent-harness labels are considered; a live run's sandboxes are never touched."
        ),
    )
    reap.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    reap.add_argument(
        "--other-hosts-older-than",
        type=float,
        metavar="HOURS",
        help="also remove containers of other hosts created more than HOURS ago (default: never)",
    )
    reap.add_argument("--no-docker", action="store_true", help="skip containers (only local directories)")
    reap.add_argument(
        "--engine",
        action="append",
        metavar="URL",
        help="a Docker engine to sweep (unix://, tcp://, ssh://), repeatable (default: DOCKER_HOST's)",
    )


def _add_envs_commands(commands: argparse._SubParsersAction) -> None:
    envs = commands.add_parser("envs", help="list and inspect the registered environments")
    envs_commands = envs.add_subparsers(dest="envs_command", metavar="SUBCOMMAND", required=True)
    envs_commands.add_parser(
        "list",
        help="every registered environment: bundled, plugins and their status",
        description="List the environments the registry knows (bundled ones and plugins of the entry-point "
        "group harness.environments), loading each to show its version and description; a plugin that "
        "fails to load is listed with its error and makes the command exit with 1.",
    )
    show = envs_commands.add_parser("show", help="an environment's manifest and its tools with their schemas")
    show.add_argument("name", help="the environment's registry name")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options
        from harness.recipes.demo import main as run_demo

        return run_demo(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from harness import __version__

        print(f"agent-harness {__version__}")
        return 0
    if args.command == "serve":
        return run_serve(args)
    if args.command == "smoke":
        from harness.recipes.smoke import run_smoke

        return run_smoke(steps=args.steps, seed=args.seed)
    if args.command == "train":
        return _train(args)
    if args.command == "tools":
        return _tools_schema(args.targets)
    if args.command == "report":
        return _report(args)
    if args.command == "envs":
        return _envs_list() if args.envs_command == "list" else _envs_show(args.name)
    if args.command == "sandbox" and args.sandbox_command == "reap":
        return _sandbox_reap(args)
    if args.command == "sandbox":
        return _sandbox_build_image(args)
    parser.print_help()
    return 0


def _train(args: argparse.Namespace) -> int:
    import json
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from harness.train_config import TrainConfigError, run

    try:
        result = run(args.config, args.overrides, dry_run=args.dry_run)
    except TrainConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        from harness.training.processes import end_process_group

        end_process_group()  # under torchrun; nothing otherwise (and torch is not imported for it)
    if args.dry_run:
        print(json.dumps(result, indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    from harness.report import build_report

    try:
        path = build_report(args.run_dir, args.out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
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
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            schemas.append(function_schema(obj))
        except (ImportError, AttributeError, ToolError) as exc:
            print(f"error: {target}: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(schemas, indent=2, ensure_ascii=False))
    return 0


def _sandbox_build_image(args: argparse.Namespace) -> int:
    from sandboxes import image

    debootstrap_only = {"--suite": args.suite, "--mirror": args.mirror, "--package": args.package}
    if args.dockerfile or args.pull:
        given = [flag for flag, value in debootstrap_only.items() if value]
        if given:
            print(f"error: {', '.join(given)}: only for the debootstrap build", file=sys.stderr)
            return 2

    def log(message: str) -> None:
        print(message, file=sys.stderr)  # progress on stderr: stdout carries only the image name

    try:
        if args.dockerfile:
            name = image.build_from_dockerfile(args.dockerfile, args.tag, nocache=args.force)
        elif args.pull:
            name = image.pull_image(args.pull, tag=args.tag)
        else:
            name = image.build_base_image(
                args.tag,
                suite=args.suite or image.DEFAULT_SUITE,
                mirror=args.mirror or image.DEFAULT_MIRROR,
                extra_packages=args.package,
                force=args.force,
                log=log,
            )
    except image.ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(name)
    return 0


def _envs_list() -> int:
    from environments import EnvironmentsError, entries, load_manifest

    failed = 0
    for entry in entries():
        try:
            manifest = load_manifest(entry.name)
        except EnvironmentsError as exc:
            failed += 1
            print(f"{entry.name:<20} ERROR  {entry.source}: {str(exc).splitlines()[0]}")
            continue
        print(f"{entry.name:<20} {manifest.version:<8} {entry.source:<24} {manifest.description}")
    return 1 if failed else 0


def _envs_show(name: str) -> int:
    import json

    from environments import EnvironmentsError, load_manifest
    from environments.base import environment_class, tool_method_names
    from environments.registry import load
    from tools import Tool
    from tools.sandboxed import SandboxTools

    try:
        manifest = load_manifest(name)
        cls = environment_class(load(name))
    except EnvironmentsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sandbox_tools = SandboxTools(cast(Any, None)).toolset()  # unbound: only their schemas are printed
    schemas = [Tool.from_callable(getattr(cls, method)).schema for method in tool_method_names(cls, manifest)]
    schemas += [sandbox_tools[tool].schema for tool in manifest.sandbox_tools]
    print(json.dumps({"manifest": manifest.summary(), "tools": schemas}, indent=2))
    return 0


def _sandbox_reap(args: argparse.Namespace) -> int:
    from sandboxes import errors
    from sandboxes.reaper import reap_containers, reap_local_cgroups, reap_local_dirs, reap_local_executors

    verb = "would remove" if args.dry_run else "removed"
    for pid in reap_local_executors(dry_run=args.dry_run):
        print(f"{'would kill' if args.dry_run else 'killed'} local sandbox executor (pid {pid})")
    for path in reap_local_dirs(dry_run=args.dry_run):
        print(f"{verb} local sandbox directory {path}")
    for path in reap_local_cgroups(dry_run=args.dry_run):
        print(f"{verb} local sandbox control group {path}")
    if args.no_docker:
        return 0
    from sandboxes.engine import docker_client, engine_name

    older_than_s = None if args.other_hosts_older_than is None else args.other_hosts_older_than * 3600
    status = 0
    for url in args.engine or [""]:
        try:
            names = reap_containers(
                docker_client(url), dry_run=args.dry_run, other_hosts_older_than_s=older_than_s
            )
        except errors.EngineUnavailable as exc:
            print(f"containers: skipped, {exc}", file=sys.stderr)
            status = 1
            continue
        for name in names:
            print(f"{verb} container {name} on {engine_name(url)}")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""`harness serve MODEL`: the built-in generation server's command line.

Who talks to it: `harness/cli.py` adds the subcommand with `add_serve_command` and dispatches to
`run_serve`; `python -m harness.server` (what `launch.py` runs) calls `main`. Nothing heavy is imported
until `run_serve`, so `harness --help` stays instant. Flags follow `ServerConfig` (and vLLM's names).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_OR_PATH", help="Hugging Face model folder to serve")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default: 8000)")
    parser.add_argument("--port-file", metavar="PATH", help="write the bound port to PATH once listening")
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="model name clients send (default: MODEL)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda if available, else cpu), cpu, cuda or cuda:N (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and KV dtype; auto: the checkpoint's on GPU, float32 on CPU (default: auto)",
    )
    parser.add_argument(
        "--max-model-len", type=int, metavar="N", help="longest prompt + completion (default: the model's)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests decoded together (default: 256)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="most prompt tokens per prefill step (default: 8192)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        metavar="N",
        help="KV-cache budget in tokens (default: half the free device memory; CPU: of available RAM)",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: torch's choice; the trainer gives a CPU server half the cores)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the keys of prompt prefixes seen before, as vLLM does (default: on)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run every forward eagerly instead of replaying decode steps from CUDA graphs",
    )
    parser.add_argument(
        "--compile-blocks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile each decoder layer's norms and MLPs (default: on a GPU unless --enforce-eager; with "
        "--enable-lora the MLPs stay eager)",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="compile each decoder layer whole but its attention (norms, projections, rotary embedding, "
        "residuals, MLP), instead of its norms and MLPs alone; not with --enable-lora",
    )
    parser.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="multiply by each attention's q/k/v weights, and each MLP's gate/up weights, at once (default: "
        "on a GPU; never with --enable-lora)",
    )
    parser.add_argument(
        "--scheduler-delay-factor",
        type=float,
        default=None,
        metavar="F",
        help="while requests decode, admit new ones once the oldest has waited F x a recent prefill's "
        "time, so arrivals share a prefill; 0 (the default) admits at every step",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step before reading the previous one's tokens (default: on a GPU unless "
        "--enforce-eager)",
    )
    parser.add_argument(
        "--max-logprobs", type=int, default=20, help="largest top-k logprobs per token (default: 20)"
    )
    parser.add_argument("--enable-lora", action="store_true", help="accept LoRA adapters at run time")
    parser.add_argument("--max-loras", type=int, default=8, help="most adapters loaded at once (default: 8)")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank (default: 64)")
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=0,
        metavar="N",
        help="processes serving HTTP beside the engine's, as vLLM's flag; 0: HTTP on a thread of the "
        "engine's process (default: 0)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        metavar="MS",
        help="the process's GIL switch interval: how long the engine thread may wait for the GIL while the "
        "HTTP thread runs Python (default: Python's, 5 ms; 0.5 and 0.1 were slower on an H100)",
    )
    parser.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started the server dies"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")


def add_serve_command(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` to the `harness` subcommands; returns its parser."""
    parser = commands.add_parser(
        "serve",
        help="serve a model over vLLM's HTTP protocol (the built-in generation server)",
        description=(
            "Serve a transformers model on CPU or one GPU with continuous batching, speaking the subset of "
            "vLLM's HTTP protocol the trainer uses: /v1/completions with token ids, processed log-probs, "
            "top-k "
            "log-probs and seeds; /v1/models, /health, /metrics; pause and resume; weight updates; LoRA."
        ),
    )
    _configure_parser(parser)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit status."""
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from harness.server.app import serve
    from harness.server.state import ServerConfig

    try:
        config = ServerConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_tokens=args.kv_cache_tokens,
            num_threads=args.num_threads,
            enable_prefix_caching=args.enable_prefix_caching,
            enforce_eager=args.enforce_eager,
            compile_blocks=args.compile_blocks,
            compile_layers=args.compile_layers,
            fuse_projections=args.fuse_projections,
            scheduler_delay_factor=args.scheduler_delay_factor,
            async_scheduling=args.async_scheduling,
            max_logprobs=args.max_logprobs,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            exit_with_parent=args.exit_with_parent,
            api_server_count=args.api_server_count,
            switch_interval_ms=args.switch_interval_ms,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.server", description="The built-in generation server."
    )
    _configure_parser(parser)
    return run_serve(parser.parse_args(argv))

"""The generation side of a trainer run: what `AsyncGRPOTrainer.train()` starts around its training loop.

Three steps, in this order (`train()` enters them on an ExitStack, which stops them in the reverse one):

    generation_server     every process enters it; rank 0 gets the servers' base URLs: the configured ones
                          (vllm_server_base_url: one or several), or that of a built-in server
                          (harness/server/launch.py) it starts when the config says "builtin", or "auto" and
                          not every configured server answers /health. A built-in server loads
                          `model_path`, or, for a model object or a resumed run, the current weights (LoRA
                          merged in) from a temporary folder (`saved_model_for_server`; every process helps
                          gather them under FSDP2)
    open_weight_sync      every process: rank 0 chooses how the policy reaches the server from its
                          /server_info (harness/weight_sync/plan.py) and broadcasts the plan; each process
                          builds and starts its part of the strategy
    start_rollout_worker  rank 0: the rollout worker process (harness/rollout/worker.py) running `loop_cls`
                          against the server, from the first prompt not yet trained on, at the current policy
                          version and token allowance, its routers sharing the record of live servers
                          (`ServerStates`) with the trainer's ClientThread

Each takes what it needs as arguments; none keeps state of its own. Who talks to it: AsyncGRPOTrainer
(harness/training/trainer.py), and tests that start one step alone.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from harness.config import AsyncGRPOConfig
from harness.generation.router import server_urls
from harness.generation.server_states import ServerStates
from harness.rollout.sharing import share_of
from harness.rollout.worker import RolloutWorker
from harness.training.processes import Processes
from harness.weight_sync.plan import build_weight_sync, dtype_mismatch, plan_weight_sync_for_servers
from harness.weight_sync.strategies import WeightSync

log = logging.getLogger(__name__)


@contextlib.contextmanager
def generation_server(
    args: AsyncGRPOConfig,
    processes: Processes,
    model: Any,
    tokenizer: Any,
    *,
    model_path: str | None,
    current_weights: bool,
) -> Iterator[list[str]]:
    """Rank 0: the servers' base URLs, the configured ones or that of a built-in server it starts; [] on
    the other processes. A built-in server loads `model_path` unless it is None or `current_weights` (a
    resumed run): then the model's weights, from a folder every process helps write."""
    from harness.server.launch import open_generation_server

    urls = server_urls(args.vllm_server_base_url)
    builtin = processes.broadcast(
        (
            args.generation_server == "builtin"
            or (args.generation_server == "auto" and not all(_answers(url) for url in urls))
        )
        if processes.is_main
        else None
    )
    device = args.builtin_server_device or ("cuda" if torch.cuda.is_available() else "cpu")
    with contextlib.ExitStack() as stack:
        if builtin and (model_path is None or current_weights):
            model_path = stack.enter_context(saved_model_for_server(model, tokenizer, processes))
        server_threads = None
        if builtin and device == "cpu" and _on_cpu(model):
            server_threads = stack.enter_context(split_cpu_threads(processes))
        base_urls: list[str] = []
        if processes.is_main:
            for url in [None] if builtin else urls:  # one log line per server
                server = open_generation_server(
                    url,
                    model=model_path,
                    device=device,
                    max_model_len=args.builtin_server_max_model_len,
                    num_threads=server_threads,
                )
                base_urls.append(stack.enter_context(server))
        yield base_urls


@contextlib.contextmanager
def split_cpu_threads(processes: Processes) -> Iterator[int | None]:
    """A built-in server on the CPU the training processes use: half the cores for the server, the rest
    shared by this host's training processes, instead of each taking every core (on the demo's two cores,
    a GRPO step's forward and backward took 3x as long while the server generated beside it). Yields the
    server's thread count; None, changing nothing, when OMP_NUM_THREADS says how to place threads or there
    is one core. The trainer's thread count is restored at exit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if "OMP_NUM_THREADS" in os.environ or cores < 2:
        yield None
        return
    server_threads = cores // 2
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", processes.world_size))
    before = torch.get_num_threads()
    training_threads = max(1, (cores - server_threads) // max(1, local_processes))
    torch.set_num_threads(training_threads)
    if processes.is_main:
        log.info(
            "CPU threads: %d for the built-in server, %d for each of %d training processes (of %d cores)",
            server_threads,
            training_threads,
            local_processes,
            cores,
        )
    try:
        yield server_threads
    finally:
        torch.set_num_threads(before)


def _on_cpu(model: Any) -> bool:
    parameter = next(iter(model.parameters()), None)
    return parameter is None or parameter.device.type == "cpu"


@contextlib.contextmanager
def saved_model_for_server(model: Any, tokenizer: Any, processes: Processes) -> Iterator[str]:
    """The current weights (LoRA merged in) in a temporary folder on rank 0 for a built-in server to load;
    "" on the other processes. A collective under FSDP2: every process joins the gather of each bucket of
    weights, which rank 0 receives."""
    from harness.weight_sync.peft import merged_named_parameters

    directory = tempfile.mkdtemp(prefix="agent-harness-model-") if processes.is_main else ""
    try:
        state = {}
        for name, tensor in merged_named_parameters(model):
            if processes.is_main:
                state[name] = tensor.to("cpu")
        if processes.is_main:
            base = model.get_base_model() if hasattr(model, "peft_config") else model
            base.save_pretrained(directory, state_dict=state)
            tokenizer.save_pretrained(directory)
        del state
        yield directory
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def compute_dtype(args: AsyncGRPOConfig, model: Any) -> str:
    """The dtype the trainer computes log-probs in: bf16/fp16 autocast when set, else the weights'."""
    if args.bf16:
        return "bfloat16"
    if args.fp16:
        return "float16"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def open_weight_sync(
    args: AsyncGRPOConfig,
    processes: Processes,
    model: Any,
    client: Any,
    *,
    base_urls: Sequence[str],
    version: int,
) -> WeightSync:
    """Choose (rank 0, from every server's /server_info; `client` is its ClientThread, None elsewhere) and
    start the weight-sync strategy, on every rank. The caller closes it."""
    plan = None
    if processes.is_main:
        servers = client.call("server_infos")
        plan = plan_weight_sync_for_servers(model, servers, max_staleness=args.max_staleness)  # logs why
        for url, info in servers:
            warning = dtype_mismatch(compute_dtype(args, model), info)
            if warning is not None:
                log.warning("%s: %s", url, warning)
    plan = processes.broadcast(plan)
    sync = build_weight_sync(
        plan,
        server=client if processes.is_main else None,
        is_main=processes.is_main,
        world_size=processes.world_size,
        output_dir=args.output_dir,
        max_staleness=args.max_staleness,
        device=args.device,
        base_url=base_urls[0] if base_urls else "",
        deltas=args.weight_sync_deltas,
    )
    try:
        sync.start(model, version)
    except BaseException:
        sync.close()
        raise
    return sync


def start_rollout_worker(
    args: AsyncGRPOConfig,
    loop_cls: type,
    loop_kwargs: dict[str, Any],
    *,
    base_urls: Sequence[str],
    model_name: str,
    tokenizer: Any,
    model: Any,
    weight_sync: WeightSync | None,
    start_position: int,
    skip_positions: Sequence[int] = (),
    version: int,
    token_allowance: int,
    server_states: ServerStates | None = None,
) -> RolloutWorker:
    """Rank 0: spawn the worker running `loop_cls(**loop_kwargs, ...)` against the servers at `base_urls`,
    from prompt position `start_position` (skipping `skip_positions`, done already), at policy `version`,
    sharing `server_states` (the trainer's router's) with it. The caller stops it."""
    worker_args = copy.copy(args)
    worker_args.vllm_server_base_url = list(base_urls)
    processes = args.num_rollout_workers
    if processes > 1:  # the limits are totals: each worker process gets its share
        worker_args.max_concurrent_rollouts = share_of(args.max_concurrent_rollouts, processes)
        if args.sandbox_min_idle:
            worker_args.sandbox_min_idle = share_of(args.sandbox_min_idle, processes)
        worker_args.sandbox_engine_max_sandboxes = share_of(args.sandbox_engine_max_sandboxes, processes)
    kwargs: dict[str, Any] = {
        **loop_kwargs,
        "config": worker_args,
        "model_name": model_name,
        "processing_class": tokenizer,
        "eos_token_ids": eos_token_ids(tokenizer, model),
        "dataset_start_index": start_position,
        "dataset_skip_positions": list(skip_positions),
    }
    prefix = weight_sync.adapter_prefix if weight_sync is not None else None
    if prefix is not None:  # adapter sync: the worker names the newest version it knows
        kwargs["lora_name_prefix"] = prefix
    worker = RolloutWorker(
        loop_cls,
        kwargs,
        heartbeat_timeout_s=args.rollout_worker_timeout,
        initial_token_allowance=token_allowance,
        num_processes=processes,
        server_states=server_states,
    )
    worker.start()
    worker.set_model_version(version)
    return worker


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS, the model config's, and ChatML's <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(model.config, "eos_token_id", None)
    ids |= set(config_eos) if isinstance(config_eos, list) else {config_eos}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=2):
            return True
    except OSError:
        return False


__all__ = [
    "eos_token_ids",
    "generation_server",
    "open_weight_sync",
    "saved_model_for_server",
    "start_rollout_worker",
]

"""The generation side of a trainer run: what `AsyncGRPOTrainer.train()` starts around its training loop.

`GenerationSideMixin`, which the trainer inherits, starts three things, in this order (`train()` stops them
in the reverse one):

    _generation_server   every process enters it; rank 0 gets the server's base URL: the configured one, or
                         that of a built-in server (harness/server/launch.py) it starts when the config says
                         "builtin", or "auto" and nothing answers /health at the URL. A built-in server loads
                         `model_path`, or, for a model object or a resumed run, the current weights (LoRA
                         merged in) from a temporary folder (`_saved_model_for_server`; every process helps
                         gather them under FSDP2)
    _open_weight_sync    every process: rank 0 chooses how the policy reaches the server from its
                         /server_info (harness/weight_sync/plan.py) and broadcasts the plan; each
                         process builds and starts its part of the strategy
    _start_worker        rank 0: the rollout worker process (harness/rollout/worker.py) running `loop_cls`
                         against the server, from the first prompt not yet trained on, at the current
                         policy version and token allowance

Who talks to it: AsyncGRPOTrainer (harness/training/trainer.py). The mixin uses the transformers.Trainer's
model, processing_class, train_dataset, args and state, and the trainer's `_is_main`, `_broadcast`, `_client`
(rank 0's generation client), `_weight_sync`, `_token_allowance`, `model_path`, `model_version`,
`trained_frontier`, `loop_cls`, `reward_funcs`, `tools` and `environment_factory`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from harness.config import AsyncGRPOConfig
from harness.rollout.worker import RolloutWorker
from harness.weight_sync.plan import build_weight_sync, plan_weight_sync
from harness.weight_sync.strategies import WeightSync


class GenerationSideMixin:
    """The generation server, weight sync and rollout worker of a run (see the module docstring)."""

    @contextlib.contextmanager
    def _generation_server(self) -> Iterator[str]:
        """Rank 0: the server's base URL, the configured one or that of a built-in server it starts; "" on the
        other processes. Every process enters it: a built-in server on other weights than `model_path`'s (a
        model object, a resumed run) loads a folder that every process helps write."""
        from harness.server.launch import open_generation_server

        args: AsyncGRPOConfig = self.args
        url = args.vllm_server_base_url
        builtin = self._broadcast(
            (args.generation_server == "builtin" or (args.generation_server == "auto" and not _answers(url)))
            if self._is_main
            else None
        )
        with contextlib.ExitStack() as stack:
            model_path = self.model_path
            if builtin and (model_path is None or self.state.global_step or self.model_version):
                model_path = stack.enter_context(self._saved_model_for_server())
            base_url = ""
            if self._is_main:
                base_url = stack.enter_context(
                    open_generation_server(
                        None if builtin else url,
                        model=model_path,
                        device=args.builtin_server_device or ("cuda" if torch.cuda.is_available() else "cpu"),
                        max_model_len=args.builtin_server_max_model_len,
                    )
                )
            yield base_url

    @contextlib.contextmanager
    def _saved_model_for_server(self) -> Iterator[str]:
        """The current weights (LoRA merged in) in a temporary folder on rank 0 for a built-in server to load;
        "" on the other processes. A collective under FSDP2: every process gathers each parameter in turn."""
        from harness.weight_sync.peft import merged_named_parameters

        directory = tempfile.mkdtemp(prefix="agent-harness-model-") if self._is_main else ""
        try:
            state = {}
            for name, tensor in merged_named_parameters(self.model):
                if self._is_main:
                    state[name] = tensor.to("cpu")
            if self._is_main:
                base = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model
                base.save_pretrained(directory, state_dict=state)
                self.processing_class.save_pretrained(directory)
            del state
            yield directory
        finally:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)

    def _open_weight_sync(self, base_url: str) -> WeightSync:
        """Choose (rank 0, from the server's /server_info) and start the weight-sync strategy, every rank."""
        args: AsyncGRPOConfig = self.args
        plan = None
        if self._is_main:
            plan = plan_weight_sync(
                self.model, self._client.server_info(), base_url=base_url, max_staleness=args.max_staleness
            )  # logs its choice and why
        plan = self._broadcast(plan)
        sync = build_weight_sync(
            plan,
            server=self._client if self._is_main else None,
            is_main=self._is_main,
            world_size=args.world_size,
            output_dir=args.output_dir,
            max_staleness=args.max_staleness,
            device=self.args.device,
            base_url=base_url,
        )
        try:
            sync.start(self.model, self.model_version)
        except BaseException:
            sync.close()
            raise
        return sync

    def _start_worker(self, base_url: str) -> RolloutWorker:
        args: AsyncGRPOConfig = self.args
        worker_args = _replace(args, vllm_server_base_url=base_url)
        eos_ids = _eos_token_ids(self.processing_class, self.model)
        loop_kwargs: dict[str, Any] = {}
        prefix = self._weight_sync.adapter_prefix if self._weight_sync else None
        if prefix is not None:  # adapter sync: the worker names the newest version it knows
            loop_kwargs["lora_name_prefix"] = prefix
        worker = RolloutWorker(
            self.loop_cls,
            {
                **loop_kwargs,
                "config": worker_args,
                "model_name": self._client.model_id(),
                "dataset": self.train_dataset,
                "reward_funcs": self.reward_funcs,
                "processing_class": self.processing_class,
                "eos_token_ids": eos_ids,
                "tools": self.tools,
                "environment_factory": self.environment_factory,
                "dataset_start_index": self.trained_frontier,
            },
            heartbeat_timeout_s=args.rollout_worker_timeout,
            initial_token_allowance=self._token_allowance(),
        )
        worker.start()
        worker.set_model_version(self.model_version)
        return worker


def _eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(model.config, "eos_token_id", None)
    ids |= set(config_eos) if isinstance(config_eos, list) else {config_eos}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=2):
            return True
    except OSError:
        return False


def _replace(args: AsyncGRPOConfig, **changes: Any) -> AsyncGRPOConfig:
    import copy

    clone = copy.copy(args)
    for key, value in changes.items():
        setattr(clone, key, value)
    return clone


__all__ = ["GenerationSideMixin"]

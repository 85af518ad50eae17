"""AsyncGRPOTrainer: asynchronous GRPO, with generation in a worker process and training here.

    trainer = AsyncGRPOTrainer(model="path/to/model", reward_funcs=accuracy_reward, train_dataset=dataset)
    trainer.train()

What `train()` does, in order (the step itself is `_train_step` with `_train_on_plan`, readable in one place):

    start the generation server (the configured URL, or the built-in server on the model), the weight sync
        and the rollout worker (a spawned process running `loop_cls`, see harness/rollout/loop.py), each a
        function of harness/training/generation_side.py
    repeat until max_steps, or until num_train_epochs passes over the prompts are trained on:
        pull group results until a step's rows are full, dropping samples more than max_staleness
            versions old
        plan the rows (harness/packing.py), forward each row with tree attention, take the loss on the
            trained tokens (harness/training/loss.py), backward; one optimizer step
        every weight_sync_steps: push the policy to the server (harness/weight_sync/: a LoRA adapter, or
            merged weights through a file or a broadcast; a dropped server that answers again takes it
            too, and only then is routed to again), bump the policy version
        raise the worker's token allowance; log; checkpoint (harness/training/checkpointing.py)
    stop the worker (its environments and sandboxes close), then the server

The trainer extends `transformers.Trainer` for what that does well (optimizer and scheduler creation,
callbacks, report_to integrations, model saving); the training loop is its own. Several processes
(`accelerate launch` / `torchrun`): rank 0 runs the worker and the server and feeds every rank its rows
(`Processes`, harness/training/processes.py); the policy is sharded over the processes with FSDP2
(harness/training/fsdp.py), whose reduce-scatter sums the rows' gradients; the weight sync gathers one full
parameter at a time for rank 0 to send. Every process also helps write what rank 0 alone saves: the folder
a built-in server starts on (for a model object or a resumed run) and each checkpoint. The run's counters
(policy version, resume position, tokens) are one `RunCounters`; what a checkpoint holds and how a run
resumes from it, on any number of processes, is harness/training/checkpointing.py (the `Checkpointer` this
trainer holds).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, Trainer
from transformers.trainer_utils import TrainOutput

from environments.routing import check_routes, resolve_environments
from harness.compiled_blocks import compile_blocks
from harness.config import AsyncGRPOConfig
from harness.generation.client_thread import ClientThread
from harness.generation.router import server_urls
from harness.generation.server_states import ServerStates
from harness.metrics import MetricsWindow
from harness.model_loading import freeze_outside_text_model, load_model, outside_text_modules
from harness.packing import batch_metrics, pack_row, pair_weight_for_config, plan_micro_batches
from harness.rollout.loop import AsyncRolloutLoop
from harness.rollout.worker import check_main_guard, refuse_in_worker_bootstrap
from harness.training.attention import prepare_model_for_tree_attention
from harness.training.checkpointing import (
    Checkpointer,
    RunCounters,
    checkpoint_directory,
    load_weights_before_sharding,
)
from harness.training.flops import device_peak_flops, training_flops
from harness.training.generation_side import generation_server, open_weight_sync, start_rollout_worker
from harness.training.ledger import PromptLedger
from harness.training.loss import LossConfig, fused_policy_loss
from harness.training.moe import router_aux_loss, router_aux_loss_coef
from harness.training.processes import Processes, end_process_group
from harness.training.rollout_log import ROLLOUTS_DIR, RolloutLog, completions_table
from harness.types import TrainingSample, TrainingSequence
from harness.weight_sync.plan import check_no_lm_head_adapter
from harness.weight_sync.strategies import WeightSync

log = logging.getLogger(__name__)


class AsyncGRPOTrainer(Trainer):
    """Asynchronous GRPO trainer (the reference's constructor; see the module docstring)."""

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    # set by train() (and _setup_run) for the run, read by the step
    control: Any
    _weight_sync: WeightSync | None
    _client: ClientThread | None
    _token_budget: int | None

    _rollout_log: RolloutLog | None = None

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
    ):
        refuse_in_worker_bootstrap()  # a training script without a main guard, re-run by the worker
        args = args or AsyncGRPOConfig(output_dir="async-grpo-output")
        model_path = model if isinstance(model, str) else None
        if isinstance(model, str):
            init_kwargs = dict(_as_dict(args.model_init_kwargs))
            init_kwargs.setdefault("dtype", _torch_dtype(args.dtype))
            init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            model = load_model(model, **init_kwargs)  # a vision-language checkpoint as one, see below
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_path or model.config._name_or_path, trust_remote_code=args.trust_remote_code
            )
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        processing_class.padding_side = "left"
        frozen = freeze_outside_text_model(model)  # a vision-language policy trains its text model only
        if frozen:
            log.info("vision-language model: %d parameters outside the text model are frozen", len(frozen))
        if peft_config is not None:
            model = _apply_peft(model, peft_config, frozen)
        for config in (getattr(model, "peft_config", None) or {}).values():
            check_no_lm_head_adapter(config)  # also for a model wrapped before it got here
        if args.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        prepare_model_for_tree_attention(model)
        compile_on = args.device.type == "cuda" if args.compile_blocks is None else args.compile_blocks
        if compile_on:  # compiled at first use: in the warm-up, before the first step
            log.info("compile_blocks: %d norms and MLPs to compile at first use", len(compile_blocks(model)))
        # resolved once: a coefficient set for a dense model raises here, before anything starts
        self.router_aux_loss_coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)

        if reward_funcs is None:
            reward_funcs = []
        elif callable(reward_funcs):
            reward_funcs = [reward_funcs]
        self.reward_funcs = list(reward_funcs)
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.environments = resolve_environments(environment_factory)
        if train_dataset is None and not self.environments:
            raise ValueError("train_dataset is required unless an environment_factory provides the prompts")
        if train_dataset is None and args.max_steps <= 0:
            raise ValueError("without a train_dataset the environment owns the data: set max_steps > 0")
        if not self.reward_funcs and not any(e.reward_names for e in self.environments.values()):
            raise ValueError("no reward: pass reward_funcs, or an environment that defines get_reward")
        if train_dataset is not None and self.environments:
            columns = getattr(train_dataset, "column_names", None) or []
            values = train_dataset["environment"] if "environment" in columns else None
            check_routes(columns, values, self.environments)
        self.model_path = model_path
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )

    # --- the run ----------------------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Run the whole loop (see the module docstring); returns the Trainer's TrainOutput."""
        args: AsyncGRPOConfig = self.args
        check_main_guard()  # before anything starts: the spawned worker re-imports the training script
        self._setup_run(resume_from_checkpoint)
        processes, counters = self.processes, self.counters
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._sigterm_stops_the_run())
            base_urls = stack.enter_context(  # every process: it may gather the weights for the server
                generation_server(
                    args,
                    processes,
                    self.model,
                    self.processing_class,
                    model_path=self.model_path,
                    current_weights=bool(self.state.global_step or counters.model_version),
                )
            )
            client = server_states = None
            if processes.is_main:  # one record of live servers for its router and the workers'
                server_states = ServerStates.shared(server_urls(base_urls))
                client = stack.enter_context(
                    ClientThread(base_urls, args.vllm_server_timeout, server_states=server_states)
                )
                self._token_budget = args.token_budget or client.max_model_len()
            self._client = client
            self._token_budget = processes.broadcast(self._token_budget)
            self._weight_sync = open_weight_sync(
                args, processes, self.model, client, base_urls=base_urls, version=counters.model_version
            )
            stack.callback(self._weight_sync.close)  # after the worker stopped: it may use the adapters
            if processes.is_main:
                assert client is not None
                self.worker = start_rollout_worker(
                    args,
                    self.loop_cls,
                    self._loop_kwargs(),
                    base_urls=base_urls,
                    model_name=client.model_id(),
                    tokenizer=self.processing_class,
                    model=self.model,
                    weight_sync=self._weight_sync,
                    start_position=counters.trained_position,
                    skip_positions=counters.done_positions,
                    version=counters.model_version,
                    token_allowance=self._token_allowance(),
                    server_states=server_states,
                )
                stack.callback(self.worker.stop)
                if args.save_rollouts:
                    self._rollout_log = stack.enter_context(
                        RolloutLog(
                            Path(args.output_dir) / ROLLOUTS_DIR,
                            file_bytes=int(args.rollouts_file_mb * 2**20),
                            max_files=args.rollouts_max_files,
                        )
                    )
            self.window.add("perf/warmup_s", self._warm_up())  # while the worker makes its first groups
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
            losses = []
            while not self._done():
                step_metrics = self._train_step()
                if step_metrics is None:  # SIGTERM while rank 0 waited for samples
                    break
                losses.append(step_metrics.get("loss", math.nan))
                self.state.global_step += 1
                self._after_step(step_metrics)
            if self._stopping:
                self._stop_after_sigterm()
            self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        # leave together: a process that exits while rank 0 still stops the worker and the server can crash
        # in NCCL's watchdog thread at interpreter exit (seen on 2 H200s)
        processes.barrier()
        mean_loss = float(sum(losses) / len(losses)) if losses else math.nan
        return TrainOutput(self.state.global_step, mean_loss, {"train_loss": mean_loss})

    def _setup_run(self, resume_from_checkpoint: str | bool | None) -> None:
        args: AsyncGRPOConfig = self.args
        self.processes = Processes(rank=args.process_index, world_size=args.world_size)
        if args.world_size > 1:  # once per process: destroy the group and let gloo's threads settle at exit
            atexit.unregister(end_process_group)
            atexit.register(end_process_group)
        checkpoint = None
        if resume_from_checkpoint:
            checkpoint = checkpoint_directory(args.output_dir, resume_from_checkpoint)
        if args.world_size > 1:
            self._shard_model(checkpoint)
        self.create_optimizer_and_scheduler(num_training_steps=max(args.max_steps, 1))
        self.checkpointer = Checkpointer(
            output_dir=args.output_dir,
            processes=self.processes,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            tokenizer=self.processing_class,
            args=args,
            save_model=self.save_model,
            load_model=self._load_from_checkpoint,
        )
        self.loss_config = LossConfig(
            score_centering=args.score_centering,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            vllm_importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=args.vllm_importance_sampling_clip_max,
        )
        self.counters = RunCounters()
        self._stopping = False  # a SIGTERM came (preemption): stop after the step, checkpoint if configured
        self._last_saved_step = -1
        self._num_parameters = sum(parameter.numel() for parameter in self.model.parameters())
        self._peak_flops = device_peak_flops(torch.device(args.device), half_precision=args.bf16 or args.fp16)
        self._weight_sync = None
        self._client = None
        self._token_budget = None
        self.pending: list[TrainingSample] = []
        self.window = MetricsWindow()
        self._rollout_log = None  # opened by train() under save_rollouts
        self._completions: collections.deque[dict[str, Any]] = collections.deque(maxlen=1024)
        self._finished_worker = False
        self.state.global_step = 0
        self.state.max_steps = args.max_steps if args.max_steps > 0 else 0
        self.pair_weight = pair_weight_for_config(self.model.config)
        if checkpoint is not None:
            self.counters, self.state.global_step = self.checkpointer.load(checkpoint)
            self._last_saved_step = self.state.global_step
            # generated again after the resume: the samples of these already trained are trained twice
            self.window.add("resume/retrained_prompt_count", len(self.counters.retrained_positions))
        self.ledger = PromptLedger(self.counters)

    @property
    def _is_main(self) -> bool:
        return self.args.process_index == 0

    def _loop_kwargs(self) -> dict[str, Any]:
        """What the rollout loop is built with, beyond what the worker and the run add."""
        return {
            "dataset": self.train_dataset,
            "reward_funcs": self.reward_funcs,
            "tools": self.tools,
            "environment_factory": self.environment_factory,
        }

    def save_checkpoint(self) -> Path:
        """Write checkpoint-<global_step>/: weights, optimizer, scheduler and the run's counters."""
        self.ledger.snapshot()
        directory = self.checkpointer.save(self.state, self.counters)
        self._last_saved_step = self.state.global_step
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return directory

    def _shard_model(self, checkpoint: Path | None = None) -> None:
        """Several processes: shard the policy with FSDP2 (harness/training/fsdp.py), before the optimizer
        exists.

        An accelerate FSDP config chooses the settings (it must be `fsdp_version: 2`); without one, FSDP2 with
        the config's precision (bf16/fp16: float32 master weights, compute in the half type). Resuming, the
        checkpoint's weights are loaded first (`_load_weights_before_sharding`,
        harness/training/checkpointing.py).
        """
        from torch.distributed.device_mesh import init_device_mesh

        from harness.training.fsdp import (
            is_sharded,
            mixed_precision_policy,
            shard_model,
            use_float32_master_weights,
        )

        if is_sharded(self.model):
            if checkpoint is not None:
                raise ValueError(
                    "the model is already sharded, so a checkpoint can no longer be loaded into it: resume "
                    "with a new AsyncGRPOTrainer"
                )
            return
        if self.optimizer is not None:
            raise ValueError(
                "with several processes the trainer shards the model with FSDP2 and creates the optimizer "
                "afterwards: pass optimizers=(None, None)"
            )
        args: AsyncGRPOConfig = self.args
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        settings: dict[str, Any] = {"mp_policy": mixed_precision_policy(bool(args.bf16), args.fp16)}
        if plugin is not None:
            if getattr(plugin, "fsdp_version", 1) != 2:
                raise ValueError("sharded training uses FSDP2: set fsdp_version: 2 in the FSDP config")
            if plugin.mixed_precision_policy is not None:
                settings["mp_policy"] = plugin.mixed_precision_policy
            settings["reshard_after_forward"] = bool(plugin.reshard_after_forward)
            if not isinstance(plugin.cpu_offload, bool):
                settings["offload_policy"] = plugin.cpu_offload
        # the mesh on the trainer's device type: FSDP2's default mesh is CUDA's whenever a GPU is visible,
        # also for a CPU run (use_cpu=True)
        device = torch.device(self.args.device)
        self.model.to(device)
        if checkpoint is not None:
            use_float32_master_weights(self.model, settings["mp_policy"])  # saved float32 weights stay exact
            load_weights_before_sharding(self.model, checkpoint, self.processes)
        shard_model(self.model, mesh=init_device_mesh(device.type, (args.world_size,)), **settings)

    # --- one training step ----------------------------------------------------------------------------

    def _train_step(self) -> dict[str, float] | None:
        """Pull samples, drop the stale, plan rows, forward/backward each, step, sync, and report; None when
        a SIGTERM came while rank 0 waited for samples (no step was taken)."""
        args: AsyncGRPOConfig = self.args
        step_started = time.monotonic()
        # rank 0 plans every rank's rows; the prompts it has seen done set every rank's epoch
        planned = (self._plan_step(), self.counters.prompts_done) if self._is_main else None
        plan_rows, self.counters.prompts_done = self.processes.broadcast(planned)
        if plan_rows is None:
            self._stopping = True
            return None
        waited = time.monotonic() - step_started
        out = self._train_on_plan(plan_rows)
        if (self.state.global_step + 1) % args.weight_sync_steps == 0:
            out.update(self._sync_weights())  # only steps that synced: no zeros averaged in
        step_s = time.monotonic() - step_started
        forwarded, trained = plan_rows["forwarded_tokens"], plan_rows["trained_tokens"]
        out.update(plan_rows["metrics"])
        out.update(
            {
                "perf/step_s": step_s,
                "perf/rollout_wait_s": waited,
                "learning_rate": self.lr_scheduler.get_last_lr()[0],
            }
        )
        self.window.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, out["perf/fwd_bwd_s"])
        self.window.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        if self._peak_flops:  # each process's share of the arithmetic, over its peak
            share = training_flops(self._num_parameters, forwarded) / args.world_size / self._peak_flops
            self.window.add_rate("perf/fwd_bwd_mfu", share, out["perf/fwd_bwd_s"])
            self.window.add_rate("perf/wall_clock_mfu", share, step_s)
        self.window.add_rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        self.counters.num_tokens += forwarded
        out["num_tokens"] = self.counters.num_tokens
        return out

    def _train_on_plan(self, plan_rows: dict[str, Any]) -> dict[str, float]:
        """Forward/backward this process's rows of every micro-batch of a planned step, then step.

        `plan_rows["micro_batches"]` holds, per micro-batch, the rows of all processes (rank 0 planned
        them; `_plan_step`). A process trains rows `process_index, process_index + world_size, ...`: one
        row each in a real step, every row when one process is given a plan made for several. Each row's
        loss is normalised by the trained tokens of its whole micro-batch, over all rows, and by the number
        of micro-batches, so the gradients summed over rows, processes and micro-batches are the reference's
        mean, however the rows are spread over processes. A Mixture-of-Experts policy with a nonzero
        `router_aux_loss_coef` adds that times each row's load-balancing loss (harness/training/moe.py) over
        the step's number of rows, so the gradients sum to the coefficient times the rows' mean aux loss.
        Returns the step's loss (that sum, the same on every process) and the metrics of all rows.
        """
        args: AsyncGRPOConfig = self.args
        world, rank = args.world_size, args.process_index
        micro_batches = plan_rows["micro_batches"]
        self.model.train()
        fwd_bwd_started = time.monotonic()
        forward_s = 0.0
        metrics = MetricsWindow()
        step_loss = torch.zeros((), dtype=torch.float64)
        num_rows = sum(len(micro_batch) for micro_batch in micro_batches)  # over all processes
        for micro_batch in micro_batches:
            trained_global = sum(sum(s.sequence.num_trained for s in row) for row in micro_batch)
            for samples in micro_batch[rank::world]:
                row = pack_row(samples).to(self.args.device)
                forward_started = time.monotonic()
                with self.compute_loss_context_manager():
                    hidden_T_H, router_logits_L = _decoder_forward(
                        self.model, row, output_router_logits=bool(self.router_aux_loss_coef)
                    )
                    output = fused_policy_loss(
                        hidden_T_H,
                        row,
                        _lm_head_weight(self.model),
                        self.loss_config,
                        num_trained_tokens_global=trained_global,
                        gradient_accumulation_steps=len(micro_batches),
                        temperature=args.temperature,
                    )
                    loss, aux_loss = output.loss, None
                    if router_logits_L is not None:
                        aux_loss = router_aux_loss(router_logits_L, self.model.config)
                        loss = loss + self.router_aux_loss_coef * aux_loss / num_rows
                forward_s += _seconds_since(forward_started, row.input_ids.device)
                # FSDP2 averages gradients over the processes; the normalisation above needs their sum
                self.accelerator.backward(loss * world)
                step_loss += loss.detach().double().cpu()
                for name, value in output.metrics.items():
                    metrics.add(name, float(value), weight=max(output.num_trained_tokens, 1))
                if aux_loss is not None:
                    metrics.add("aux_loss", float(aux_loss.detach()))  # unscaled, a mean over rows
        fwd_bwd_s = time.monotonic() - fwd_bwd_started
        optimizer_started = time.monotonic()
        if args.max_grad_norm:
            self.accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.monotonic() - optimizer_started
        if world > 1:
            step_loss, metrics = self._reduce_step_metrics(step_loss, metrics)
        out = metrics.summary()
        out.update(
            {
                "loss": float(step_loss),
                "perf/fwd_bwd_s": fwd_bwd_s,
                "perf/fwd_s": forward_s,
                "perf/optimizer_s": optimizer_s,
            }
        )
        return out

    def _warm_up(self) -> float:
        """One forward and backward of a small synthetic row on every process, gradients discarded, so
        that one-time costs (kernel selection, allocator growth, handles; flex_attention's compilation where
        it is used) are paid before the first step rather than inside it. Returns its seconds (logged)."""
        started = time.monotonic()
        vocab = int(self.model.get_output_embeddings().weight.shape[0])  # global, also as a DTensor
        prompt = [i % vocab for i in range(1, 65)]
        samples = [
            TrainingSample(
                sequence=TrainingSequence(
                    input_ids=prompt + [(7 * j + i) % vocab for i in range(32)],
                    loss_mask=[0] * 64 + [1] * 32,
                    old_log_probs=[0.0] * 96,
                    sampler_logprobs=[None] * 96,
                    sampling_mask=[None] * 96,
                ),
                advantage=1.0 if j % 2 else -1.0,
                group_id=0,
            )
            for j in range(2)
        ]
        row = pack_row(samples).to(self.args.device)
        self.model.train()
        with self.compute_loss_context_manager():
            hidden_T_H, _ = _decoder_forward(self.model, row, output_router_logits=False)
            output = fused_policy_loss(
                hidden_T_H, row, _lm_head_weight(self.model), self.loss_config, num_trained_tokens_global=64
            )
        self.accelerator.backward(output.loss * 0.0)  # the same kernels as a real backward, no update
        self.optimizer.zero_grad(set_to_none=True)
        seconds = _seconds_since(started, row.input_ids.device)
        log.info("warm-up forward and backward in %.1f s", seconds)
        return seconds

    def _reduce_step_metrics(
        self, step_loss: torch.Tensor, metrics: MetricsWindow
    ) -> tuple[torch.Tensor, MetricsWindow]:
        """Every process's rows: the loss summed, the row metrics merged (one object all-gather)."""
        import torch.distributed as dist

        states: list[Any] = [None] * self.args.world_size
        dist.all_gather_object(states, (float(step_loss), metrics.state()))
        merged = MetricsWindow()
        for _, state in states:
            merged.merge(state)
        return torch.tensor(math.fsum(loss for loss, _ in states), dtype=torch.float64), merged

    def _plan_step(self) -> dict[str, Any] | None:
        """Rank 0: gather fresh samples until a step's rows are full, and split them into rows for every rank.

        The rows are full when the kept samples overflow the step's micro-batches (some are left over for
        the next step). A step trains on less only when no more samples can come: the worker finished, or
        the token allowance holds generation with nothing in flight.
        """
        args: AsyncGRPOConfig = self.args
        window = self.window
        assert self._token_budget is not None  # train() sets it from the config or the server
        self._drop_stale_pending()
        nothing_coming, plan = False, None
        while True:
            if self._stopping:
                return None
            if plan is None:  # planned again only when samples arrived, not after each empty wait
                plan = plan_micro_batches(
                    self.pending,
                    num_rows=args.world_size,
                    token_budget=self._token_budget,
                    max_micro_batches=args.gradient_accumulation_steps,
                    pair_weight=self.pair_weight,
                )
            full = len(plan.micro_batches) >= args.gradient_accumulation_steps and bool(plan.leftover)
            if full or (plan.micro_batches and (self._finished_worker or nothing_coming)):
                break
            if self._finished_worker:
                if plan.dropped_oversize:
                    longest = max(len(self.pending[i].sequence.input_ids) for i in plan.dropped_oversize)
                    raise RuntimeError(
                        f"the rollout worker finished, and all {len(plan.dropped_oversize)} samples it sent "
                        f"are longer than a row's token_budget ({self._token_budget} tokens; the longest has "
                        f"{longest}): raise token_budget, or shorten prompts and max_completion_length"
                    )
                raise RuntimeError("the rollout worker finished before a single step's samples were ready")
            if nothing_coming:
                # too few samples to give every process a row, and the allowance holds the worker (a step
                # that trained a little, then a large group): let it produce past what is queued
                self.worker.set_token_allowance(
                    self._token_allowance() + math.ceil(_token_shares(self.pending))
                )
            held = self.worker.held  # read before pulling: a group that finished before it is in the queue
            pulled = self._pull(timeout_s=0.05 if held else 0.25)
            nothing_coming = not pulled and held
            if pulled:
                plan = None
        now = time.monotonic()
        micro_batches = []
        used: set[int] = set()
        for micro_batch in plan.micro_batches:
            ranks = []
            for row in micro_batch.rows:
                samples = [self.pending[i] for i in row.sample_indices]
                used.update(row.sample_indices)
                ranks.append(samples)
            micro_batches.append(ranks)
        stepped = [self.pending[i] for i in sorted(used)]
        dropped = [self.pending[i] for i in plan.dropped_oversize]
        used.update(plan.dropped_oversize)
        self.pending = [sample for i, sample in enumerate(self.pending) if i not in used]
        for sample in stepped:
            self.ledger.settled(sample, trained=True)
        for sample in dropped:
            self.ledger.settled(sample, trained=False)
        for sample in stepped:
            window.add("sample/time_in_queue_s", now - sample.queued_at)
            window.add("sample/staleness_mean", self.counters.model_version - sample.model_version)
            window.add("sample/staleness_max", self.counters.model_version - sample.model_version)
            window.add("sample/forwarded_tokens_mean", len(sample.sequence.input_ids))
            window.add("sample/forwarded_tokens_max", len(sample.sequence.input_ids))
            window.add("sample/trained_tokens_mean", sample.sequence.num_trained)
        # counted in the worker's unit (its GroupResult.num_tokens), so its allowance stays exact
        self.counters.last_step_tokens = _token_shares(stepped)
        self.counters.tokens_consumed += self.counters.last_step_tokens + _token_shares(dropped)
        metrics = batch_metrics(plan)
        forwarded = sum(row.num_tokens for mb in plan.micro_batches for row in mb.rows)
        trained = sum(row.num_trained for mb in plan.micro_batches for row in mb.rows)
        return {
            "micro_batches": micro_batches,
            "metrics": metrics,
            "forwarded_tokens": forwarded,
            "trained_tokens": trained,
        }

    def _drop_stale_pending(self) -> None:
        """Drop the samples left over from earlier steps that the updates since made too old: fresh when
        pulled, they must not train more than max_staleness versions behind (with 0, a sync run trains
        only on the current policy's samples)."""
        version, bound = self.counters.model_version, self.args.max_staleness
        stale = [sample for sample in self.pending if version - sample.model_version > bound]
        if not stale:
            return
        self.pending = [sample for sample in self.pending if version - sample.model_version <= bound]
        for sample in stale:
            self.ledger.settled(sample, trained=False)
        self.window.add("sample/dropped_stale_count", len(stale))
        self.counters.tokens_consumed += _token_shares(stale)
        self._raise_allowance()

    def _pull(self, timeout_s: float) -> bool:
        """Take a group result from the worker: keep fresh samples, drop the stale, track prompt positions.
        Returns whether a result came."""
        result = self.worker.get(timeout_s=timeout_s)
        if result is None:
            self._finished_worker = self.worker.finished
            return False
        fresh: list[TrainingSample] = []
        stale: list[TrainingSample] = []
        for sample in result.samples:
            sample.token_share = result.num_tokens / len(result.samples)
            sample.position = result.position
            is_stale = self.counters.model_version - sample.model_version > self.args.max_staleness
            (stale if is_stale else fresh).append(sample)
        self.ledger.opened(result.position, len(fresh))  # done at once when nothing is left to train
        if stale:
            self.window.add("sample/dropped_stale_count", len(stale))
            self.counters.tokens_consumed += _token_shares(stale)
            self._raise_allowance()  # dropped samples free their share of the allowance now
        self.pending += fresh
        self.window.add("rollout/queue_size", len(self.pending))
        if result.records:
            step = self.state.global_step + 1  # the step it is taken for
            if self._rollout_log is not None and result.position % self.args.save_rollouts_every == 0:
                self._rollout_log.write(result.records, step=step)
            if self.args.log_completions:
                self._completions.extend({**record, "step": step} for record in result.records)
        return True

    # --- after a step ---------------------------------------------------------------------------------

    def _after_step(self, step_metrics: dict[str, float]) -> None:
        args: AsyncGRPOConfig = self.args
        if self._is_main:
            self.worker.check()
            self._raise_allowance()
            for state in self.worker.drain_metrics():
                self.window.merge(state)
        self.window.add_many(step_metrics)
        dataset_size = len(self.train_dataset) if _sized(self.train_dataset) else 0
        if dataset_size:
            self.state.epoch = self.counters.prompts_done / dataset_size
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        if self.state.global_step % max(int(args.logging_steps), 1) == 0:
            # NaN means "nothing recorded this window" (e.g. fork_frac without multi-turn rollouts)
            self.log({k: v for k, v in self.window.summary().items() if not math.isnan(v)})
            self.window.reset()
            if args.log_completions and self._is_main:
                self._log_completions()
        if (
            args.save_strategy == "steps"
            and args.save_steps
            and self.state.global_step % int(args.save_steps) == 0
        ):
            self.save_checkpoint()

    def _log_completions(self) -> None:
        """Print the rollouts taken since the last logging step (the latest num_completions_to_print of
        them) and log them as a table to the report_to integrations that take one (wandb)."""
        records = list(self._completions)
        self._completions.clear()
        if self.args.num_completions_to_print is not None:
            records = (
                records[-self.args.num_completions_to_print :] if self.args.num_completions_to_print else []
            )
        if not records:
            return
        print(f"completions at step {self.state.global_step}:\n{completions_table(records)}", flush=True)
        report_to = self.args.report_to or []
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                columns = ["step", "prompt", "completion", "reward", "advantage", "rewards"]
                rows = [
                    [
                        r.get("step"),
                        json.dumps(r.get("prompt"), ensure_ascii=False),
                        json.dumps(r.get("completion"), ensure_ascii=False),
                        r.get("reward"),
                        r.get("advantage"),
                        json.dumps(r.get("rewards")),
                    ]
                    for r in records
                ]
                wandb.log(
                    {"completions": wandb.Table(columns=columns, data=rows)}, step=self.state.global_step
                )

    def _token_allowance(self) -> int:
        """What the worker may have produced in all: max(max_staleness, 1) steps' tokens beyond what was
        consumed (a step's tokens: the last step's, before the first one full rows)."""
        assert self._token_budget is not None
        step_tokens = self.counters.last_step_tokens or (
            self._token_budget * self.args.world_size * self.args.gradient_accumulation_steps
        )
        consumed = self.counters.tokens_consumed
        return math.ceil(consumed + max(self.args.max_staleness, 1) * max(step_tokens, 1))

    def _raise_allowance(self) -> None:
        self.worker.set_token_allowance(self._token_allowance())

    def _done(self) -> bool:
        args: AsyncGRPOConfig = self.args
        self._stopping = self.processes.any(self._stopping)  # a SIGTERM reached any process
        if self._stopping:
            return True
        if args.max_steps > 0:
            return self.state.global_step >= args.max_steps
        if not _sized(self.train_dataset):
            return bool(self.processes.broadcast(self._finished_worker and not self.pending))  # rank 0 knows
        target = math.ceil(args.num_train_epochs * len(self.train_dataset))
        done = self.counters.prompts_done >= target or (self._finished_worker and not self.pending)
        return bool(self.processes.broadcast(done))

    # --- preemption -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _sigterm_stops_the_run(self) -> Iterator[None]:
        """While training, SIGTERM (what Slurm and Kubernetes send before they kill) asks for a clean stop:
        the step in progress finishes, a checkpoint is written if checkpoints are configured, then the
        worker, its sandboxes and the server close as after a normal end. Only from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame: Any) -> None:
            log.warning("SIGTERM: stopping after the current step (a checkpoint is written if configured)")
            self._stopping = True

        previous = signal.signal(signal.SIGTERM, request_stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _stop_after_sigterm(self) -> None:
        args: AsyncGRPOConfig = self.args
        if args.save_strategy == "steps" and self._last_saved_step != self.state.global_step:
            directory = self.save_checkpoint()
            log.warning(
                "stopped by SIGTERM at step %d; checkpoint written to %s", self.state.global_step, directory
            )
        else:
            log.warning("stopped by SIGTERM at step %d", self.state.global_step)

    # --- weight sync -----------------------------------------------------------------------------------

    def _sync_weights(self) -> dict[str, float]:
        """Push the policy to the server as the next version, then bump it; the perf/weight_sync_* timings.

        The strategy (harness/weight_sync/) is the one `train()` opened (`open_weight_sync`); a caller that
        drives steps itself sets `self._weight_sync` first (tests/test_fsdp.py does).
        """
        if self._weight_sync is None:
            raise RuntimeError("no weight-sync strategy: train() opens one before the first step")
        timings = self._weight_sync.sync(self.model, self.counters.model_version + 1)
        self.counters.model_version += 1
        if self._is_main:
            self.worker.set_model_version(self.counters.model_version)
        return timings


# --- helpers ----------------------------------------------------------------------------------------------


def _seconds_since(started: float, device: torch.device) -> float:
    """Seconds since `started` once the device's queued work is done (GPU kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic() - started


def _token_shares(samples: Sequence[TrainingSample]) -> float:
    return math.fsum(sample.token_share for sample in samples)


def _decoder_forward(
    model: Any, row: Any, *, output_router_logits: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The row's hidden states, and the router logits of a MoE model when asked for (else None)."""
    from harness.training.attention import packed_forward

    if output_router_logits:
        return packed_forward(model, row, output_router_logits=True)
    return packed_forward(model, row), None


def _lm_head_weight(model: Any) -> torch.Tensor:
    """The LM head's weight for the log-prob head, read after the decoder's forward.

    Under FSDP2 (harness/training/fsdp.py) the head shares a group with the final norm that stays unsharded
    from the norm's forward until its post-backward, so this is the plain gathered parameter, and FSDP reduces
    the gradient the loss gives it. A still-sharded weight here means another layout, whose head gradient
    would not be reduced over the processes: refuse it rather than train unsynchronised heads.
    """
    weight = model.get_output_embeddings().weight
    if hasattr(weight, "full_tensor"):
        raise RuntimeError(
            "lm_head.weight is still sharded after the decoder's forward: shard the model with "
            "harness.training.fsdp.shard_model (the head in the final norm's group, kept unsharded until "
            "backward)"
        )
    return weight


def _apply_peft(model: Any, peft_config: Any, frozen: list[str]) -> Any:
    """Wrap the policy in LoRA; on a vision-language model, never in the frozen vision tower (unless the
    config names its own exclusions)."""
    import copy
    import re

    from peft import get_peft_model

    check_no_lm_head_adapter(peft_config)
    if frozen and getattr(peft_config, "exclude_modules", None) is None:
        towers = outside_text_modules(model)
        peft_config = copy.copy(peft_config)
        peft_config.exclude_modules = "|".join(rf"{re.escape(prefix)}(\..*)?" for prefix in towers)
    return get_peft_model(model, peft_config)


def _sized(dataset: Any) -> bool:
    return dataset is not None and hasattr(dataset, "__len__")


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        return json.loads(value)
    return dict(value)


def _torch_dtype(name: str) -> Any:
    return name if name == "auto" else getattr(torch, name)


__all__ = ["AsyncGRPOTrainer"]


def _enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing, by the current transformers name where it exists (the old
    name, gradient_checkpointing_enable, warns there and is all that transformers 5.17 has)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

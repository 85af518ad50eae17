"""AsyncGRPOConfig: the trainer's configuration, a `transformers.TrainingArguments` with the fields of
asynchronous GRPO.

The reference's fields keep their names, defaults and meaning; the fields after them (tools, sandboxes,
failures, the generation server choice) are where this harness goes further, each documented in place.
Cross-field problems raise `ValueError` naming the field to change.

Defaults that differ from TrainingArguments (as in the reference):
    logging_steps 1, gradient_checkpointing True, bf16 True unless fp16 (None means "decide"),
    learning_rate 1e-6, lr_scheduler_type "constant" (a decay horizon in optimizer steps is unknowable
    when forks make the step count data-dependent; set a decaying schedule with an explicit max_steps),
    ignore_data_skip True (the rollout queue cannot be replayed; resume restarts at the trained prompt
    position instead), remove_unused_columns False (every column reaches the reward functions).

Training length: num_train_epochs counts passes over the prompts (distinct prompts trained on, however
many samples forks produce); an explicit max_steps > 0 takes over and bounds optimizer steps instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainingArguments

from harness.generation.router import server_urls

GenerationServerMode = Literal["auto", "builtin", "external"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Configuration of `AsyncGRPOTrainer`; every field is documented in its `help` metadata."""

    # --- defaults that differ from TrainingArguments ---------------------------------------------------
    logging_steps: float = field(default=1, metadata=_help("Log every this many optimizer steps."))
    gradient_checkpointing: bool = field(
        default=True, metadata=_help("Recompute activations in the backward pass.")
    )
    bf16: bool | None = field(
        default=None,
        metadata=_help(
            "Train in bf16 mixed precision. None: True when a CUDA device is there and fp16 is not set."
        ),
    )
    learning_rate: float = field(default=1e-6, metadata=_help("Initial learning rate of AdamW."))
    lr_scheduler_type: str = field(
        default="constant",
        metadata=_help(
            "Learning-rate schedule. Constant by default: the number of steps is not known up front."
        ),
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata=_help("Must stay True: resuming restarts the rollout worker at the trained prompt."),
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata=_help("Must stay False: every dataset column is passed to the reward functions."),
    )

    # --- the model ------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help("Keyword arguments for from_pretrained when the model is given as a path or id."),
    )
    dtype: str = field(
        default="float32",
        metadata=_help(
            'Dtype to load the model in: "auto", "bfloat16", "float16" or "float32". A dtype in '
            "model_init_kwargs takes precedence."
        ),
    )
    trust_remote_code: bool = field(
        default=False, metadata=_help("Allow models and tokenizers that ship code.")
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata=_help(
            "Weight of a Mixture-of-Experts model's load-balancing loss (logged as aux_loss); None uses the "
            "model config's, 0.0 disables it. Setting it for a dense model raises."
        ),
    )

    # --- generation -----------------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata=_help("Rollouts per prompt (the group size)."))
    max_completion_length: int = field(
        default=2048,
        metadata=_help("Most tokens generated per request, so per turn of a multi-turn rollout."),
    )
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature."))
    top_p: float = field(
        default=1.0, metadata=_help("Nucleus sampling mass, in (0, 1]. Below 1.0, top_k must be set too.")
    )
    top_k: int = field(default=0, metadata=_help("Top-k sampling; 0 disables it."))
    min_p: float | None = field(
        default=None,
        metadata=_help("Minimum probability relative to the most likely token; needs top_k when > 0."),
    )
    repetition_penalty: float = field(
        default=1.0, metadata=_help("Repetition penalty of the sampler; 1.0 is none.")
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help("Extra keyword arguments for apply_chat_template (e.g. enable_thinking)."),
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata=_help("Most tool-calling turns per rollout; None for no limit.")
    )

    # --- the generation server ------------------------------------------------------------------------
    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata=_help(
            "Base URL of the vLLM (or built-in) generation server; several servers: a list of URLs, or "
            "one string of them separated by commas (requests go to the least loaded, a group's rollouts "
            "to one server; pause, resume and weight syncs reach every server; one that stops answering "
            "is dropped until it answers again and a weight sync brings it to the current policy)."
        ),
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata=_help(
            "Seconds to wait for the server at start-up, per generation request and per weight-sync call."
        ),
    )

    # --- training -------------------------------------------------------------------------------------
    epsilon: float = field(default=0.2, metadata=_help("Lower clipping range of the clipped surrogate."))
    epsilon_high: float | None = field(
        default=None, metadata=_help("Upper clipping range; None uses epsilon. DAPO recommends 0.28.")
    )
    score_centering: bool = field(
        default=True, metadata=_help("Train with score centering instead of the clipped surrogate objective.")
    )
    vllm_importance_sampling_clip_min: float = field(
        default=0.5, metadata=_help("Tokens whose policy/sampler ratio is below this leave the loss.")
    )
    vllm_importance_sampling_clip_max: float = field(
        default=5.0, metadata=_help("Tokens whose policy/sampler ratio is above this leave the loss.")
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata=_help("Top log-probabilities requested from the sampler per token, for score centering."),
    )
    token_budget: int | None = field(
        default=None,
        metadata=_help(
            "Most tokens in one row (shared tokens count once); None uses the server's max_model_len."
        ),
    )

    # --- the asynchronous pipeline -------------------------------------------------------------------
    max_concurrent_rollouts: int = field(
        default=512,
        metadata=_help("Most rollouts running at once; also the size of the sync-tool thread pool."),
    )
    max_staleness: int = field(
        default=4,
        metadata=_help(
            "Most weight updates a sample may lag behind the trained policy before it is dropped."
        ),
    )
    weight_sync_steps: int = field(
        default=1, metadata=_help("Optimizer steps between weight syncs to the server.")
    )
    rollout_worker_timeout: float = field(
        default=300.0,
        metadata=_help("Seconds without a heartbeat after which the rollout worker is declared hung."),
    )

    # --- logging --------------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False, metadata=_help("Log sample completions at each logging step.")
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata=_help("How many completions to print when log_completions is set; None prints all."),
    )

    # --- beyond the reference: rollouts on disk ----------------------------------------------------
    save_rollouts: bool = field(
        default=False,
        metadata=_help(
            "Write the rollouts of every save_rollouts_every-th group to output_dir/rollouts/ as JSON "
            "lines (messages, tool calls and results, rewards per function, advantage); `harness report` "
            "reads them."
        ),
    )
    save_rollouts_every: int = field(
        default=1, metadata=_help("Save the rollouts of one group in this many.")
    )
    rollouts_file_mb: float = field(
        default=64.0, metadata=_help("A rollouts file is closed and a new one started past this size.")
    )
    rollouts_max_files: int = field(
        default=8, metadata=_help("Rollouts files kept; the oldest is deleted when another would start.")
    )

    # --- beyond the reference: generation server choice ----------------------------------------------
    generation_server: GenerationServerMode = field(
        default="auto",
        metadata=_help(
            '"external": use vllm_server_base_url; "builtin": start the built-in server on the model; '
            '"auto": use the URL when a server answers there, else start the built-in server.'
        ),
    )
    builtin_server_device: str | None = field(
        default=None, metadata=_help("Device of the built-in server (e.g. 'cpu', 'cuda:1'); None picks one.")
    )
    builtin_server_max_model_len: int = field(
        default=4096, metadata=_help("max_model_len of the built-in server (prompt plus completion).")
    )
    weight_sync_deltas: bool = field(
        default=False,
        metadata=_help(
            "When merged weights are broadcast to the built-in server (on another host), send each tensor's "
            "changed elements alone after the first sync. Costs one copy of the served weights on the "
            "trainer's device. See harness/weight_sync/deltas.py."
        ),
    )

    # --- beyond the reference: training kernels ------------------------------------------------------
    compile_blocks: bool | None = field(
        default=None,
        metadata=_help(
            "Compile each decoder layer's RMSNorms and dense MLP with torch.compile (dynamic shapes, so new "
            "row lengths reuse the compiled code; compiled in the warm-up at start) so their elementwise "
            "work runs fused; attention keeps its own kernels. None: on when training on a CUDA device. "
            "See harness/compiled_blocks.py."
        ),
    )

    # --- beyond the reference: rollout worker processes ----------------------------------------------
    num_rollout_workers: int = field(
        default=1,
        metadata=_help(
            "Rollout worker processes sharing the prompts and the token allowance (each with its own "
            "environments, sandboxes and server connections); max_concurrent_rollouts, sandbox_min_idle and "
            "sandbox_engine_max_sandboxes are split between them. More than 1 pays when one worker's CPU "
            "(about 1 ms per turn) limits the run; see docs/operators.md."
        ),
    )

    # --- beyond the reference: tools and parsing -----------------------------------------------------
    tool_timeout_s: float = field(
        default=60.0, metadata=_help("Per-call timeout of tools without one of their own.")
    )
    tool_max_output_chars: int = field(
        default=16_384, metadata=_help("Tool output cap, in characters, seen by the model.")
    )
    parallel_tool_calls: bool = field(
        default=False, metadata=_help("Run the tool calls of one turn concurrently instead of in order.")
    )
    tool_call_format: str | None = field(
        default=None, metadata=_help("Tool-call format family, overriding detection from the chat template.")
    )
    render_check_frac: float = field(
        default=0.05,
        metadata=_help("Fraction of incrementally rendered turns re-rendered in full to check for drift."),
    )

    # --- beyond the reference: sandboxes and failures ------------------------------------------------
    sandbox_min_idle: int = field(default=0, metadata=_help("Warm sandboxes kept started per sandbox spec."))
    sandbox_max_starting: int = field(
        default=8, metadata=_help("Most sandboxes starting at once per sandbox spec.")
    )
    sandbox_reuse: bool = field(
        default=False, metadata=_help("Wipe and reuse a sandbox after a rollout instead of discarding it.")
    )
    sandbox_docker_engines: str | list[str] | None = field(
        default=None,
        metadata=_help(
            "Docker engines the environments' Docker sandboxes are spread over, replacing their manifests' "
            "docker_engines: a list of engine URLs (unix:///path, tcp://host:2376 with TLS from "
            "DOCKER_CERT_PATH; for ssh, forward the socket) or one string of them separated by commas; None "
            "keeps each manifest's (by default DOCKER_HOST's)."
        ),
    )
    sandbox_engine_max_sandboxes: int | None = field(
        default=None,
        metadata=_help("Most sandboxes on one Docker engine, replacing the manifests' engine_max_sandboxes."),
    )
    score_infra_failures: bool = field(
        default=False,
        metadata=_help(
            "Score rollouts that failed for infrastructure reasons (a dead sandbox, a server error) "
            "instead of keeping them out of the group statistics and of training."
        ),
    )
    failure_window: int = field(
        default=64, metadata=_help("Rollouts over which the failure rate is measured.")
    )
    max_failure_frac: float = field(
        default=0.5,
        metadata=_help("Stop the run when this fraction of the last failure_window rollouts failed."),
    )

    def __post_init__(self) -> None:
        if self.bf16 is None:
            import torch

            # The reference's default, on the GPUs it assumes; on a CPU-only machine, plain fp32.
            self.bf16 = not self.fp16 and torch.cuda.is_available() and not self.use_cpu
        if getattr(self, "activation_checkpointing", False) is None:
            # transformers >= 5.24 renamed gradient_checkpointing; passing our value on under the new name
            # keeps the reference's field working without a deprecation warning on every run.
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._check()

    def _check(self) -> None:
        problems = []
        if self.num_generations < 2:
            problems.append(
                "num_generations must be at least 2: a group needs two rollouts to have a baseline"
            )
        if not self.temperature > 0:
            problems.append(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if (self.top_p < 1 or (self.min_p or 0) > 0) and self.top_k == 0:
            problems.append(
                "top_p < 1 and min_p > 0 need top_k > 0 too (the server bounds the candidate set with it)"
            )
        if not 0 <= self.vllm_importance_sampling_clip_min < self.vllm_importance_sampling_clip_max:
            problems.append(
                "vllm_importance_sampling_clip_min must be >= 0 and below vllm_importance_sampling_clip_max"
            )
        if self.num_sampler_logprobs < 0:
            problems.append("num_sampler_logprobs must be >= 0")
        if self.max_concurrent_rollouts < 1:
            problems.append("max_concurrent_rollouts must be at least 1")
        if self.num_rollout_workers < 1:
            problems.append("num_rollout_workers must be at least 1")
        if self.max_staleness < 0:
            problems.append("max_staleness must be >= 0")
        if self.weight_sync_steps < 1:
            problems.append("weight_sync_steps must be at least 1")
        if self.token_budget is not None and self.token_budget < 1:
            problems.append("token_budget must be positive or None")
        if not self.remove_unused_columns is False:  # noqa: E714 - read as "must stay False"
            problems.append(
                "remove_unused_columns must stay False: every column reaches the reward functions"
            )
        if self.ignore_data_skip is not True:
            problems.append("ignore_data_skip must stay True: the rollout queue cannot be replayed on resume")
        if self.torch_compile:
            problems.append(
                "torch_compile=True is not supported: the model cannot be compiled whole around tree "
                "attention; compile_blocks (on by default on a CUDA device) compiles each layer's norms "
                "and MLP"
            )
        if self.use_liger_kernel:
            problems.append(
                "use_liger_kernel=True is not supported: the loss runs on our chunked log-prob head"
            )
        if self.deepspeed:
            problems.append("deepspeed is not supported: sharded training uses FSDP2 (fsdp / fsdp_config)")
        if self.generation_server not in ("auto", "builtin", "external"):
            problems.append("generation_server must be 'auto', 'builtin' or 'external'")
        try:
            server_urls(self.vllm_server_base_url)
        except ValueError as exc:
            problems.append(str(exc))
        try:
            self.sandbox_overrides()
        except ValueError as exc:
            problems.append(f"sandbox_docker_engines / sandbox_engine_max_sandboxes: {exc}")
        if not 0 <= self.render_check_frac <= 1:
            problems.append("render_check_frac must be in [0, 1]")
        if not 0 < self.max_failure_frac <= 1 or self.failure_window < 1:
            problems.append("max_failure_frac must be in (0, 1] and failure_window at least 1")
        if self.save_rollouts_every < 1 or self.rollouts_file_mb <= 0 or self.rollouts_max_files < 1:
            problems.append(
                "save_rollouts_every and rollouts_max_files must be at least 1 and rollouts_file_mb positive"
            )
        if self.num_completions_to_print is not None and self.num_completions_to_print < 0:
            problems.append("num_completions_to_print must be non-negative (None prints all)")
        if problems:
            raise ValueError("invalid AsyncGRPOConfig: " + "; ".join(problems))

    def sandbox_overrides(self) -> dict[str, Any]:
        """What the sandbox_* engine fields replace in each Docker sandbox spec (checked as a spec would)."""
        from sandboxes.base import SandboxSpec

        overrides: dict[str, Any] = {}
        if self.sandbox_docker_engines is not None:
            engines = self.sandbox_docker_engines
            overrides["docker_engines"] = engines if isinstance(engines, str) else tuple(engines)
        if self.sandbox_engine_max_sandboxes is not None:
            overrides["engine_max_sandboxes"] = self.sandbox_engine_max_sandboxes
        if overrides:
            checked = SandboxSpec(backend="docker", **overrides)
            overrides = {name: getattr(checked, name) for name in overrides}
        return overrides

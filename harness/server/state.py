"""What a built-in server serves: its settings (`ServerConfig`) and the loaded model, engine and adapters.

Who talks to it: `harness serve` (`harness/server/cli.py`) builds a ServerConfig from its flags and calls
`ServerState.load`; tests and benchmarks build one around an in-memory model with `ServerState.from_model`;
the routes (`harness/server/app.py`) read the state. `close()` stops the engine (which aborts pending
requests), drops the adapters and leaves any weight-transfer group; it is idempotent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from harness.server.engine import Engine
    from harness.server.lora import LoraAdapter, LoraManager
    from harness.weight_sync.wire import BroadcastGroup

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ServerConfig:
    """Settings of one built-in server, flag for flag with `harness serve` (names as vLLM's where shared)."""

    model: str
    """Path of a Hugging Face model folder (config, weights, and a tokenizer if text prompts are wanted)."""
    served_model_name: str | None = None
    """Name clients pass as `model`; default: `model` as given."""
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = 8000
    """Port to listen on; 0 picks a free one (see port_file)."""
    port_file: str | None = None
    """Write the bound port to this file once listening (how a launcher learns a port picked with 0)."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    dtype: str = "auto"
    """Weights and KV dtype: auto (the checkpoint's on GPU, float32 on CPU), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; default: the model's max_position_embeddings."""
    max_num_seqs: int = 256
    """Most requests decoded together."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens prefilled in one step."""
    kv_cache_tokens: int | None = None
    """KV-cache budget in tokens; default: half the free device memory (CPU: of available RAM, <= 8 GiB)."""
    num_threads: int | None = None
    """torch's CPU threads (torch.set_num_threads); default: torch's own choice."""
    enable_prefix_caching: bool = True
    """Reuse the keys of prompt prefixes seen before (a group's shared prompt, earlier turns), as vLLM."""
    enforce_eager: bool = False
    """On a GPU, run every forward eagerly instead of replaying decode steps from CUDA graphs, as vLLM."""
    compile_blocks: bool | None = None
    """Compile each decoder layer's norms and MLPs (`harness/compiled_blocks.py`: fused kernels, replayed
    inside the CUDA graphs), in a warm-up before the server answers; None: on a GPU unless enforce_eager.
    With enable_lora the MLPs stay eager."""
    compile_layers: bool = False
    """Compile each decoder layer whole but its attention (`compiled_blocks.compile_layers`: the rotary
    embedding and residual adds fused too), in place of compile_blocks' norms and MLPs; with enable_lora
    (adapter hooks on the projections) the server compiles blocks as compile_blocks says instead."""
    fuse_projections: bool | None = None
    """Multiply by each attention's q, k and v weights at once, and by each MLP's gate and up weights at once
    (`harness/server/fused_projections.py`: the parameters become views of one tensor per group); None: on
    a GPU. Never with enable_lora, whose adapters hook the separate projections."""
    scheduler_delay_factor: float | None = None
    """While rows decode, admit waiting requests once the oldest has waited this many times a recent
    prefill's duration, so requests arriving one by one share a prefill (vLLM V0's knob); 0 or None (the
    default, `default_delay_factor`): at every step."""
    async_scheduling: bool | None = None
    """Launch each decode step before reading the previous one's tokens, so the host's work on a step
    overlaps the device's next (vLLM's --async-scheduling); None: on wherever decode steps replay CUDA graphs
    (a GPU without enforce_eager). Requests with a repetition penalty still decode step by step."""
    max_logprobs: int = 20
    """Largest `logprobs` (top-k per token) a request may ask for."""
    enable_lora: bool = False
    """Accept /v1/load_lora_adapter (as vLLM's --enable-lora with runtime updating)."""
    max_loras: int = 8
    """Most adapters loaded at once."""
    max_lora_rank: int = 64
    """Largest adapter rank accepted."""
    exit_with_parent: bool = False
    """Stop when the process that started this server dies (set by the trainer's launcher)."""
    api_server_count: int = 0
    """HTTP front processes (vLLM's --api-server-count; `api_servers.py`) that parse requests and write
    answers beside the engine's process; 0 serves HTTP on a thread of the engine's process. On one H100
    one such process changed tokens/s by +1% / -4% at 64 / 256 requests in flight (README)."""
    switch_interval_ms: float | None = None
    """The server process's GIL switch interval (`sys.setswitchinterval`); None: Python's (5 ms). PyTorch
    releases the GIL around each operator, and while the HTTP thread runs Python the engine thread waits up
    to this long to get it back, once per operator of an eager forward (`benchmarks/bench_gil.py`). Shorter
    was slower on one H100 over HTTP: 9,249 (0.5 ms) and 9,056 (0.1 ms) against 9,635 tokens/s at 64 in
    flight, 16,884 and 16,241 against 17,939 at 256 (docs/serving-benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.scheduler_delay_factor is not None and not self.scheduler_delay_factor >= 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {self.scheduler_delay_factor}")
        if self.api_server_count < 0:
            raise ValueError(f"api_server_count must be 0 or more, got {self.api_server_count}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")
        if self.switch_interval_ms is not None and not self.switch_interval_ms > 0:
            raise ValueError(f"switch_interval_ms must be positive, got {self.switch_interval_ms}")


def default_delay_factor(factor: float | None) -> float:
    """The admission delay a server uses: the one given, else 0 (admit at every step), on a GPU too.

    A factor of 1 was the GPU's default while prefills ran eagerly and each admission read the decode step
    in flight first: then sharing a prefill paid (3-42% more tokens/s than 0 on an H100 and an H200). Since
    prefills replay from graphs in chunks and are launched behind the step in flight, 0 gave more: on one
    H100 over HTTP (random Qwen3-0.6B, `benchmarks/bench_serving.py --servers builtin vllm builtin-nodelay
    --concurrency 64 256 --waves 4`), 7,464 / 14,343 tokens/s at 64 / 256 in flight against 6,537 / 12,336
    with 1 (docs/serving-benchmarks.md)."""
    return 0.0 if factor is None else factor


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


@dataclass
class ServerState:
    """A loaded model behind a running engine, with what the routes need to answer for it."""

    config: ServerConfig
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    engine: Engine
    lora: LoraManager
    model_name: str
    max_model_len: int
    transfer_group: BroadcastGroup | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, config: ServerConfig) -> ServerState:
        """Load `config.model` from disk onto its device and start the engine."""
        import torch

        from harness.model_loading import load_model

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        if config.dtype == "auto":
            dtype: Any = "auto" if device.type == "cuda" else torch.float32
        else:
            dtype = getattr(torch, config.dtype)
        model = load_model(config.model, dtype=dtype)  # a vision-language checkpoint as the trainer loads it
        model = model.to(device).eval()
        return cls.from_model(model, config, tokenizer=_load_tokenizer(config.model))

    @classmethod
    def from_model(
        cls, model: PreTrainedModel, config: ServerConfig, *, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> ServerState:
        """Serve an already loaded model (on its device, in eval mode), e.g. a tiny test model."""
        import torch

        from harness.server.engine import Engine
        from harness.server.lora import LoraManager

        fused = _fuse(model, config)  # first: the KV budget below is measured with the fused weights alone
        if fused:
            logger.info("fused the q/k/v or gate/up projections of %d modules", len(fused))
        text_config = model.config.get_text_config()
        max_model_len = config.max_model_len or int(text_config.max_position_embeddings)
        kv_cache_tokens = config.kv_cache_tokens or default_kv_cache_tokens(
            model, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs
        )
        compiled, whole_layers = _compile(model, config)
        engine = Engine(
            model,
            max_model_len=max_model_len,
            eos_token_ids=_eos_token_ids(model),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_cache_tokens=kv_cache_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            enforce_eager=config.enforce_eager,
            scheduler_delay_factor=default_delay_factor(config.scheduler_delay_factor),
            async_scheduling=(
                config.async_scheduling
                if config.async_scheduling is not None
                else model.device.type == "cuda" and not config.enforce_eager
            ),
        )
        if compiled or (engine.graphs is not None and engine.graphs.compile_sampling):
            if whole_layers:
                what = "decoder layers"
                remedy = (
                    "without --compile-layers (ServerConfig.compile_layers=False) to compile their norms "
                    "and MLPs alone"
                )
            else:
                what = "norms and MLPs"
                remedy = "with --no-compile-blocks (ServerConfig.compile_blocks=False) to run them eagerly"
            try:
                seconds = engine.warm_up()
            except Exception as exc:
                engine.close()
                raise RuntimeError(
                    f"compiling the model's {what} failed in the engine's warm-up ({exc!r}); serve {remedy}"
                ) from exc
            sampling = (
                " and the in-graph sampling" if engine.graphs and engine.graphs.compile_sampling else ""
            )
            logger.info("compiled %d %s%s in a warm-up of %.1f s", len(compiled), what, sampling, seconds)
        engine.start()
        logger.info(
            "engine ready: %s on %s (%s%s), max_model_len %d, KV budget %d tokens, max_num_seqs %d",
            type(model).__name__,
            model.device,
            model.dtype,
            f", {torch.get_num_threads()} threads" if model.device.type == "cpu" else "",
            max_model_len,
            kv_cache_tokens,
            config.max_num_seqs,
        )
        return cls(
            config=config,
            model=model,
            tokenizer=tokenizer,
            engine=engine,
            lora=LoraManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank),
            model_name=config.served_model_name or config.model,
            max_model_len=max_model_len,
        )

    def adapter_for(self, model: str | None) -> LoraAdapter | None:
        """The adapter a request's `model` names: None for the base model (or no name), 404 if unknown."""
        if model is None or model == self.model_name:
            return None
        adapter = self.lora.adapters.get(model)
        if adapter is None:
            from harness.server.protocol import ProtocolError

            raise ProtocolError(404, f"The model `{model}` does not exist.", "model")
        return adapter

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def close(self) -> None:
        self.engine.close()
        self.lora.close()
        group, self.transfer_group = self.transfer_group, None
        if group is not None:
            group.close()


def _fuse(model: PreTrainedModel, config: ServerConfig) -> list[str]:
    """Fuse the projections as the config asks (`harness/server/fused_projections.py`); the names fused."""
    import torch

    from harness.server.fused_projections import fuse_projections

    wanted = config.fuse_projections
    if wanted is None:
        wanted = model.device.type == "cuda" and not config.enable_lora
    elif wanted and config.enable_lora:
        logger.warning(
            "--fuse-projections with --enable-lora: adapters hook the separate projections, so none is fused"
        )
        wanted = False
    if not wanted:
        return []
    fused = fuse_projections(model)
    if model.device.type == "cuda":  # the unfused weights' memory back to the device, for the KV budget
        torch.cuda.empty_cache()
    return fused


def _compile(model: PreTrainedModel, config: ServerConfig) -> tuple[list[str], bool]:
    """Compile what the config asks for (`harness/compiled_blocks.py`); the names compiled, and whether
    they are whole decoder layers."""
    from harness.compiled_blocks import compile_blocks, compile_layers

    if config.compile_layers and not config.enable_lora:
        return compile_layers(model), True
    if config.compile_layers:
        logger.warning(
            "--compile-layers with --enable-lora: adapters hook the layers' projections, so only the norms "
            "are compiled (as --compile-blocks does with LoRA)"
        )
    if (
        config.compile_layers
        or config.compile_blocks
        or (config.compile_blocks is None and model.device.type == "cuda" and not config.enforce_eager)
    ):
        return compile_blocks(model, mlps=not config.enable_lora), False
    return [], False


def _eos_token_ids(model: PreTrainedModel) -> list[int]:
    """EOS ids from the generation config, else the model config (either may hold one id or a list)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None (then prompts must be token ids and responses carry no text)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer in %s (%s): only token-id prompts, responses without text", path, exc)
        return None


def default_kv_cache_tokens(
    model: PreTrainedModel, *, max_model_len: int, max_num_seqs: int, memory_fraction: float = 0.5
) -> int:
    """A KV budget from the free memory of the model's device, within [max_model_len, seqs x len].

    On CUDA: `memory_fraction` of the device memory free after loading; on CPU: that fraction of the
    available RAM (from /proc/meminfo when readable), at most 8 GiB so a laptop stays usable.
    """
    import torch

    from harness.server.kv_cache import attention_shape

    num_layers, num_kv_heads, head_dim = attention_shape(model)
    bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * model.dtype.itemsize
    if model.device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(model.device)
    else:
        free_bytes = min(_available_ram_bytes(), 16 * 2**30)
    budget = int(free_bytes * memory_fraction) // bytes_per_token
    return max(max_model_len, min(budget, max_num_seqs * max_model_len))


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30

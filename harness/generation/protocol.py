"""What a generation server is to its callers: the two Protocols, and the data and errors that cross them.

    SamplingServer   what the rollout loop samples through: readiness, the model, one turn, load, counters
    ServerControl    what the trainer drives a sync through: pause/resume, weight updates, adapters, info

`GenerationClient` (client.py, vLLM's HTTP protocol) implements both; `harness.testing.FakeGenerationServer`
implements both in process, for tests. A custom `AsyncRolloutLoop` may be given any `SamplingServer`
(`client=`), a weight-sync strategy any `ServerControl` behind a `ClientThread` (`ClientThread(client=...)`).
Errors are `GenerationError`s: `ServerUnavailableError` (transient, retried by the HTTP client, then
raised; `AllServersUnavailableError` when a router has no server left), `ServerRequestError` (a 4xx:
never retried), `ProtocolMismatchError` (an answer of the wrong shape).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from harness.generation.server_load import ServerLoad
from harness.types import TurnRecord

FinishReason = Literal["stop", "length", "prompt_too_long"]
PauseMode = Literal["keep", "wait", "abort"]


class GenerationError(Exception):
    """Base of the client's errors."""


class ServerUnavailableError(GenerationError, ConnectionError):
    """The server could not be reached or kept failing (transient errors outlasted the retries)."""


class AllServersUnavailableError(ServerUnavailableError):
    """Every generation server of the run stopped answering (`GenerationRouter`): the run cannot go on.
    The message names each server and what happened to it. Never data of a rollout: it stops the run."""


class ServerRequestError(GenerationError, ValueError):
    """The server refused a request with a 4xx (deterministic: never retried).

    Attributes:
        status: The HTTP status.
        message: The server's error message.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


class ProtocolMismatchError(GenerationError, ValueError):
    """The server answered, but not in the shape the protocol promises (e.g. vLLM too old for token ids)."""


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one generation request (the trainer config's names in brackets).

    Attributes:
        max_tokens: Most tokens to generate (max_completion_length).
        temperature: Softmax temperature; 0 is greedy (temperature).
        top_p: Nucleus mass, 1 disables (top_p).
        top_k: Top-k truncation, 0 disables (top_k).
        min_p: Min-p truncation, 0 disables (min_p).
        repetition_penalty: 1 disables (repetition_penalty).
        num_logprobs: Top log-probs per generated token to return (num_sampler_logprobs); 0 returns only the
            sampled tokens' log-probs.
    """

    max_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int = 8

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be non-negative, got {self.num_logprobs}")

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p leave only part of the vocabulary to draw from (then the sampled
        log-probs are normalised over a candidate set the trainer must know)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0


@dataclass(frozen=True)
class Completion:
    """What one generation request produced, ready for a TurnRecord.

    Attributes:
        output_ids: Generated token ids (a stop token included).
        output_log_probs: The sampler's (processed) log-prob of each output token.
        output_sampler_logprobs: Per output token, the sampler's num_logprobs most likely tokens
            {token id: log-prob}, most likely first; None when num_logprobs was 0.
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or max_model_len reached) or
            "prompt_too_long" (nothing generated: the prompt already fills max_model_len).
        stop_reason: The stop token id when a stop_token_ids entry ended it (vLLM's stop_reason), else None.
        truncation_reason: Why a truncated turn stopped: "max_tokens", "max_model_len", or the server's
            message for a prompt too long; None when it finished on its own.
        output_sampling_mask: Per output token, the ids the sampler could draw from when top-k, top-p or
            min-p truncated its distribution (None for a token whose set is unknown); None when sampling
            did not truncate. The trainer renormalises its log-probs over these sets.
    """

    output_ids: list[int]
    output_log_probs: list[float]
    output_sampler_logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason
    stop_reason: int | None = None
    truncation_reason: str | None = None
    output_sampling_mask: list[list[int] | None] | None = None

    @property
    def truncated(self) -> bool:
        """True when the turn did not end on its own (the rollout counts as clipped)."""
        return self.finish_reason != "stop"

    def to_turn_record(self, prompt_ids: list[int]) -> TurnRecord:
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=list(self.output_ids),
            output_log_probs=list(self.output_log_probs),
            output_sampler_logprobs=self.output_sampler_logprobs,
            output_sampling_mask=self.output_sampling_mask,
        )


@dataclass(frozen=True)
class ModelInfo:
    """The served model, from /v1/models: its id and max_model_len (None when the server does not say)."""

    id: str
    max_model_len: int | None


@dataclass(frozen=True)
class ServerCapabilities:
    """What a server returns beyond the basics, from its /server_info (vLLM's model_config).

    Attributes:
        returns_sampling_masks: It records each token's candidate set (vLLM >= 0.28 with
            --return-sampling-mask; the built-in server always) and returns it on /inference/v1/generate.
        max_logprobs: The most top log-probs a request may ask for (vLLM's --max-logprobs, default 20).
    """

    returns_sampling_masks: bool = False
    max_logprobs: int = 20

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> ServerCapabilities:
        config = (info.get("vllm_config") or {}).get("model_config") or {}
        max_logprobs = config.get("max_logprobs")
        return cls(
            returns_sampling_masks=bool(config.get("return_sampling_mask")),
            max_logprobs=int(max_logprobs) if isinstance(max_logprobs, int) and max_logprobs >= 0 else 20,
        )


# What vLLM (and the built-in server) write for -inf, which JSON cannot carry: a token the sampler masked.
MASKED_LOGPROB = -9999.0


def completion_top_entries(entries: list[dict[str, float]] | None) -> list[dict[int, float]]:
    """/v1/completions' per-token top_logprobs ({"token_id:<id>": logprob}) keyed by token id."""
    return [
        {parse_token_key(key): float(lp) for key, lp in (entry or {}).items() if lp is not None}
        for entry in entries or []
    ]


def generate_top_entries(content: list[dict[str, Any]] | None) -> list[dict[int, float]]:
    """The token route's per-token logprobs.content ([{token_id, logprob, top_logprobs: [...]}]) as one
    {token id: logprob} per token, the sampled token included."""
    entries = []
    for position in content or []:
        try:
            pairs = {int(position["token_id"]): float(position["logprob"])}
            for candidate in position.get("top_logprobs") or []:
                pairs[int(candidate["token_id"])] = float(candidate["logprob"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolMismatchError(f"a logprobs.content entry is malformed: {position!r:.200}") from exc
        entries.append(pairs)
    return entries


def parse_top_logprobs(entries: list[dict[int, float]], num_logprobs: int) -> list[dict[int, float]]:
    """Per token, its num_logprobs most likely {id: logprob}, most likely first.

    vLLM lists the sampled token too, even when it is outside the top K; it is dropped here unless it ranks
    among the K most likely. NaN values are dropped, and so are masked tokens (MASKED_LOGPROB: outside the
    candidate set of a truncated distribution).
    """
    parsed = []
    for entry in entries:
        pairs = [(token, lp) for token, lp in entry.items() if not math.isnan(lp) and lp > MASKED_LOGPROB]
        pairs.sort(key=lambda pair: pair[1], reverse=True)
        parsed.append(dict(pairs[:num_logprobs]))
    return parsed


def candidate_sets_from_top_logprobs(entries: list[dict[int, float]], top_k: int) -> list[list[int] | None]:
    """Each token's candidate set read off its top log-probs, where they show all of it; else None.

    With processed log-probs a truncated distribution gives the masked tokens MASKED_LOGPROB. The listed
    tokens with a real log-prob are the whole set when the list also shows a masked one (the set ended
    before the list did), or when top-k caps the set at as many as are listed. Asking for at least top_k
    log-probs therefore shows every set whole.
    """
    sets: list[list[int] | None] = []
    for entry in entries:
        kept = [token for token, lp in entry.items() if not math.isnan(lp) and lp > MASKED_LOGPROB]
        masked = len(entry) - len(kept)
        complete = masked > 0 or (top_k > 0 and len(kept) >= top_k)
        sets.append(sorted(kept) if complete and kept else None)
    return sets


def parse_token_key(key: str) -> int:
    """The id in vLLM's "token_id:<id>" (return_tokens_as_token_ids)."""
    prefix, _, number = key.partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise ProtocolMismatchError(
            f"top_logprobs key {key!r} is not token_id:<id> (return_tokens_as_token_ids)"
        )
    return int(number)


@runtime_checkable
class SamplingServer(Protocol):
    """What the rollout loop needs of a generation server (`AsyncRolloutLoop(client=...)`)."""

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Return once the server answers (within `timeout_s`, default the client's own); raise
        ServerUnavailableError if it does not (timeout_s=0: one look)."""

    async def model_info(self, refresh: bool = False) -> ModelInfo:
        """The served model's id and max_model_len."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        *,
        model: str | None = None,
        seed: int | None = None,
        route_key: Hashable | None = None,
    ) -> Completion:
        """Sample one turn from the token ids of its whole prompt. `route_key`: requests with the same key
        (a group's rollouts) go to the same server where there are several, for its prefix cache."""

    async def server_load(self) -> ServerLoad | None:
        """The server's load (None when it publishes none)."""

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the previous call (e.g. rollout/vllm_retry_count)."""

    async def describe_candidate_sets(self, sampling: SamplingConfig) -> tuple[str, bool]:
        """Where truncated sampling's candidate sets come from (a sentence for the log) and whether some
        stay unknown (a biased importance ratio); raises when the server is misconfigured for them."""


@runtime_checkable
class ServerControl(Protocol):
    """What a weight sync needs of a generation server (through `ClientThread`, on rank 0)."""

    async def server_info(self) -> dict[str, Any]:
        """The server's configuration (vLLM's /server_info); {} when it has none."""

    async def server_version(self) -> str | None:
        """The server's version (/version), e.g. "0.32.0"; None when it does not say."""

    async def pause(self, mode: PauseMode = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def send_weight_manifest(self, update_info: dict[str, Any]) -> None:
        """Post one update's manifest (with a file path, or the packing fields of a broadcast)."""

    async def finish_weight_update(self) -> None: ...

    async def get_world_size(self) -> int:
        """The server's number of workers (the broadcast group is these plus the trainer)."""

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Ask the server's workers to join the trainer's broadcast group."""

    async def load_lora_adapter(self, name: str, path: str | Path) -> None: ...

    async def unload_lora_adapter(self, name: str) -> None: ...


__all__ = [
    "MASKED_LOGPROB",
    "AllServersUnavailableError",
    "Completion",
    "FinishReason",
    "GenerationError",
    "ModelInfo",
    "PauseMode",
    "ProtocolMismatchError",
    "SamplingConfig",
    "SamplingServer",
    "ServerCapabilities",
    "ServerControl",
    "ServerRequestError",
    "ServerUnavailableError",
    "candidate_sets_from_top_logprobs",
    "completion_top_entries",
    "generate_top_entries",
    "parse_top_logprobs",
]

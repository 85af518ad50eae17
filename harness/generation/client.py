"""The generation client: how the rollout worker and the trainer talk to a vLLM-protocol server.

One `GenerationClient` per process, against a real `vllm serve` or the built-in server (`harness serve`),
which speak the same protocol (`shared/spec/vllm-protocol.md`). Built on the `openai` package (>= 2.0):
`AsyncOpenAI.completions.create` for generation, vLLM's extra request fields through `extra_body` and its
extra response fields through `model_extra`, and the same HTTP stack for vLLM's other routes.

Usage (the rollout loop, one turn):

    async with GenerationClient("http://localhost:8000", timeout_s=1800, max_concurrency=512) as client:
        await client.wait_until_ready()
        sampling = SamplingConfig(max_tokens=2048, temperature=1.0, num_logprobs=8)
        completion = await client.generate(prompt_ids, sampling)
        turn = completion.to_turn_record(prompt_ids)     # a TurnRecord for reconciliation
        if completion.truncated: ...                     # completion.truncation_reason says why

The trainer reaches it through `harness.generation.client_thread.ClientThread`; a weight sync is a sequence of
its single-step calls (`pause`, `start_weight_update`, `send_weight_manifest`, `finish_weight_update`,
`resume`, the adapter calls), put in order by `harness.weight_sync.strategies`, which also moves the weights.

Routes: generation goes through POST /v1/completions, or vLLM's token-in, token-out route
POST /inference/v1/generate where that brings what completions cannot: the candidate set of each token
when top-k, top-p or min-p truncate the distribution (vLLM >= 0.28 with --return-sampling-mask, on the route
--enable-scale-out opens; the built-in server has it too). Without it the candidate sets are read off the
top log-probs (processed log-probs mark the masked tokens), asking for at least top_k of them, which shows
each set whole; `describe_candidate_sets` says at start which applies, and tokens whose set stays unknown
are counted in `sampling/candidate_set_unknown_count`.

Error policy:
* Transient failures (connection errors, timeouts, 5xx, a request the server aborted) are retried with
  capped exponential backoff (`max_retries`, `retry_backoff_s` doubling up to `retry_backoff_max_s`) and
  counted (`rollout/vllm_retry_count` in `pop_metrics()`); past the last retry they raise
  `ServerUnavailableError`.
* A 4xx is deterministic and never retried: `ServerRequestError`. Except a prompt too long for the
  server's max_model_len: that is the rollout's own outcome, not an error. `generate` returns a
  Completion with finish_reason "prompt_too_long" (no request is sent when max_model_len is known), and
  it caps max_tokens at max_model_len - len(prompt), so a turn that would overrun the context stops at
  max_model_len with finish_reason "length" instead of being rejected.
* Weight-sync, pause and adapter calls are not retried (a half-applied sync must surface).

Connections: generation requests get a pool of `max_concurrency` connections (the rollout worker's
max_concurrent_rollouts), so the pool never silently caps concurrency; control calls (health, metrics,
pause, weights, adapters) get a small pool of their own, so a weight sync never queues behind 512
generations. Timeouts: `timeout_s` (the config's vllm_server_timeout) for every call and for waiting for
readiness.

Shutdown: `aclose()` (or leaving `async with`) closes both connection pools; in-flight calls fail.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import openai

from harness.generation.protocol import (
    Completion,
    FinishReason,
    ModelInfo,
    PauseMode,
    ProtocolMismatchError,
    SamplingConfig,
    ServerCapabilities,
    ServerRequestError,
    ServerUnavailableError,
    candidate_sets_from_top_logprobs,
    completion_top_entries,
    generate_top_entries,
    parse_top_logprobs,
)
from harness.generation.server_load import ServerLoad

T = TypeVar("T")
# Phrases of vLLM's (and the built-in server's) 400 answers for a prompt that does not fit max_model_len.
_CONTEXT_LENGTH_PHRASES = ("maximum context length", "maximum model length", "longer than the maximum")
_CONTROL_CONNECTIONS = 16


def _is_context_length_error(message: str) -> bool:
    lowered = message.lower()
    return any(phrase in lowered for phrase in _CONTEXT_LENGTH_PHRASES)


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(body.get("message"), str):
            return body["message"]
    return exc.message


@dataclass
class _Request:
    """One generation request, as both routes send it."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    model: str
    seed: int
    max_tokens: int
    capped: bool  # max_tokens was cut to fit max_model_len
    num_logprobs: int = 0  # top log-probs asked of the server (num_logprobs, or top_k to see each set)


class _AbortedByServer(Exception):
    """The server finished the request with finish_reason "abort" (a pause in abort mode): retried."""


class GenerationClient:
    """Async client of one vLLM-protocol server (see the module docstring for usage and error policy).

    Args:
        base_url: The server's root URL ("http://host:8000"; a trailing "/v1" is accepted).
        timeout_s: Timeout of each call, and of `wait_until_ready` (vllm_server_timeout).
        max_concurrency: Generation requests in flight at most (max_concurrent_rollouts): the size of the
            connection pool.
        model: Model name to send; default: the served model's id (from /v1/models).
        max_retries: Retries of a generation request after transient failures.
        retry_backoff_s: First backoff; doubles per retry up to retry_backoff_max_s (with +-25% jitter).
        retry_backoff_max_s: Cap of the backoff.
        api_key: Sent as a bearer token (vLLM's --api-key); "EMPTY" when the server has none.
        token_route: Which route generates: None (the default) takes vLLM's token route,
            /inference/v1/generate, when sampling truncates (top-k, top-p, min-p) and the server records
            candidate sets (--return-sampling-mask; the built-in server), else /v1/completions; True or
            False force the token route or /v1/completions.
    """

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        *,
        timeout_s: float = 1800.0,
        max_concurrency: int = 512,
        model: str | None = None,
        max_retries: int = 8,
        retry_backoff_s: float = 0.5,
        retry_backoff_max_s: float = 30.0,
        api_key: str = "EMPTY",
        token_route: bool | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.root_url = base_url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.model = model
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s
        self._generation = self._openai(api_key, max_concurrency)
        self._api_key = api_key
        self._control = self._openai(api_key, _CONTROL_CONNECTIONS)
        self._retired_pools: list[openai.AsyncOpenAI] = []
        self._model_info: ModelInfo | None = None
        self._model_info_lock = anyio.Lock()
        self._seeds = random.Random(uuid.uuid4().int)
        self._counter_lock = threading.Lock()
        self.num_retries = 0
        self._num_retries_reported = 0
        self.num_unknown_candidate_sets = 0
        self.token_route = token_route
        self._capabilities: ServerCapabilities | None = None
        self._capabilities_lock = anyio.Lock()

    def _openai(self, api_key: str, connections: int) -> openai.AsyncOpenAI:
        # The openai package's own HTTP types (httpx in 2.x, httpx2 in 3.x), taken from its defaults so this
        # works with both.
        limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
            max_connections=connections, max_keepalive_connections=connections
        )
        timeout = type(openai.DEFAULT_TIMEOUT)(self.timeout_s, connect=min(self.timeout_s, 10.0))
        http_client = openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout)
        return openai.AsyncOpenAI(
            base_url=f"{self.root_url}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=timeout,
            http_client=http_client,
        )

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close both connection pools (idempotent)."""
        await self._generation.close()
        await self._control.close()
        for pool in self._retired_pools:
            await pool.close()
        self._retired_pools.clear()

    # ------------------------------------------------------------------ metrics

    def _count_retry(self) -> None:
        with self._counter_lock:
            self.num_retries += 1

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the previous call: retried requests (`rollout/vllm_retry_count`) and generated
        tokens of a truncated distribution whose candidate set is unknown
        (`sampling/candidate_set_unknown_count`)."""
        with self._counter_lock:
            retries = self.num_retries - self._num_retries_reported
            self._num_retries_reported = self.num_retries
            unknown, self.num_unknown_candidate_sets = self.num_unknown_candidate_sets, 0
        metrics = {"rollout/vllm_retry_count": float(retries)}
        if unknown:
            metrics["sampling/candidate_set_unknown_count"] = float(unknown)
        return metrics

    # ------------------------------------------------------------------ plumbing

    async def _request(
        self,
        method: Literal["get", "post"],
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> str:
        """One control call to `path` at the server's root; its body as text. Typed errors, no retries."""
        url = f"{self.root_url}{path}"
        options: Any = {"params": params} if params else {}  # the openai package's FinalRequestOptions
        try:
            if method == "get":
                return await self._control.get(url, cast_to=str, options=options)
            return await self._control.post(url, cast_to=str, body=body or {}, options=options)
        except openai.APIStatusError as exc:
            if exc.status_code < 500:
                raise ServerRequestError(exc.status_code, _error_message(exc)) from exc
            # vLLM's server closes the connection after a 500 from an unhandled exception; a pooled
            # connection would fail the next call with a bare "Connection error": the next calls get a
            # fresh pool (the old one closes with the client)
            self._retired_pools.append(self._control)
            self._control = self._openai(self._api_key, _CONTROL_CONNECTIONS)
            raise ServerUnavailableError(
                f"{method.upper()} {path}: {exc.status_code} {_error_message(exc)}"
            ) from exc
        except openai.APIConnectionError as exc:
            raise ServerUnavailableError(f"{method.upper()} {path}: {exc}") from exc

    async def _json(self, method: Literal["get", "post"], path: str, **kwargs: Any) -> Any:
        text = await self._request(method, path, **kwargs)
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ProtocolMismatchError(f"{path} answered with non-JSON text: {text[:200]!r}") from exc

    async def _retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        attempt = 0
        while True:
            try:
                return await call()
            except openai.APIStatusError as exc:
                if exc.status_code < 500:
                    raise
                failure: Exception = exc
            except (openai.APIConnectionError, _AbortedByServer) as exc:
                failure = exc
            if attempt >= self.max_retries:
                raise ServerUnavailableError(
                    f"{what} failed after {attempt + 1} attempts: {failure}"
                ) from failure
            attempt += 1
            self._count_retry()
            backoff = min(self.retry_backoff_max_s, self.retry_backoff_s * 2 ** (attempt - 1))
            await anyio.sleep(backoff * random.uniform(0.75, 1.25))

    # ------------------------------------------------------------------ readiness and model

    async def wait_until_ready(self, timeout_s: float | None = None, poll_interval_s: float = 2.0) -> None:
        """Poll /health until it answers 200; ServerUnavailableError after `timeout_s` (default timeout_s)."""
        deadline = anyio.current_time() + (self.timeout_s if timeout_s is None else timeout_s)
        last_error: Exception | None = None
        while True:
            try:
                await self._request("get", "/health")
                return
            except (ServerUnavailableError, ServerRequestError) as exc:
                last_error = exc
            if anyio.current_time() + poll_interval_s > deadline:
                raise ServerUnavailableError(
                    f"{self.root_url} was not ready in time: {last_error}"
                ) from last_error
            await anyio.sleep(poll_interval_s)

    async def model_info(self, refresh: bool = False) -> ModelInfo:
        """The served model's id and max_model_len (GET /v1/models, cached)."""
        async with self._model_info_lock:
            if self._model_info is None or refresh:
                body = await self._json("get", "/v1/models")
                try:
                    card = body["data"][0]
                except (KeyError, IndexError, TypeError) as exc:
                    raise ProtocolMismatchError(f"/v1/models lists no model: {body!r:.200}") from exc
                max_len = card.get("max_model_len")
                self._model_info = ModelInfo(
                    id=str(card["id"]), max_model_len=int(max_len) if max_len else None
                )
            return self._model_info

    # ------------------------------------------------------------------ generation

    async def capabilities(self) -> ServerCapabilities:
        """What the server can return beyond vLLM's basics (from /server_info, read once)."""
        async with self._capabilities_lock:
            if self._capabilities is None:
                self._capabilities = ServerCapabilities.from_server_info(await self.server_info())
            return self._capabilities

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        *,
        model: str | None = None,
        seed: int | None = None,
        route_key: Hashable | None = None,
    ) -> Completion:
        """Sample one turn from the token ids of its whole prompt (see the module doc for outcomes).

        Args:
            prompt_ids: The full prompt, every earlier turn included.
            sampling: Sampling settings.
            model: Model (or LoRA adapter) name; default: the client's `model`, else the served model.
            seed: Seed of this request; default: a fresh random one per request (reused by its retries).
            route_key: Where to send it among several servers (`GenerationRouter`); one server: unused.
        """
        info = await self.model_info()
        if info.max_model_len is not None and len(prompt_ids) >= info.max_model_len:
            return _prompt_too_long(
                f"the prompt has {len(prompt_ids)} tokens, max_model_len is {info.max_model_len}"
            )
        max_tokens = sampling.max_tokens
        capped = info.max_model_len is not None and len(prompt_ids) + max_tokens > info.max_model_len
        if info.max_model_len is not None and capped:
            max_tokens = info.max_model_len - len(prompt_ids)
        request = _Request(
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            model=model or self.model or info.id,
            seed=self._seeds.getrandbits(63) if seed is None else seed,
            max_tokens=max_tokens,
            capped=capped,
        )
        capabilities = await self.capabilities()
        token_route = self.token_route
        if token_route is None:  # the token route only where it brings the candidate sets
            token_route = sampling.truncates and capabilities.returns_sampling_masks
        request.num_logprobs = sampling.num_logprobs
        masks_come = token_route and capabilities.returns_sampling_masks
        if sampling.truncates and not masks_come and sampling.top_k <= capabilities.max_logprobs:
            request.num_logprobs = max(sampling.num_logprobs, sampling.top_k)  # shows each set whole
        attempt = self._generate_tokens if token_route else self._generate_completion
        try:
            return await self._retrying(lambda: attempt(request), "generation request")
        except openai.APIStatusError as exc:
            message = _error_message(exc)
            if exc.status_code == 400 and _is_context_length_error(message):
                return _prompt_too_long(message)
            raise ServerRequestError(exc.status_code, message) from exc

    async def _generate_completion(self, request: _Request) -> Completion:
        """One attempt through POST /v1/completions."""
        sampling = request.sampling
        response = await self._generation.completions.create(
            model=request.model,
            prompt=request.prompt_ids,
            max_tokens=request.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            logprobs=request.num_logprobs,
            seed=request.seed,
            n=1,
            extra_body={
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "min_p": sampling.min_p,
                "repetition_penalty": sampling.repetition_penalty,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
        )
        if not response.choices:
            raise ProtocolMismatchError("the completion has no choices")
        choice = response.choices[0]
        extra = choice.model_extra or {}
        token_ids = extra.get("token_ids")
        if token_ids is None:
            raise ProtocolMismatchError(
                "the server returned no token_ids: it ignores return_token_ids (vLLM >= 0.10.2 is needed)"
            )
        if choice.finish_reason == "abort":
            raise _AbortedByServer("the server aborted the request")
        logprobs = choice.logprobs
        if logprobs is None or logprobs.token_logprobs is None:
            raise ProtocolMismatchError("the server returned no logprobs for the generated tokens")
        token_logprobs = [float("nan") if lp is None else float(lp) for lp in logprobs.token_logprobs]
        entries = completion_top_entries(logprobs.top_logprobs) if request.num_logprobs > 0 else []
        return self._completion(
            request,
            token_ids=token_ids,
            token_logprobs=token_logprobs,
            top_entries=entries,
            finish_reason=choice.finish_reason,
            stop_reason=extra.get("stop_reason"),
            sampling_mask=None,
        )

    async def _generate_tokens(self, request: _Request) -> Completion:
        """One attempt through vLLM's token-in, token-out route, POST /inference/v1/generate (vLLM >= 0.30
        with --enable-scale-out; the built-in server too), which also returns each token's candidate set
        where the server records them (--return-sampling-mask)."""
        sampling = request.sampling
        body = {
            "model": request.model,
            "token_ids": request.prompt_ids,
            "sampling_params": {
                "max_tokens": request.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "min_p": sampling.min_p,
                "repetition_penalty": sampling.repetition_penalty,
                "seed": request.seed,
                "logprobs": request.num_logprobs,
                "n": 1,
                "detokenize": False,
            },
            "stream": False,
        }
        text = await self._generation.post(f"{self.root_url}/inference/v1/generate", cast_to=str, body=body)
        try:
            choice = json.loads(text)["choices"][0]
            token_ids = choice["token_ids"]
            content = (choice.get("logprobs") or {})["content"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ProtocolMismatchError(
                f"/inference/v1/generate answered without choices[0].token_ids and .logprobs.content: "
                f"{text[:200]!r}"
            ) from exc
        if choice.get("finish_reason") == "abort":
            raise _AbortedByServer("the server aborted the request")
        if content is None or token_ids is None:
            raise ProtocolMismatchError(
                "the server returned no token ids or logprobs for the generated tokens"
            )
        entries = generate_top_entries(content)
        return self._completion(
            request,
            token_ids=token_ids,
            token_logprobs=[float(position["logprob"]) for position in content],
            top_entries=entries if request.num_logprobs > 0 else [],
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            sampling_mask=choice.get("sampling_mask"),
        )

    def _completion(
        self,
        request: _Request,
        *,
        token_ids: list[int],
        token_logprobs: list[float],
        top_entries: list[dict[int, float]],
        finish_reason: str | None,
        stop_reason: Any,
        sampling_mask: Any,
    ) -> Completion:
        """What both routes return, checked and made a Completion."""
        sampling = request.sampling
        if len(token_logprobs) != len(token_ids):
            raise ProtocolMismatchError(f"{len(token_ids)} token ids but {len(token_logprobs)} logprobs")
        if request.num_logprobs > 0 and len(top_entries) != len(token_ids):
            raise ProtocolMismatchError(
                f"{len(token_ids)} token ids but {len(top_entries)} top_logprobs entries"
            )
        top = parse_top_logprobs(top_entries, sampling.num_logprobs) if sampling.num_logprobs > 0 else None
        finish: FinishReason = "stop" if finish_reason == "stop" else "length"
        truncation_reason = None
        if finish == "length":
            full = request.capped and len(token_ids) >= request.max_tokens
            truncation_reason = "max_model_len" if full else "max_tokens"
        return Completion(
            output_ids=[int(t) for t in token_ids],
            output_log_probs=token_logprobs,
            output_sampler_logprobs=top,
            finish_reason=finish,
            stop_reason=stop_reason if isinstance(stop_reason, int) else None,
            truncation_reason=truncation_reason,
            output_sampling_mask=self._candidate_sets(sampling, sampling_mask, top_entries, len(token_ids)),
        )

    def _candidate_sets(
        self, sampling: SamplingConfig, given: Any, top_entries: list[dict[int, float]], num_tokens: int
    ) -> list[list[int] | None] | None:
        """Each generated token's candidate set when sampling truncated the distribution: the server's
        (`sampling_mask`), else what the top log-probs show of it; tokens whose set stays unknown are
        counted (`sampling/candidate_set_unknown_count`): the trainer normalises those over the whole
        vocabulary, which biases their importance ratio."""
        if not sampling.truncates:
            return None
        if isinstance(given, list) and len(given) == num_tokens:
            sets: list[list[int] | None] = [
                [int(t) for t in ids] if isinstance(ids, list) else None for ids in given
            ]
        else:
            sets = candidate_sets_from_top_logprobs(top_entries, sampling.top_k)
            sets += [None] * (num_tokens - len(sets))
        unknown = sum(ids is None for ids in sets)
        if unknown:
            with self._counter_lock:
                self.num_unknown_candidate_sets += unknown
        return sets

    async def describe_candidate_sets(self, sampling: SamplingConfig) -> tuple[str, bool]:
        """Where the candidate sets of a truncated distribution come from on this server, as a sentence for
        the log, and whether the trainer's importance ratio is biased (some sets stay unknown). Raises
        ServerRequestError when the server records sets (--return-sampling-mask) but lacks the token route
        that returns them (--enable-scale-out)."""
        capabilities = await self.capabilities()
        if capabilities.returns_sampling_masks and self.token_route is not False:
            try:
                await self._request("post", "/inference/v1/generate", body={})
            except ServerRequestError as exc:
                if exc.status == 404:
                    raise ServerRequestError(
                        404,
                        "the server records sampling masks (--return-sampling-mask) but has no "
                        "/inference/v1/generate route to return them: restart vLLM with --enable-scale-out",
                    ) from exc
            return "candidate sets: the server's sampling masks (/inference/v1/generate)", False
        if sampling.top_k <= capabilities.max_logprobs:
            return (
                f"candidate sets: read off the top {sampling.top_k} log-probs of each token (exact under "
                f"top_k={sampling.top_k}; the server returns no sampling masks)",
                False,
            )
        return (
            f"top_k={sampling.top_k} is above the server's max_logprobs ({capabilities.max_logprobs}) and "
            "the server returns no sampling masks, so the trainer normalises the sampled tokens over the "
            "whole vocabulary, a biased importance ratio (counted in sampling/candidate_set_unknown_count): "
            "lower top_k, raise vLLM's --max-logprobs, or start vLLM >= 0.30 with --return-sampling-mask "
            "--enable-scale-out",
            True,
        )

    # ------------------------------------------------------------------ load

    async def server_load(self) -> ServerLoad | None:
        """The server's load from /metrics; None when it has no /metrics (then the cap stays fixed)."""
        try:
            text = await self._request("get", "/metrics")
        except ServerRequestError as exc:
            if exc.status == 404:
                return None
            raise
        return ServerLoad.from_text(text)

    # ------------------------------------------------------------------ pause

    async def pause(self, mode: PauseMode = "keep") -> None:
        """POST /pause (keep: in-flight requests freeze and continue after resume)."""
        await self._request("post", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._request("post", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._json("get", "/is_paused"))["is_paused"])

    # ------------------------------------------------------------------ weights

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info?config_format=json (vLLM dev mode); {} when the server has no such route."""
        try:
            info = await self._json("get", "/server_info", params={"config_format": "json"})
        except ServerRequestError as exc:
            if exc.status == 404:
                return {}
            raise
        return info if isinstance(info, dict) else {}

    async def server_version(self) -> str | None:
        """GET /version (vLLM's and the built-in server's); None when the server has no such route."""
        try:
            body = await self._json("get", "/version")
        except ServerRequestError as exc:
            if exc.status == 404:
                return None
            raise
        version = body.get("version") if isinstance(body, dict) else None
        return str(version) if version is not None else None

    async def start_weight_update(self) -> None:
        """POST /start_weight_update (one step of a weight sync; see harness/weight_sync/strategies.py)."""
        await self._request("post", "/start_weight_update", body={"is_checkpoint_format": True})

    async def send_weight_manifest(self, update_info: dict[str, Any]) -> None:
        """POST /update_weights with `update_info` (a manifest, plus a file path or the packing fields)."""
        await self._request("post", "/update_weights", body={"update_info": update_info})

    async def finish_weight_update(self) -> None:
        await self._request("post", "/finish_weight_update")

    async def get_world_size(self) -> int:
        """GET /get_world_size: the server's workers (vLLM: tensor x pipeline x data parallel)."""
        return int((await self._json("get", "/get_world_size"))["world_size"])

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST /init_weight_transfer_engine: the server's workers join the trainer's broadcast group."""
        await self._request("post", "/init_weight_transfer_engine", body={"init_info": init_info})

    # ------------------------------------------------------------------ LoRA

    async def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT adapter directory under `name` (the server reads the path itself)."""
        await self._request(
            "post",
            "/v1/load_lora_adapter",
            body={"lora_name": name, "lora_path": str(path), "load_inplace": False},
        )

    async def unload_lora_adapter(self, name: str) -> None:
        await self._request("post", "/v1/unload_lora_adapter", body={"lora_name": name})


def _prompt_too_long(message: str) -> Completion:
    return Completion(
        output_ids=[],
        output_log_probs=[],
        output_sampler_logprobs=None,
        finish_reason="prompt_too_long",
        truncation_reason=message,
    )


__all__ = ["GenerationClient"]

"""The built-in server's engine: continuous batching of generation requests over one model on one device.

Who talks to it: the HTTP layer (`harness/server/app.py`) submits requests, aborts those whose client went
away, pauses and resumes, and runs weight and adapter updates through `call`; it reads `stats()` for
/metrics. All model work happens on the engine's own thread, so torch never runs on the event loop.

The loop, once per step: run queued commands (weight updates, adapter changes, pause), take new and aborted
requests, admit waiting requests into free cache rows while the KV budget allows, prefill the rows that
have no cache yet (new, or preempted) in one left-padded batch, then decode one token for every running
row in one batch. Requests join and leave between steps: that is the continuous batching. A finished row
is refilled by the last row, so running requests always occupy rows 0..n-1 (see `kv_cache.py`). On a CUDA
device both forwards are replayed from CUDA graphs where they can be (`cuda_graphs.py`; `enforce_eager`
turns that off): a decode step always, a prefill in graph-sized chunks unless a prompt is too long for one.

Why not transformers' own ContinuousBatchingManager (`generate_batch`, paged attention): in 5.17 and 5.24 it
samples with one global RNG and one `do_sample` switch for the whole batch, so a request's tokens depend on
its neighbours and greedy and sampled requests cannot share a batch; it returns only the sampled token's
log-prob (no top-k, no processed log-probs), has no min-p or repetition penalty per request, offers no
way to swap weights or LoRA adapters under running requests, and its internals (cache manager, model
runner) differ between the two versions we support. Extending it would mean patching private code twice,
so the scheduler and cache are our own; the model forward is still transformers', through its
AttentionInterface.

Admission delay (`scheduler_delay_factor`, vLLM's V0 scheduler knob of that name): over HTTP requests
arrive one by one, and each step that admits some pays a prefill forward of its own beside the decode
forward. With a factor f > 0, while rows are decoding, waiting requests are admitted only once the oldest
has waited f x a prefill's duration (the median of the last 8 prefills, so that one that captured a CUDA
graph does not set the pace), so arrivals spread over that window share one prefill. With no row running,
requests are admitted at once. 0 (the default, the server's too: `state.default_delay_factor` says why)
admits at every step.

Async scheduling (`async_scheduling`, vLLM's --async-scheduling; the server turns it on wherever decode
steps replay CUDA graphs): a decode step is launched on the device and left unread; the next engine step
launches the following decode step at once, its input tokens taken from the sampled tensor still on the
device, and only then reads the earlier step's tokens and ends the requests that are done. So the host's
work on one step's results (appending tokens, stop checks, answering finished requests) runs while the
device computes the next step, instead of the device idling through it. A request that ends is found one
step late: its row is decoded once more and that token dropped. Requests admitted while a step is in
flight are prefilled behind it, and the next decode step of every row is launched at once, the new rows'
first tokens taken from the prefill's sampled tensor (`_prefill_ahead`). Whatever else changes the rows,
the cache's storage or what a row's next logits depend on first reads the step in flight, then runs as
before: preemption, a cache that must grow, commands (weight updates, pauses), aborts, adapters, and
requests with a repetition penalty (which reads their tokens on the host).

Preemption: when the rows times the longest sequence would exceed the KV budget, the newest request goes
back to the front of the queue and is recomputed (prompt and output so far) when readmitted. A weight
update or adapter change invalidates every cached key, so it preempts all running requests the same way
(as vLLM resets its caches at a weight sync); both count in `num_preemptions`.

Shutdown: `close()` stops the loop after the current step, finishes every pending request with finish
reason "abort", and joins the thread. It is idempotent.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from harness.server.cuda_graphs import MIN_PREFILL_TOKENS, StepGraphs
from harness.server.device_copies import to_device
from harness.server.histograms import (
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    Histogram,
    HistogramSnapshot,
)
from harness.server.kv_cache import (
    ATTN_IMPLEMENTATION,
    ForwardBatch,
    RowKVCache,
    attention_shape,
    check_model_supported,
    forward_context,
    register_attention,
)
from harness.server.prefix_cache import MISS, PrefixCache, PrefixHit, StoredPrefix
from harness.server.sampling import (
    PendingSample,
    RequestRandom,
    SamplingParams,
    draw_uniforms,
    launch_sampling,
    samples_in_graph,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from harness.server.lora import LoraAdapter

logger = logging.getLogger(__name__)

T = TypeVar("T")
FinishReason = Literal["stop", "length", "abort"]
PREFILL_RUNS = ("replayed", "captured", "eager")  # how a prefill's forward ran (`EngineStats`)
PauseMode = Literal["keep", "wait", "abort"]


class EngineClosedError(RuntimeError):
    """The engine is closed (or died); no request can be served."""


@dataclass
class GenerationOutput:
    """What a finished request produced.

    Attributes:
        request_id: The id given at submission.
        prompt_ids: The prompt.
        output_ids: Generated tokens, the stop token included.
        logprobs: Processed log-prob of each output token (None when not asked for).
        top_logprobs: Per output token, its (token id, log-prob) top-k, most likely first (None when not
            asked for).
        sampling_mask: Per output token, the ids it was drawn from (None when not asked for, or when the
            whole vocabulary was).
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or max_model_len) or "abort".
        stop_reason: The stop token id when a request's stop_token_ids ended it, else None.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason
    stop_reason: int | None = None
    sampling_mask: list[list[int]] | None = None


DoneCallback = Callable[[GenerationOutput | BaseException], None]


@dataclass
class EngineStats:
    """A snapshot for /metrics, refreshed after every step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int = 0  # of those, tokens whose keys were reused
    prefix_cache_enabled: bool = False
    num_finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    kv_cache_tokens: int = 0
    kv_cache_allocated_bytes: int = 0
    max_num_seqs: int = 0
    is_paused: bool = False
    weight_version: int = 0
    # Where the engine thread's time goes (seconds since start): prefill forwards (with their sampling),
    # the rest of each scheduling step ("decode": admission, launching the decode step, reading the one
    # before), waiting for work; what is left is commands and bookkeeping. A decode step is one forward
    # over every running row.
    decode_s: float = 0.0
    idle_s: float = 0.0
    num_prefill_requests: int = 0  # requests in the prefills, a group's twins counted once
    num_decode_steps: int = 0
    num_prefills_ahead: int = 0  # prefills launched behind a decode step in flight (async scheduling)
    # Prefills by how their forward ran (`PREFILL_RUNS`): "replayed" from a CUDA graph, "captured" into one
    # (then replayed), "eager" (CPU, LoRA, a shape not captured yet or too large for a graph): count and
    # seconds of each (for a prefill launched ahead, `num_prefills_ahead`, the seconds of its launch).
    prefills_by_run: dict[str, int] = field(default_factory=dict)
    prefill_s_by_run: dict[str, float] = field(default_factory=dict)
    # Each request that ended with "stop" or "length", from its submission to the engine: until it was
    # first admitted (queue time), until its first token, until it ended (vLLM's histograms of those names).
    queue_time: HistogramSnapshot = field(
        default_factory=lambda: HistogramSnapshot.empty(REQUEST_LATENCY_BUCKETS_S)
    )
    time_to_first_token: HistogramSnapshot = field(
        default_factory=lambda: HistogramSnapshot.empty(TTFT_BUCKETS_S)
    )
    e2e_latency: HistogramSnapshot = field(
        default_factory=lambda: HistogramSnapshot.empty(REQUEST_LATENCY_BUCKETS_S)
    )

    @property
    def prefill_s(self) -> float:
        return sum(self.prefill_s_by_run.values())

    @property
    def num_prefill_steps(self) -> int:
        return sum(self.prefills_by_run.values())


@dataclass
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    random: RequestRandom
    on_done: DoneCallback
    adapter: LoraAdapter | None
    arrival: int
    submitted_s: float  # time.monotonic() at submission
    tokens: list[int]
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[int, float]]] = field(default_factory=list)
    output_candidates: list[list[int]] = field(default_factory=list)
    num_cached: int = 0  # positions whose keys are in the cache row (or will be, once queued work runs)
    finished: bool = False
    admitted_s: float | None = None  # time.monotonic() when first admitted (a preempted one keeps it)
    first_token_s: float | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


@dataclass(eq=False)
class _StepInFlight:
    """A decode step queued on the device and not yet read: its requests in row order at launch."""

    requests: list[_Request]
    sample: PendingSample


class Engine:
    """Continuous batching over `model` (already on its device, in eval mode).

    Args:
        model: A causal LM that `kv_cache.check_model_supported` accepts.
        max_model_len: Longest prompt + output.
        eos_token_ids: Tokens that end a request (unless it sets ignore_eos).
        max_num_seqs: Most requests decoded at once.
        max_num_batched_tokens: Most prompt tokens prefilled in one step (one longer prompt still goes alone).
        kv_cache_tokens: KV budget in tokens (rows x longest sequence, a scratch row among them, and the
            prefix cache's store beside them); at least max_model_len.
        enable_prefix_caching: Reuse the keys of prompt prefixes seen before (`prefix_cache.py`).
        enforce_eager: On a CUDA device, run every forward eagerly instead of replaying decode steps from
            CUDA graphs (`cuda_graphs.py`) and small prefills too; as vLLM's --enforce-eager. CPU forwards
            are always eager.
        scheduler_delay_factor: While rows are decoding, admit waiting requests only once the oldest has
            waited this many times a prefill's duration (module docstring); 0 admits at every step.
        async_scheduling: Launch each decode step before reading the one before it, so the host's work on
            a step's results overlaps the device's next step (module docstring; vLLM's --async-scheduling).
            Only decode steps replayed through `StepGraphs` go ahead; others run as before.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_model_len: int,
        eos_token_ids: list[int],
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        kv_cache_tokens: int,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        scheduler_delay_factor: float = 0.0,
        async_scheduling: bool = False,
    ) -> None:
        check_model_supported(model)
        if not scheduler_delay_factor >= 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {scheduler_delay_factor}")
        if kv_cache_tokens < max_model_len:
            raise ValueError(
                f"kv_cache_tokens ({kv_cache_tokens}) must hold at least one sequence of max_model_len "
                f"({max_model_len}); raise kv_cache_tokens or lower max_model_len"
            )
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.device = model.device
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduler_delay_factor = scheduler_delay_factor
        self.async_scheduling = async_scheduling
        self.num_steps_ahead = 0  # decode steps launched before the previous one was read
        self._in_flight: _StepInFlight | None = None
        self._prefill_s: deque[float] = deque(maxlen=8)  # wall time of recent prefills (forward, sampling)
        self.eos_token_ids = frozenset(eos_token_ids)
        num_layers, num_kv_heads, head_dim = attention_shape(model)
        self.cache = RowKVCache(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=model.dtype,
            device=self.device,
            max_rows=max_num_seqs,
            max_length=max_model_len,
            capacity_tokens=kv_cache_tokens,
        )
        self.prefix_cache = PrefixCache(self.cache) if enable_prefix_caching else None
        self.graphs: StepGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = StepGraphs(model, self.cache)
        self._running: list[_Request] = []  # index = cache row
        self._waiting: deque[_Request] = deque()
        self._inbox: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._abort_ids: set[str] = set()
        self._abort_lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._paused = False
        self._draining: concurrent.futures.Future | None = None
        self._closing = False
        self._error: BaseException | None = None
        self._stats = EngineStats(kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs)
        self._counters = EngineStats(kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs)
        self._queue_time = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self._time_to_first_token = Histogram(TTFT_BUCKETS_S)
        self._e2e_latency = Histogram(REQUEST_LATENCY_BUCKETS_S)
        # Outputs of finished requests, handed to their callbacks once the stats that count them are
        # published: a client that has its answer never reads a /metrics that has not counted it yet.
        self._outputs: list[tuple[DoneCallback, GenerationOutput]] = []
        self._thread = threading.Thread(target=self._run, name="harness-engine", daemon=True)
        self._started = False

    # ------------------------------------------------------------------ public, any thread

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def warm_up(self) -> float:
        """Before `start`: run one prefill and one decode forward of 1 and of 2 rows, so that modules compiled
        with dynamic shapes (`harness/compiled_blocks.py`) compile before the first request rather than
        during it. Dynamic shapes still specialise a size of 1, so rows of 1 and of 2 (and prefills of 16
        tokens, decode steps of 1) cover the shapes the engine's forwards take. The forwards run eagerly
        (no graph is captured) on rows the first request overwrites; the cache is released after. Returns
        the seconds it took."""
        if self._started:
            raise RuntimeError("warm_up() runs before start(), on the caller's thread")
        started = time.perf_counter()
        forwards = StepGraphs(self.model, self.cache, capture=False)
        num_tokens = min(MIN_PREFILL_TOKENS, self.max_model_len - 1)
        with torch.inference_mode():
            for num_rows in range(1, min(2, self.cache.max_rows) + 1):
                self.cache.reserve(num_rows, num_tokens + 1)
                rows = list(range(num_rows))
                forwards.prefill(rows, [[0] * num_tokens] * num_rows, [0] * num_rows)
                forwards.decode([0] * num_rows, [num_tokens + 1] * num_rows)
            if self.graphs is not None:
                self.graphs.warm_up_sampling()
        self.cache.release()
        return time.perf_counter() - started

    def close(self) -> None:
        """Stop after the current step, abort whatever is pending, join the thread (idempotent)."""
        self._closing = True
        self._wake.set()
        if self._started and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine thread, if one did."""
        return self._error

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_done: DoneCallback,
        *,
        adapter: LoraAdapter | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; `on_done` is called once, on the engine thread, with its output or an error."""
        if self._closing or self._error is not None:
            raise EngineClosedError("the engine is closed") from self._error
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under max_model_len")
        arrival = next(self._ids)
        request = _Request(
            id=request_id or f"req-{arrival}",
            prompt_ids=list(prompt_ids),
            params=params,
            random=RequestRandom(params.seed),
            on_done=on_done,
            adapter=adapter,
            arrival=arrival,
            submitted_s=time.monotonic(),
            tokens=list(prompt_ids),
        )
        self._inbox.put(request)
        self._wake.set()
        return request.id

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away); it finishes with reason "abort" and frees its row."""
        with self._abort_lock:
            self._abort_ids.add(request_id)
        self._wake.set()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread between two steps (also while paused); its result in a future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._closing or self._error is not None:
            future.set_exception(EngineClosedError("the engine is closed"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def pause(self, mode: PauseMode = "keep") -> concurrent.futures.Future[None]:
        """Stop stepping. keep: freeze running requests; wait: let them finish first; abort: end them.

        The future resolves once the engine is paused. New requests queue meanwhile.
        """
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"unknown pause mode {mode!r} (keep, wait or abort)")
        outer: concurrent.futures.Future[None] = concurrent.futures.Future()

        def start_pause() -> None:
            if mode == "abort":
                for request in [*self._running, *self._waiting]:
                    self._finish(request, "abort")
                self._running.clear()
                self._waiting.clear()
            if mode == "wait" and self._running:
                self._draining = outer
                return
            self._paused = True
            outer.set_result(None)

        inner = self.call(start_pause)

        def forward_failure(future: concurrent.futures.Future) -> None:
            error = future.exception()
            if error is not None:
                outer.set_exception(error)

        inner.add_done_callback(forward_failure)
        return outer

    def resume(self) -> concurrent.futures.Future[None]:
        def do_resume() -> None:
            self._paused = False
            if self._draining is not None and not self._draining.done():
                self._draining.set_result(None)
            self._draining = None

        return self.call(do_resume)

    @property
    def is_paused(self) -> bool:
        return self._paused

    def stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ engine thread only

    def invalidate_cache(self) -> None:
        """Forget every cached key (the weights changed): running requests are recomputed on resume."""
        invalidated = [r for r in self._running if r.num_cached > 0]
        for request in invalidated:
            request.num_cached = 0
        self._counters.num_preemptions += len(invalidated)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the stored prefixes (/reset_prefix_cache); running requests keep their rows."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            for request in self._running:
                if request.num_cached:
                    self.prefix_cache.add_running(request)

    def bump_weight_version(self) -> None:
        self._counters.weight_version += 1

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._closing:
                    self._wake.clear()
                    self._run_commands()
                    self._take_inbox()
                    self._apply_aborts()
                    if self._draining is not None and not self._running:
                        self._paused = True
                        self._draining.set_result(None)
                        self._draining = None
                    if self._paused or not (self._running or self._waiting):
                        self._drain()
                        self._publish_stats()
                        self._deliver()
                        waited = time.perf_counter()
                        self._wake.wait(timeout=1.0)
                        self._counters.idle_s += time.perf_counter() - waited
                        continue
                    started, prefill_s = time.perf_counter(), self._counters.prefill_s
                    self._step()
                    self._counters.decode_s += (
                        time.perf_counter() - started - (self._counters.prefill_s - prefill_s)
                    )
                    self._publish_stats()
                    self._deliver()
        except BaseException as exc:
            logger.exception("the generation engine died")
            self._error = exc
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._closing = True
        if self._in_flight is not None:  # its results are dropped: every request ends as aborted below
            try:
                self._in_flight.sample.wait()
            except Exception:  # a device that failed: the requests still end below
                logger.exception("the decode step in flight failed at shutdown")
            self._in_flight = None
        self._take_inbox()
        pending = [*self._running, *self._waiting]
        self._running.clear()
        self._waiting.clear()
        for request in pending:
            if self._error is not None:
                request.on_done(EngineClosedError(f"the engine died: {self._error!r}"))
            else:
                self._finish(request, "abort")
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            future.set_exception(EngineClosedError("the engine is closed"))
        if self._draining is not None and not self._draining.done():
            self._draining.set_exception(EngineClosedError("the engine is closed"))
        self.cache.release()
        self._publish_stats()
        self._deliver()

    def _run_commands(self) -> None:
        if not self._commands.empty():
            self._drain()  # a command may change the weights, the rows or the cache: none may be in flight
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # the command's error goes to its caller, the engine carries on
                future.set_exception(exc)

    def _take_inbox(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _apply_aborts(self) -> None:
        with self._abort_lock:
            ids, self._abort_ids = self._abort_ids, set()
        if not ids:
            return
        self._drain()
        for request in [r for r in self._waiting if r.id in ids]:
            self._waiting.remove(request)
            self._finish(request, "abort")
        rows = [row for row, r in enumerate(self._running) if r.id in ids]
        for row in sorted(rows, reverse=True):
            self._finish(self._release_row(row), "abort")

    def _publish_stats(self) -> None:
        counters = self._counters
        longest = max((len(r.tokens) for r in self._running), default=0)
        self._stats = EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting) + self._inbox.qsize(),
            kv_cache_usage=min(1.0, len(self._running) * longest / self.cache.capacity_tokens),
            num_preemptions=counters.num_preemptions,
            num_prompt_tokens=counters.num_prompt_tokens,
            num_generation_tokens=counters.num_generation_tokens,
            num_prefix_cache_queries=counters.num_prefix_cache_queries,
            num_prefix_cache_hits=counters.num_prefix_cache_hits,
            prefix_cache_enabled=self.prefix_cache is not None,
            num_finished=dict(counters.num_finished),
            kv_cache_tokens=self.cache.capacity_tokens,
            kv_cache_allocated_bytes=self.cache.allocated_bytes,
            max_num_seqs=self.max_num_seqs,
            is_paused=self._paused,
            weight_version=counters.weight_version,
            decode_s=counters.decode_s,
            idle_s=counters.idle_s,
            num_prefill_requests=counters.num_prefill_requests,
            num_decode_steps=counters.num_decode_steps,
            num_prefills_ahead=counters.num_prefills_ahead,
            prefills_by_run=dict(counters.prefills_by_run),
            prefill_s_by_run=dict(counters.prefill_s_by_run),
            queue_time=self._queue_time.snapshot(),
            time_to_first_token=self._time_to_first_token.snapshot(),
            e2e_latency=self._e2e_latency.snapshot(),
        )

    # ------------------------------------------------------------------ scheduling

    def _step(self) -> None:
        if self._in_flight is not None:
            if self._can_decode_ahead():
                self._decode_ahead()
                return
            if not self._may_prefill_ahead():
                self._drain()
        self._admit()
        if self._in_flight is not None:
            if self._prefill_ahead():
                return
            self._drain()
        self._fit_budget()
        chosen, twins = self._choose_prefills()
        if chosen:
            started = time.perf_counter()
            run = self._prefill(chosen, twins)
            self._count_prefill(run, len(chosen), time.perf_counter() - started)
        if any(r.num_cached == len(r.tokens) - 1 for r in self._running):
            self._decode()

    def _choose_prefills(self) -> tuple[list[tuple[int, PrefixHit]], list[tuple[int, int]]]:
        """The rows to prefill in this step, each with its prefix hit, within the token budget; and the
        twins: (row, index in the chosen of the request with the same tokens), which share its prefill."""
        to_prefill = [row for row, r in enumerate(self._running) if r.num_cached == 0]
        budget = self.max_num_batched_tokens
        chosen: list[tuple[int, PrefixHit]] = []
        twins: list[tuple[int, int]] = []
        same_tokens: dict[tuple[int, tuple[int, ...]], int] = {}
        first_blocks: set[int] = set()
        for row in to_prefill:
            request = self._running[row]
            hit = MISS
            if self.prefix_cache is not None:
                key = (id(request.adapter), tuple(request.tokens))
                if key in same_tokens:  # a group's rollouts: one prefill, its keys and logits shared
                    twins.append((row, same_tokens[key]))
                    continue
                hit = self.prefix_cache.lookup(request.tokens, request.adapter)
                first = None
                if hit.length == 0 and self.device.type == "cpu":
                    first = self.prefix_cache.first_block(request.tokens, request.adapter)
                if first is not None:
                    if first in first_blocks:
                        # Shares a prefix with a request prefilled in this step: take it from that one's
                        # row in the next step instead of computing it twice now. Only on CPU, where
                        # compute is the cost; on CUDA a step is bound by launching kernels, and the extra
                        # step would cost more than the recomputed prefix.
                        continue
                    first_blocks.add(first)
                same_tokens[key] = len(chosen)
            size = len(request.tokens) - hit.length
            if chosen and size > budget:
                break
            chosen.append((row, hit))
            budget -= size
        return chosen, twins

    def _count_prefill(self, run: str, num_requests: int, elapsed: float, *, ahead: bool = False) -> None:
        counters = self._counters
        counters.num_prefill_requests += num_requests
        counters.prefills_by_run[run] = counters.prefills_by_run.get(run, 0) + 1
        counters.prefill_s_by_run[run] = counters.prefill_s_by_run.get(run, 0.0) + elapsed
        if ahead:
            counters.num_prefills_ahead += 1
        else:  # a prefill launched ahead took only its launch on the host: not the pace of the delay
            self._prefill_s.append(elapsed)

    def _admit(self) -> None:
        if self._draining is not None or self._delaying_admission():
            return
        longest = max((len(r.tokens) for r in self._running), default=0)
        budget = self.max_num_batched_tokens
        admitted = 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting[0]
            size = len(request.tokens)
            needed = max(longest, size + 1)
            if self._running and len(self._running) + 1 > self.cache.rows_fitting(needed):
                break
            if admitted and size > budget:
                break
            self._waiting.popleft()
            request.num_cached = 0
            if request.admitted_s is None:
                request.admitted_s = time.monotonic()
            self._running.append(request)
            longest = needed
            budget -= size
            admitted += 1

    def _delaying_admission(self) -> bool:
        """Whether waiting requests wait longer for others to share their prefill (module docstring)."""
        if not (self.scheduler_delay_factor and self._running and self._waiting and self._prefill_s):
            return False
        oldest = min(request.submitted_s for request in self._waiting)
        return time.monotonic() - oldest < self.scheduler_delay_factor * statistics.median(self._prefill_s)

    def _fit_budget(self) -> None:
        """Preempt the newest requests until their rows at the longest sequence fit the KV budget."""
        while len(self._running) > 1:
            longest = max(len(r.tokens) for r in self._running)
            if len(self._running) <= self.cache.rows_fitting(longest):
                return
            row = max(range(len(self._running)), key=lambda i: self._running[i].arrival)
            request = self._release_row(row)
            request.num_cached = 0
            self._waiting.appendleft(request)
            self._counters.num_preemptions += 1

    def _row_of(self, request: Any) -> int:
        return next(row for row, running in enumerate(self._running) if running is request)

    def _release_row(self, row: int) -> _Request:
        """Take the request out of `row`, moving the last row's request (and its cache) into the hole."""
        request = self._running[row]
        last = self._running.pop()
        if last is not request:
            self._running[row] = last
            if last.num_cached:
                self.cache.move_row(len(self._running), row, last.num_cached)
        return request

    # ------------------------------------------------------------------ forward passes

    def _lora_groups(self, requests: list[_Request]) -> list[tuple[Any, torch.Tensor]]:
        groups: dict[int, tuple[Any, list[int]]] = {}
        for index, request in enumerate(requests):
            if request.adapter is not None:
                groups.setdefault(id(request.adapter), (request.adapter, []))[1].append(index)
        return [
            (adapter, torch.tensor(indices, dtype=torch.long, device=self.device))
            for adapter, indices in groups.values()
        ]

    def _prefill(self, chosen: list[tuple[int, PrefixHit]], twins: list[tuple[int, int]]) -> str:
        """Prefill the chosen rows (each after its prefix hit, if any) in one forward; each twin (a row
        whose tokens equal those of chosen[index]) then gets that row's keys and samples from its logits.
        Returns how the forward ran: "replayed", "captured" (a CUDA graph) or "eager"."""
        run, requests, pending = self._launch_prefill(chosen, twins)
        self._collect(requests, pending)
        return run

    def _launch_prefill(
        self, chosen: list[tuple[int, PrefixHit]], twins: list[tuple[int, int]]
    ) -> tuple[str, list[_Request], PendingSample]:
        """`_prefill` up to its sampling step, queued and not read: how the forward ran, the requests in
        the order of the sampled rows, and the sampling step."""
        rows = [row for row, _ in chosen]
        requests = [self._running[row] for row in rows]
        starts = [hit.length for _, hit in chosen]
        lengths = [len(r.tokens) - start for r, start in zip(requests, starts, strict=True)]
        self.cache.reserve(len(self._running), max(len(r.tokens) for r in self._running))
        self._copy_prefixes(chosen)
        lora_groups = self._lora_groups(requests)
        logits, run = None, "eager"
        if self.graphs is not None and not lora_groups:
            logits = self.graphs.prefill(rows, [r.tokens for r in requests], starts)
            run = self.graphs.last_run if logits is not None else run
        if logits is None:
            logits = self._eager_prefill(rows, requests, starts, lengths, lora_groups)
        device = self.device
        entries = list(zip(rows, requests, strict=True))
        for row, index in twins:
            twin = self._running[row]
            self.cache.move_row(rows[index], row, len(twin.tokens))
            entries.append((row, twin))
            starts.append(len(twin.tokens))
        if twins:
            logits = torch.cat([logits, logits[to_device([index for _, index in twins], torch.long, device)]])
        for (_, request), start in zip(entries, starts, strict=True):
            request.num_cached = len(request.tokens)
            self._counters.num_prompt_tokens += len(request.tokens)
            if self.prefix_cache is not None:
                self._counters.num_prefix_cache_queries += len(request.tokens)
                self._counters.num_prefix_cache_hits += start
                self.prefix_cache.add_running(request)
        requests = [request for _, request in entries]
        return run, requests, self._launch_sample(requests, logits)

    def _eager_prefill(
        self,
        rows: list[int],
        requests: list[_Request],
        starts: list[int],
        lengths: list[int],
        lora_groups: list[tuple[Any, torch.Tensor]],
    ) -> torch.Tensor:
        """The prefill's forward, eagerly: new tokens left-padded into one batch; logits at each last one."""
        num_batch, num_tokens = len(rows), max(lengths)
        device = self.device
        input_ids = torch.zeros((num_batch, num_tokens), dtype=torch.long)
        for b, request in enumerate(requests):
            input_ids[b, num_tokens - lengths[b] :] = torch.tensor(request.tokens[starts[b] :])
        length_B, start_B = torch.tensor(lengths), torch.tensor(starts)
        token_T = torch.arange(num_tokens)
        pad_B = num_tokens - length_B
        valid_BT = token_T[None, :] >= pad_B[:, None]
        position_BT = (start_B[:, None] + token_T[None, :] - pad_B[:, None]).clamp(min=0)
        kv_length = 0
        if any(starts):  # queries attend over their rows: the copied prefix and the new keys
            kv_length = max(len(r.tokens) for r in requests)
            key_L = torch.arange(kv_length)
            mask = valid_BT[:, :, None] & (key_L[None, None, :] <= position_BT[:, :, None])
            # A padding query attends to position 0 only, so its softmax has something to normalise.
            mask |= (~valid_BT)[:, :, None] & (key_L == 0)[None, None, :]
            mask = mask[:, None]
        else:
            causal_TT = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
            mask = valid_BT[:, None, None, :] & causal_TT[None, None]
            # A padding query attends to itself only, so its softmax has something to normalise (no NaN).
            mask |= (~valid_BT)[:, None, :, None] & torch.eye(num_tokens, dtype=torch.bool)[None, None]
        write_b, write_t = valid_BT.nonzero(as_tuple=True)
        batch = ForwardBatch(
            mode="prefill",
            cache=self.cache,
            rows_B=torch.tensor(rows, dtype=torch.long).to(device),
            write_batch_N=write_b.to(device),
            write_token_N=write_t.to(device),
            write_position_N=position_BT[write_b, write_t].to(device),
            attn_mask=mask.to(device),
            kv_length=kv_length,
            lora_groups=lora_groups,
        )
        return self._forward(batch, input_ids.to(device), position_BT.to(device))

    def _copy_prefixes(self, chosen: list[tuple[int, PrefixHit]]) -> None:
        """Copy each hit's cached positions into its request's row; then let the store shrink to fit
        beside rows the cache may just have grown."""
        for row, hit in chosen:
            if isinstance(hit.source, StoredPrefix):
                self.cache.load_row(row, hit.source.keys_and_values, hit.length)
            elif hit.source is not None:
                self.cache.move_row(self._row_of(hit.source), row, hit.length)
        if self.prefix_cache is not None:
            self.prefix_cache.trim()

    def _decode(self) -> None:
        requests = list(self._running)
        num_rows = len(requests)
        lengths = [len(r.tokens) for r in requests]
        kv_length = max(lengths)
        self.cache.reserve(num_rows, kv_length)
        if self.prefix_cache is not None:
            self.prefix_cache.trim()
        # Rows still waiting for their prefill (the step's prefill budget ran out) ride along: their keys
        # are rewritten by that prefill, and their logits are ignored here.
        ready = [row for row, r in enumerate(requests) if r.num_cached == len(r.tokens) - 1]
        self._counters.num_decode_steps += 1
        lora_groups = self._lora_groups(requests)
        graphs = None if lora_groups else self.graphs  # the adapters' hooks are not in the graphs
        if graphs is not None and len(ready) == num_rows:
            pending = self._graph_step(requests, [r.tokens[-1] for r in requests], lengths)
            for request in requests:
                request.num_cached = len(request.tokens)
            if self._may_go_ahead(requests):
                self._in_flight = _StepInFlight(requests, pending)
            else:
                self._collect(requests, pending)
            return
        if graphs is not None:
            logits = graphs.decode([r.tokens[-1] for r in requests], lengths)
        else:
            logits = self._eager_decode(requests, lengths, lora_groups)
        for row in ready:
            requests[row].num_cached = len(requests[row].tokens)
        ready_requests = [requests[row] for row in ready]
        self._sample(ready_requests, logits[ready] if len(ready) < num_rows else logits)

    def _graph_step(
        self, requests: list[_Request], token_ids: list[int] | torch.Tensor, lengths: list[int]
    ) -> PendingSample:
        """Launch the graphed decode step of `requests` (rows 0..n-1) and its sampling: inside the step's
        graph when every row's sampling is its temperature alone (`samples_in_graph`), else after it."""
        assert self.graphs is not None
        params = [r.params for r in requests]
        if not (self.graphs.samples_in_graph and samples_in_graph(params)):
            return self._launch_sample(requests, self.graphs.decode(token_ids, lengths))
        temperatures = [p.applied_temperature for p in params]
        uniforms = draw_uniforms(params, [r.random for r in requests])
        tokens, packed = self.graphs.decode_and_sample(token_ids, lengths, temperatures, uniforms)
        return PendingSample(tokens, packed, 1, params, None)

    # ------------------------------------------------------------------ async scheduling

    def _may_go_ahead(self, requests: list[_Request]) -> bool:
        """Whether the next decode step of these requests may be launched before this one is read: the
        engine schedules ahead, and no request's next logits depend on the tokens not yet read (the
        repetition penalty reads them on the host)."""
        return self.async_scheduling and all(r.params.repetition_penalty == 1.0 for r in requests)

    def _can_decode_ahead(self) -> bool:
        """Whether the step in flight can be followed at once by the next decode step of the same rows.

        Not when requests wait to be admitted (they may be prefilled behind the step in flight instead:
        `_prefill_ahead`), nor when anything else changes the rows, the cache's storage or what a request
        needs from the host: preemption, a cache that must grow, commands and aborts (those two drain on
        their own).
        """
        assert self._in_flight is not None
        if self._draining is not None or self._paused or self.graphs is None or not self.graphs.enabled:
            return False
        num_rows = len(self._running)
        if not num_rows:
            return False
        if self._waiting and num_rows < self.max_num_seqs and not self._delaying_admission():
            return False
        longest = max(len(r.tokens) for r in self._running) + 1  # with the token in flight
        return num_rows <= self.cache.rows_fitting(longest) and self.cache.holds(num_rows, longest)

    def _decode_ahead(self) -> None:
        """Launch the next decode step from the sampled tokens of the step in flight, still on the device,
        then read the step in flight (its finished requests leave; their token from the new step is
        dropped when that step is read)."""
        previous = self._in_flight
        assert previous is not None and self.graphs is not None
        requests = list(self._running)
        tokens = previous.sample.token_ids_B
        # The rows are those of the step in flight, less the requests its reading ended (their rows refilled
        # by the last ones): each takes its token from where it sat in that step.
        if len(requests) != len(previous.requests) or any(
            a is not b for a, b in zip(requests, previous.requests, strict=True)
        ):
            position = {id(r): i for i, r in enumerate(previous.requests)}
            tokens = tokens[to_device([position[id(r)] for r in requests], torch.long, self.device)]
        self._launch_decode_ahead(requests, tokens, [len(r.tokens) + 1 for r in requests])
        self._collect(previous.requests, previous.sample)

    def _launch_decode_ahead(
        self, requests: list[_Request], tokens: torch.Tensor, lengths: list[int]
    ) -> None:
        """Launch the decode step of `requests` (rows 0..n-1) from input tokens on the device, unread."""
        pending = self._graph_step(requests, tokens, lengths)
        for request, length in zip(requests, lengths, strict=True):
            request.num_cached = length
        self._in_flight = _StepInFlight(requests, pending)
        self.num_steps_ahead += 1
        self._counters.num_decode_steps += 1

    def _may_prefill_ahead(self) -> bool:
        """Whether waiting requests may be admitted while the step in flight runs (`_prefill_ahead` then
        checks the rest), rather than after reading it."""
        return (
            self.async_scheduling
            and self._draining is None
            and not self._paused
            and self.graphs is not None
            and self.graphs.enabled
            and bool(self._waiting)
        )

    def _prefill_ahead(self) -> bool:
        """Prefill the requests just admitted behind the decode step in flight, then launch the next decode
        step of every row (the running rows' tokens from the step in flight, the new rows' first tokens
        from the prefill's sampling, both still on the device), and only then read the two. So an admission
        no longer idles the device while the host reads the step in flight and prepares the prefill, and
        then again while it reads the prefill's tokens. Returns False, having changed nothing, where that
        does not hold: the rows' cache must grow, a request needs the host between steps (an adapter, a
        repetition penalty), or not every new row fits this step's prefill; the caller then reads the step
        in flight and goes on as before. A prefix hit on a running row copies keys the step in flight does
        not touch (it writes past the tokens the host has read), after it on the device's stream."""
        previous = self._in_flight
        assert previous is not None and self.graphs is not None
        requests = list(self._running)
        new_rows = [row for row, r in enumerate(requests) if r.num_cached == 0]
        if not new_rows or any(r.adapter is not None for r in requests) or not self._may_go_ahead(requests):
            return False
        lengths = [len(r.tokens) + 1 for r in requests]  # with the token in flight, or the prefill's first
        longest = max(lengths)
        if len(requests) > self.cache.rows_fitting(longest) or not self.cache.holds(len(requests), longest):
            return False
        chosen, twins = self._choose_prefills()
        if sorted([row for row, _ in chosen] + [row for row, _ in twins]) != new_rows:
            return False
        started = time.perf_counter()
        run, prefilled, pending = self._launch_prefill(chosen, twins)
        self._count_prefill(run, len(chosen), time.perf_counter() - started, ahead=True)
        # The next step's input tokens: each row's from where it sat in the step in flight or the prefill.
        sources = [*previous.requests, *prefilled]
        position = {id(r): i for i, r in enumerate(sources)}
        tokens = torch.cat([previous.sample.token_ids_B, pending.token_ids_B])
        tokens = tokens[to_device([position[id(r)] for r in requests], torch.long, self.device)]
        self._launch_decode_ahead(requests, tokens, lengths)
        self._collect(previous.requests, previous.sample)
        self._collect(prefilled, pending)
        return True

    def _drain(self) -> None:
        """Read the step in flight, if any."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._collect(previous.requests, previous.sample)

    def _eager_decode(
        self, requests: list[_Request], lengths: list[int], lora_groups: list[tuple[Any, torch.Tensor]]
    ) -> torch.Tensor:
        num_rows, kv_length = len(requests), max(lengths)
        device = self.device
        length_B = torch.tensor(lengths)
        batch = ForwardBatch(
            mode="decode",
            cache=self.cache,
            rows_B=torch.arange(num_rows, device=device),
            write_batch_N=torch.arange(num_rows, device=device),
            write_token_N=torch.zeros(num_rows, dtype=torch.long, device=device),
            write_position_N=(length_B - 1).to(device),
            attn_mask=(torch.arange(kv_length)[None, :] < length_B[:, None])[:, None, None, :].to(device),
            kv_length=kv_length,
            lora_groups=lora_groups,
        )
        input_ids = torch.tensor([[r.tokens[-1]] for r in requests], device=device)
        return self._forward(batch, input_ids, (length_B - 1)[:, None].to(device))

    def _forward(
        self, batch: ForwardBatch, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        with forward_context(batch):
            output = self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1
            )
        return output.logits[:, -1]

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> None:
        self._collect(requests, self._launch_sample(requests, logits))

    def _launch_sample(self, requests: list[_Request], logits: torch.Tensor) -> PendingSample:
        return launch_sampling(
            logits,
            [r.params for r in requests],
            [r.random for r in requests],
            [r.tokens if r.params.repetition_penalty != 1.0 else [] for r in requests],
        )

    def _collect(self, requests: list[_Request], pending: PendingSample) -> None:
        """Append each request's sampled token (and log-probs), then end those that are done. A request that
        ended after this step was launched (a step ahead) gets nothing: that token is past its end."""
        sampled = pending.result()
        finished: list[_Request] = []
        for i, request in enumerate(requests):
            if request.finished:
                continue
            token = sampled.token_ids_B[i]
            request.tokens.append(token)
            if request.first_token_s is None:
                request.first_token_s = time.monotonic()
            self._counters.num_generation_tokens += 1
            if request.params.num_logprobs is not None:
                request.output_logprobs.append(sampled.logprobs_B[i])
                request.output_top.append(sampled.top_B[i])
            candidates = sampled.candidates_B[i]
            if candidates is not None:
                request.output_candidates.append(candidates)
            if self._stop_reason(request, token) is not None:
                finished.append(request)
        if not finished:
            return
        row_of = {id(r): row for row, r in enumerate(self._running)}
        for row in sorted((row_of[id(r)] for r in finished), reverse=True):
            if self.prefix_cache is not None:  # keep its keys before the row is refilled
                self.prefix_cache.retire(self._running[row], row)
            request = self._release_row(row)
            reason = self._stop_reason(request, request.tokens[-1])
            assert reason is not None  # the row finished for this reason
            self._finish(request, *reason)

    def _stop_reason(self, request: _Request, token: int) -> tuple[FinishReason, int | None] | None:
        params = request.params
        if token in params.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if request.num_output >= params.max_tokens or len(request.tokens) >= self.max_model_len:
            return "length", None
        return None

    def _finish(self, request: _Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        request.finished = True
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request)
        self._counters.num_finished[reason] += 1
        if reason != "abort" and request.admitted_s is not None and request.first_token_s is not None:
            self._queue_time.observe(request.admitted_s - request.submitted_s)
            self._time_to_first_token.observe(request.first_token_s - request.submitted_s)
            self._e2e_latency.observe(time.monotonic() - request.submitted_s)
        wants_logprobs = request.params.num_logprobs is not None
        output = GenerationOutput(
            request_id=request.id,
            prompt_ids=request.prompt_ids,
            output_ids=request.tokens[len(request.prompt_ids) :],
            logprobs=request.output_logprobs if wants_logprobs else None,
            top_logprobs=request.output_top if wants_logprobs else None,
            finish_reason=reason,
            stop_reason=stop_reason,
            sampling_mask=request.output_candidates or None,
        )
        self._outputs.append((request.on_done, output))

    def _deliver(self) -> None:
        """Hand the outputs finished since the last call to their callbacks (after `_publish_stats`)."""
        outputs, self._outputs = self._outputs, []
        for on_done, output in outputs:
            on_done(output)


__all__ = [
    "PREFILL_RUNS",
    "Engine",
    "EngineClosedError",
    "EngineStats",
    "GenerationOutput",
    "PauseMode",
]

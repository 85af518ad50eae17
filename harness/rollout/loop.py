"""AsyncRolloutLoop: generates and scores rollouts in the rollout worker process.

Each prompt goes through, in order (the reference's hooks; override them in a subclass and set it as
the trainer's `loop_cls`):

    filter_prompt(row_index, row, epoch)   -> generate for this prompt at all?
    generate_one(prompt, tools, group_id)  -> one Rollout; calls generate_one_turn per sampling request
    (the group's rewards: reward_funcs + environments' get_reward + Rollout.reward, summed)
    compute_advantages(group)              -> one advantage per rollout
    setup() / close()                      -> create and release what the hooks need, on the loop

Tasks, joined by a bounded queue (shutdown order: dispatch stops, in-flight groups finish or are
cancelled, scorers drain, then environments, sandboxes and the client close):

    dispatch ──(a task per group, its rollouts concurrent)──> score queue ──> scorers ──> rollout_buffer
    clock: heartbeat, metrics to the trainer, server load and the concurrency cap, stop requests

Around each rollout (`_run_rollout`, inside the rollout's own task so a slow reset or sandbox start
delays only it): an environment instance from its pool, a sandbox lease when the manifest asks for one,
reset, generate_one, get_reward. A rollout that fails for infrastructure reasons (a sandbox that would
not start or died, a tool that timed out, the server failing after retries, an exception in reset or
get_reward) becomes a Rollout with status "failed", counted by type and kept out of the group's
statistics and out of training (unless `score_infra_failures`); the worker carries on. `FailureBreaker`
stops the run if failures dominate. Generation goes through a `GenerationRouter` over the configured
servers (one or several, harness/generation/router.py), which shares the run's record of live servers with
the trainer's router (`server_states`): a turn on a server that dies is sent to another, a server the
trainer takes back after a weight sync is routed to again, and when no server is left its
`AllServersUnavailableError` stops the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import itertools
import logging
import math
import multiprocessing.synchronize
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import numpy as np

from environments.base import environment_tools
from environments.routing import RoutedEnvironment, reset_arguments, resolve_environments, route
from harness.config import AsyncGRPOConfig
from harness.generation.protocol import AllServersUnavailableError, GenerationError, SamplingConfig
from harness.generation.router import GenerationRouter
from harness.generation.server_states import ServerStates
from harness.metrics import MetricsWindow
from harness.packing import packed_token_count
from harness.rollout.chat import ChatRenderer
from harness.rollout.env_pool import EnvironmentPool, call_hook
from harness.rollout.metrics import record_group
from harness.rollout.pacing import ConcurrencyCap, FailureBreaker, TokenGate
from harness.rollout.reconcile import reconcile_metrics, reconcile_rollout
from harness.rollout.records import group_records
from harness.rollout.scoring import (
    RewardFunctionError,
    call_reward_funcs,
    group_advantages,
    is_degenerate,
    reward_func_name,
    sum_rewards,
)
from harness.rollout.sharing import WorkerShare
from harness.types import GroupResult, Rollout, RolloutGroup, TrainingSample, TurnRecord
from harness.weight_sync.strategies import adapter_name
from sandboxes import placement
from sandboxes.errors import INFRASTRUCTURE_ERRORS, SandboxError
from sandboxes.pool import SandboxPool
from tools import ToolExecutor, ToolResult, Toolset, ToolStats
from tools.threads import DaemonThreadPool

log = logging.getLogger(__name__)
LOAD_POLL_S = 5.0
METRICS_FLUSH_S = 1.0
NUM_SCORERS = 4
# the adapter version a rollout started under (adapter sync), set in its own task
_ROLLOUT_ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_adapter", default=None)
# the group a rollout belongs to, set in its own task: its turns' route key (one server per group)
_ROLLOUT_GROUP: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_group", default=None)


class InfrastructureFailure(RuntimeError):
    """A rollout stopped because the infrastructure failed (see the module docstring)."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


class AsyncRolloutLoop:
    """Generates and scores rollouts for AsyncGRPOTrainer, in the spawned rollout process.

    The reference's constructor; the shared values are multiprocessing objects the trainer created:
    `model_version_value` (the policy version), `token_allowance` (how many tokens the worker may have
    produced in all, see harness/rollout/pacing.py), `heartbeat_value` (set to time.time() every second),
    `failed_event` and `exception_info_queue` (a fatal error and its traceback), `metrics_queue` (logging
    windows), `rollout_buffer` (GroupResult items). Beyond the reference: `stop_event` asks for a
    graceful stop, `held_event` is set while the allowance holds generation with no group in flight (the
    trainer then knows no more samples are coming and trains on what it has), `dataset_skip_positions`
    are prompts a resumed run had done already (past `dataset_start_index`), `client` may be given
    (any harness.generation.protocol.SamplingServer; tests pass harness.testing.FakeGenerationServer),
    `share` is set when this is one of several worker processes (prompts and allowance shared, see
    harness/rollout/sharing.py), and `server_states` is the run's record of live servers, which the router
    built here shares with the trainer's (harness/generation/server_states.py).
    """

    def __init__(
        self,
        config: AsyncGRPOConfig,
        model_name: str,
        dataset: Any,
        reward_funcs: Sequence[Callable[..., Any]],
        processing_class: Any,
        eos_token_ids: Sequence[int],
        rollout_buffer: Any,
        model_version_value: Any,
        token_allowance: Any,
        heartbeat_value: Any,
        failed_event: Any,
        exception_info_queue: Any,
        metrics_queue: Any,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        dataset_start_index: int = 0,
        lora_name_prefix: str | None = None,
        dataset_skip_positions: Sequence[int] = (),
        *,
        stop_event: multiprocessing.synchronize.Event | None = None,
        held_event: multiprocessing.synchronize.Event | None = None,
        client: Any = None,
        share: WorkerShare | None = None,
        server_states: ServerStates | None = None,
    ):
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.tokenizer = processing_class
        self.eos_token_ids = set(eos_token_ids)
        self.rollout_buffer = rollout_buffer
        self.model_version_value = model_version_value
        self.token_allowance = token_allowance
        self.heartbeat_value = heartbeat_value
        self.failed_event = failed_event
        self.exception_info_queue = exception_info_queue
        self.metrics_queue = metrics_queue
        self.tools = list(tools or [])
        self.environments: dict[str, RoutedEnvironment] = resolve_environments(environment_factory)
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.lora_name_prefix = lora_name_prefix
        self.dataset_start_index = dataset_start_index
        self.dataset_skip_positions = frozenset(dataset_skip_positions)  # done before a resume
        self.stop_event = stop_event
        self.held_event = held_event
        self.client = client
        self.share = share  # set when this is one of several worker processes (harness/rollout/sharing.py)
        self.server_states = server_states
        self.sampling = SamplingConfig(
            max_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p or 0.0,
            repetition_penalty=config.repetition_penalty,
            num_logprobs=config.num_sampler_logprobs,
        )
        self.window = MetricsWindow()
        self.tool_stats = ToolStats()  # tool calls and parse errors, folded into the window at each flush
        self.group_ids = share.group_ids() if share is not None else itertools.count()
        self.generated_tokens = 0
        self.max_model_len: int | None = None
        self._last_flush = time.monotonic()

    # --- the hooks ------------------------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for a prompt; a rejected one counts as consumed. Admits every prompt."""
        return True

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Any], group_id: int = 0
    ) -> Rollout:
        """One rollout: the multi-turn tool loop until the model stops calling tools, the tool-calling
        iterations run out, or the conversation reaches max_model_len."""
        toolset = Toolset(tools)
        conversation = self.renderer.start(prompt, tools=toolset if len(toolset) else None)
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        completion_ids: list[int] = []
        tool_calls = tool_failures = iterations = 0
        stop_reason = "stop"
        while True:
            prompt_ids = conversation.prompt_ids()
            turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            completion_ids += turn.output_ids
            if turn.finish_reason == "prompt_too_long":
                stop_reason = "max_model_len"
                break
            parsed = self.renderer.parse(turn.output_ids, tools=toolset)
            if not len(toolset):  # nothing to call: whatever the reply looks like, it is the answer
                completion.append({"role": "assistant", "content": parsed.to_message()["content"]})
                stop_reason = "length" if turn.finish_reason == "length" else "stop"
                break
            self.tool_stats.record_parse_errors(parsed.errors)
            message = parsed.to_message()
            completion.append(message)
            if turn.finish_reason == "length":
                stop_reason = "length"
                break
            if not parsed.tool_calls and parsed.ok:
                break
            limit = self.config.max_tool_calling_iterations
            if limit is not None and iterations >= limit:
                stop_reason = "max_tool_calling_iterations"
                break
            iterations += 1
            conversation.add_reply(turn.output_ids, message)
            results = await self.executor.run(list(parsed.tool_calls), toolset)
            tool_calls += len(results)
            tool_failures += sum(not result.ok for result in results)
            self.tool_stats.record(results)
            infrastructure = next((result for result in results if result.infrastructure), None)
            if infrastructure is not None:
                error_type = infrastructure.error_type or infrastructure.status.value
                raise InfrastructureFailure(
                    error_type, f"tool {infrastructure.name}: {infrastructure.content}"
                )
            new_messages = [_tool_message(result) for result in results]
            parser = self.renderer.parser
            feedback = parser.error_message(parsed) if parsed.errors and parser is not None else None
            if feedback is not None:
                new_messages.append(feedback)
            completion += new_messages
            conversation.add_messages(new_messages)
        return Rollout(
            completion=completion,
            completion_ids=completion_ids,
            turns=turns,
            tool_call_count=tool_calls,
            tool_failure_count=tool_failures,
            stop_reason=stop_reason,
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's sampling settings; the rollout's group is its route key
        (with several servers, a group's rollouts go to one server, for its prefix cache)."""
        completion = await self.client.generate(
            prompt_ids, self.sampling, model=self.served_model(), route_key=_ROLLOUT_GROUP.get()
        )
        turn = completion.to_turn_record(prompt_ids)
        turn.finish_reason = completion.finish_reason
        self.generated_tokens += len(completion.output_ids)
        return turn

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """Each reward standardised within the group; NaN rewards get 0 and stay out of mean and std."""
        assert group.rewards is not None
        return group_advantages(group.rewards)

    async def setup(self) -> None:
        """Create what the other hooks need, on the loop's event loop. Nothing by default."""

    async def close(self) -> None:
        """Release what setup() created; runs when the loops stop, also on failure. Nothing by default."""

    # --- the process's main coroutine ------------------------------------------------------------------

    async def run(self) -> None:
        """Run until the prompts are exhausted, a stop is requested, or something fatal happens."""
        async with contextlib.AsyncExitStack() as stack:
            await self._open(stack)
            await self.setup()
            stack.push_async_callback(self.close)
            self.score_send, score_receive = anyio.create_memory_object_stream[tuple[RolloutGroup, float]](
                self.score_queue_maxsize
            )
            async with anyio.create_task_group() as group:
                self._task_group = group
                group.start_soon(self._clock)
                async with anyio.create_task_group() as scorers:
                    for _ in range(NUM_SCORERS):
                        scorers.start_soon(self._score_loop, score_receive.clone())
                    score_receive.close()
                    async with self.score_send:
                        await self._dispatch()
                group.cancel_scope.cancel()  # the clock
            self._flush_metrics()

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        config = self.config
        if self.client is None:
            self.client = await stack.enter_async_context(
                GenerationRouter.from_urls(
                    config.vllm_server_base_url,
                    model=self.model_name,
                    states=self.server_states,
                    timeout_s=config.vllm_server_timeout,
                    max_concurrency=config.max_concurrent_rollouts,
                )
            )
            await self.client.wait_until_ready()
        self.max_model_len = (await self.client.model_info()).max_model_len
        if self.sampling.truncates:  # the trainer renormalises over each token's candidate set
            message, biased = await self.client.describe_candidate_sets(self.sampling)
            log.log(logging.WARNING if biased else logging.INFO, message)
        self.renderer = ChatRenderer(
            self.tokenizer,
            chat_template_kwargs=_as_dict(config.chat_template_kwargs),
            tool_call_format=config.tool_call_format,
            check_fraction=config.render_check_frac,
            eos_token_ids=sorted(self.eos_token_ids),
        )
        self.executor = stack.enter_context(
            ToolExecutor(
                max_workers=config.max_concurrent_rollouts,
                timeout_s=config.tool_timeout_s,
                max_output_chars=config.tool_max_output_chars,
                parallel=config.parallel_tool_calls,
                infrastructure_errors=INFRASTRUCTURE_ERRORS,
            )
        )
        # sync environment hooks and reward functions: daemon threads, so one that never returns is
        # abandoned at its rollout's timeout and never holds the worker process at exit
        self.threads = DaemonThreadPool(config.max_concurrent_rollouts, name="rollout-hook")
        stack.callback(self.threads.shutdown)
        self.env_pools = {
            name: EnvironmentPool(routed, threads=self.threads) for name, routed in self.environments.items()
        }
        self.sandbox_pools: dict[Any, SandboxPool] = {}  # by the manifest's spec
        engine_overrides = config.sandbox_overrides()
        for routed in self.environments.values():
            spec = routed.manifest.sandbox
            if spec is not None and spec not in self.sandbox_pools:
                self.sandbox_pools[spec] = await stack.enter_async_context(
                    SandboxPool(
                        dataclasses.replace(spec, **engine_overrides),  # engines: only Docker reads them
                        min_idle=config.sandbox_min_idle,
                        max_total=config.max_concurrent_rollouts,
                        max_starting=config.sandbox_max_starting,
                        reuse=config.sandbox_reuse,
                    )
                )
        self.docker_engines = tuple(
            sorted(
                {
                    url
                    for pool in self.sandbox_pools.values()
                    if pool.spec.backend == "docker"
                    for url in placement.urls_of(pool.spec)
                }
            )
        )
        self._engine_losses_reported = 0
        for pool in self.env_pools.values():
            stack.push_async_callback(pool.close)
        first_load = await self.client.server_load()
        self.cap = ConcurrencyCap(config.max_concurrent_rollouts, self.max_model_len or 1, first_load)
        self.rollout_slots = anyio.CapacityLimiter(self.cap.value)
        self.gate = self.share.gate() if self.share is not None else TokenGate()
        self.breaker = FailureBreaker(config.failure_window, config.max_failure_frac)
        self.in_flight = 0

    # --- dispatch -----------------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        async with anyio.create_task_group() as groups:
            self._groups_scope = groups.cancel_scope
            accepted_this_epoch, current_epoch = 0, None
            # another process may have taken an epoch's accepted prompts: only one worker can tell
            whole_epochs = self.share is None or self.share.count == 1
            for position, row_index, epoch, row in self._prompt_stream():
                if self._stop_requested():
                    break
                if epoch != current_epoch:
                    if whole_epochs and current_epoch is not None and accepted_this_epoch == 0:
                        raise RuntimeError(f"filter_prompt rejected every prompt of epoch {current_epoch}")
                    current_epoch, accepted_this_epoch = epoch, 0
                if not self.filter_prompt(row_index, row, epoch):
                    self.rollout_buffer.put(GroupResult(position, row_index, []))
                    continue
                accepted_this_epoch += 1
                if not await self._wait_to_start_group():
                    break  # a stop was asked for
                groups.start_soon(self._run_group, position, row_index, row)

    def _prompt_stream(self) -> Iterator[tuple[int, int, int, dict[str, Any]]]:
        """(position, row index, epoch, row) forever, or for the configured epochs: each epoch a fresh
        seeded shuffle; environment-only runs get empty rows."""
        if self.dataset is None:
            for position in self._positions():
                yield position, position, 0, {}
        if not hasattr(self.dataset, "__len__"):  # a streaming dataset cannot be repositioned
            for index, row in enumerate(self.dataset):
                if self.share is None or self.share.owns_streamed_row(index):
                    yield index, index, 0, dict(row)
            return
        size = len(self.dataset)
        if size == 0:
            raise ValueError("the training dataset is empty")
        epochs = math.ceil(self.config.num_train_epochs) if self.config.max_steps <= 0 else None
        order_epoch, order = -1, np.arange(0)
        for position in self._positions():
            if epochs is not None and position >= epochs * size:
                return
            epoch, index = divmod(position, size)
            if epoch != order_epoch:
                order_epoch, order = epoch, np.random.default_rng(self.config.seed + epoch).permutation(size)
            row_index = int(order[index])
            yield position, row_index, epoch, dict(self.dataset[row_index])

    def _positions(self) -> Iterator[int]:
        """Prompt positions from dataset_start_index on, less those done before a resume; with several worker
        processes, those this one claims from the shared cursor (which starts at dataset_start_index)."""
        if self.share is not None:
            positions = self.share.claim_positions()
        else:
            positions = itertools.count(self.dataset_start_index)
        for position in positions:
            if position not in self.dataset_skip_positions:
                yield position

    async def _wait_to_start_group(self) -> bool:
        """Wait until the token allowance admits another group and the concurrency cap has room for it,
        and count it as started; False when a stop came first."""
        await anyio.lowlevel.checkpoint()
        waited = 0.0
        while not self._try_start_group():
            if self._stop_requested():
                return False
            if self.held_event is not None and self.gate.in_flight_everywhere == 0:
                # nothing more reaches the queue until the allowance is raised (with several processes:
                # none has a group in flight, so none can finish one and change what the gate says)
                self.held_event.set()
            await anyio.sleep(0.01)
            waited += 0.01
        if self.held_event is not None:
            self.held_event.clear()
        if waited:
            self.window.add("rollout/backpressure_s", waited)
        return True

    def _try_start_group(self) -> bool:
        # Rollouts beyond the cap would only queue for a slot; keep at most one group's worth waiting.
        reserved = self.gate.groups_in_flight * self.config.num_generations
        if reserved >= self.rollout_slots.total_tokens:
            return False
        return self.gate.try_start(int(self.token_allowance.value))

    # --- a group and its rollouts ---------------------------------------------------------------------

    async def _run_group(self, position: int, row_index: int, row: dict[str, Any]) -> None:
        group_id = next(self.group_ids)
        model_version = int(self.model_version_value.value)
        size = self.config.num_generations
        results: list[tuple[Rollout, list[dict[str, Any]], tuple[type, float] | None]] = [None] * size  # type: ignore[list-item]

        async def one(index: int) -> None:
            results[index] = await self._run_rollout(row, group_id)

        async with anyio.create_task_group() as rollouts:
            for index in range(size):
                rollouts.start_soon(one, index)
        columns = {key: [value] * size for key, value in row.items() if key != "prompt"}
        group = RolloutGroup(
            prompts=[prompt for _, prompt, _ in results],
            reward_kwargs=columns,
            completions=[rollout.completion for rollout, _, _ in results],
            completions_ids=[rollout.completion_ids for rollout, _, _ in results],
            completions_sequences=[[] for _ in results],
            tool_call_counts=[rollout.tool_call_count for rollout, _, _ in results],
            tool_failure_counts=[rollout.tool_failure_count for rollout, _, _ in results],
            model_version=model_version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=[env_reward for _, _, env_reward in results],
            rollout_rewards=[rollout.reward for rollout, _, _ in results],
            rollouts=[rollout for rollout, _, _ in results],
        )
        group.queued_at = time.monotonic()
        started = time.monotonic()
        await self.score_send.send((group, position))
        blocked = time.monotonic() - started
        if blocked > 1e-3:
            self.window.add("rollout/score_block_s", blocked)
        # completed groups waiting for a scorer (this one included, unless a scorer took it already)
        self.window.add("rollout/score_queue_size", self.score_send.statistics().current_buffer_used)

    def served_model(self) -> str | None:
        """The model name a request sends: the rollout's adapter version under adapter sync (pinned when
        the rollout started, so it finishes under one policy), else `lora_name` (None: the served model)."""
        pinned = _ROLLOUT_ADAPTER.get()
        if pinned is not None:
            return pinned
        if self.lora_name_prefix is not None:
            return adapter_name(self.lora_name_prefix, int(self.model_version_value.value))
        return self.lora_name

    async def _run_rollout(
        self, row: dict[str, Any], group_id: int
    ) -> tuple[Rollout, list[dict[str, Any]], tuple[type, float] | None]:
        """One rollout in its own task: environment and sandbox, reset, generate_one, get_reward."""
        _ROLLOUT_GROUP.set(group_id)  # this task's context only
        if self.lora_name_prefix is not None:
            _ROLLOUT_ADAPTER.set(adapter_name(self.lora_name_prefix, int(self.model_version_value.value)))
        async with self.rollout_slots:
            self.in_flight += 1
            started = time.monotonic()
            routed = route(row, self.environments) if self.environments else None
            prompt = _prompt_of(row, None)
            env_reward = None
            try:
                if routed is None:
                    rollout = await self.generate_one(prompt, self.tools, group_id)
                else:
                    rollout, prompt, env_reward = await self._run_in_environment(routed, row, group_id)
            except AllServersUnavailableError:
                raise  # no server left: the run stops, no rollout can succeed
            except InfrastructureFailure as exc:
                rollout = _failed(exc.error_type, str(exc))
            except (GenerationError, SandboxError) as exc:
                rollout = _failed(type(exc).__name__, str(exc))
            except TimeoutError as exc:
                rollout = _failed("EpisodeTimeout", str(exc) or "the episode ran past episode_timeout_s")
            except Exception as exc:  # environment code or a custom generate_one: data, not a crash
                log.warning("rollout failed: %s: %s", type(exc).__name__, exc, exc_info=True)
                rollout = _failed(type(exc).__name__, str(exc), logged=True)
            finally:
                self.in_flight -= 1
                self.cap.rollout_finished()
            if routed is not None:
                rollout.environment = routed.name
            self.window.add("rollout/duration_s", time.monotonic() - started)
            self.breaker.record(rollout.failed, rollout.error_type or "")
            return rollout, prompt, env_reward

    async def _run_in_environment(
        self, routed: RoutedEnvironment, row: dict[str, Any], group_id: int
    ) -> tuple[Rollout, list[dict[str, Any]], tuple[type, float] | None]:
        manifest = routed.manifest
        sandbox_pool = self.sandbox_pools.get(manifest.sandbox) if manifest.sandbox is not None else None
        with anyio.fail_after(manifest.episode_timeout_s):
            async with self.env_pools[routed.name].instance() as env, contextlib.AsyncExitStack() as lease:
                if sandbox_pool is not None:
                    leased_at = time.monotonic()
                    env.sandbox = await lease.enter_async_context(sandbox_pool.lease())
                    self.window.add(f"env/{routed.name}/sandbox_acquire_s", time.monotonic() - leased_at)
                try:
                    started = time.monotonic()
                    reset_text = await call_hook(env.reset, threads=self.threads, **reset_arguments(row))
                    self.window.add("env/reset_s", time.monotonic() - started)
                    prompt = _prompt_of(row, reset_text)
                    tools = [*self.tools, *environment_tools(env, manifest).values()]
                    rollout = await self.generate_one(prompt, tools, group_id)
                    env_reward = None
                    get_reward = getattr(env, "get_reward", None)
                    if callable(get_reward) and not rollout.failed:
                        started = time.monotonic()
                        value = await call_hook(get_reward, threads=self.threads)
                        self.window.add("env/reward_s", time.monotonic() - started)
                        env_reward = (routed.cls, float(value))
                finally:
                    env.sandbox = None
        return rollout, prompt, env_reward

    # --- scoring ----------------------------------------------------------------------------------------

    async def _score_loop(self, receive: Any) -> None:
        async with receive:
            async for group, position in receive:
                self.window.add("rollout/score_wait_s", time.monotonic() - group.queued_at)
                started = time.monotonic()
                result = await self._score(group, position)
                self.window.add("rollout/score_s", time.monotonic() - started)
                self.gate.group_finished(result.num_tokens)
                self._flush_metrics()  # the group's metrics reach the trainer before its samples do
                self.rollout_buffer.put(result)

    async def _score(self, group: RolloutGroup, position: int) -> GroupResult:
        rollouts = group.rollouts
        size = len(rollouts)
        counted = [not rollout.failed or self.config.score_infra_failures for rollout in rollouts]
        rewards_F_G = np.full((len(self.reward_funcs), size), np.nan)
        kept = [index for index in range(size) if counted[index]]  # reward functions never see failures
        try:
            if kept:
                rewards_F_G[:, kept] = await call_reward_funcs(
                    self.reward_funcs,
                    [group.prompts[i] for i in kept],
                    [group.completions[i] for i in kept],
                    [group.completions_ids[i] for i in kept],
                    {key: [values[i] for i in kept] for key, values in group.reward_kwargs.items()},
                    threads=self.threads,
                )
        except RewardFunctionError as exc:  # the group is dropped (all NaN), its rollouts still recorded
            log.error("group %d dropped: %s", group.group_id, exc)
            self.window.add("rollout/reward_error_count", 1)
        env_values = [None if reward is None else reward[1] for reward in group.env_rewards]
        total_G = sum_rewards(rewards_F_G, env_values, group.rollout_rewards)
        total_G[~np.array(counted)] = np.nan  # infrastructure failures stay out of the baseline
        group.rewards = total_G
        advantages_G = np.asarray(self.compute_advantages(group), dtype=np.float64)
        dropped = is_degenerate(total_G)
        samples: list[TrainingSample] = []
        reconciled = []
        trained = [False] * size
        for index, rollout in enumerate(rollouts):
            if not rollout.turns:
                continue
            result = reconcile_rollout(rollout.turns, rollout_id=rollout.rollout_id)
            reconciled.append(result)
            group.completions_sequences[index] = result.sequences
            if dropped or not counted[index] or math.isnan(total_G[index]):
                continue
            trained[index] = True
            samples += [
                TrainingSample(sequence, float(advantages_G[index]), group.group_id, group.model_version)
                for sequence in result.sequences
                if sequence.num_trained
            ]
        now = time.monotonic()
        for sample in samples:
            sample.queued_at = now
        self.window.add_many(reconcile_metrics(reconciled))
        names, rewards_S_G = self._reward_sources(rewards_F_G, group)
        record_group(
            self.window,
            rollouts=rollouts,
            source_names=names,
            rewards_S_G=rewards_S_G,
            total_G=total_G,
            dropped=dropped,
            num_samples=len(samples),
            eos_token_ids=self.eos_token_ids,
            has_tools=bool(self.tools or self.environments),
            per_environment=len(self.environments) > 1,
        )
        records = []
        if self._wants_records(position):
            records = group_records(
                group,
                position=position,
                source_names=names,
                rewards_S_G=rewards_S_G,
                total_G=total_G,
                advantages_G=advantages_G,
                dropped=dropped,
                trained=trained,
            )
        return GroupResult(position, group.row_index, samples, packed_token_count(samples), records)

    def _wants_records(self, position: int) -> bool:
        """Whether this group's rollouts go to the trainer as records (printed, saved, reported)."""
        config = self.config
        every = getattr(config, "save_rollouts_every", 1)
        return bool(getattr(config, "log_completions", False)) or (
            bool(getattr(config, "save_rollouts", False)) and position % every == 0
        )

    def _reward_sources(self, rewards_F_G: np.ndarray, group: RolloutGroup) -> tuple[list[str], np.ndarray]:
        names = [reward_func_name(func) for func in self.reward_funcs]
        rows = [rewards_F_G]
        by_env: dict[str, np.ndarray] = {}
        for index, reward in enumerate(group.env_rewards):
            if reward is not None:
                cls, value = reward
                routed = next((r for r in self.environments.values() if r.cls is cls), None)
                name = routed.reward_names[0] if routed is not None and routed.reward_names else cls.__name__
                by_env.setdefault(name, np.full(len(group.env_rewards), np.nan))[index] = value
        names += list(by_env)
        rows += [values[None, :] for values in by_env.values()]
        return names, np.concatenate(rows, axis=0) if rows else np.empty((0, len(group.env_rewards)))

    # --- the clock --------------------------------------------------------------------------------------

    async def _clock(self) -> None:
        last_poll = 0.0
        while True:
            self.heartbeat_value.value = time.time()
            if self._stop_requested() and getattr(self, "_groups_scope", None) is not None:
                self._groups_scope.cancel()  # stop now: in-flight rollouts are abandoned, not finished
            now = time.monotonic()
            if now - last_poll >= LOAD_POLL_S:
                last_poll = now
                await self._poll_server()
            self.window.add("rollout/concurrency", self.in_flight)
            self.window.add("rollout/concurrency_cap", self.rollout_slots.total_tokens)
            self._flush_metrics()
            await anyio.sleep(METRICS_FLUSH_S)

    async def _poll_server(self) -> None:
        try:
            load = await self.client.server_load()
        except GenerationError:
            return
        if load is None:
            return
        self.cap.update(load)
        self.rollout_slots.total_tokens = self.cap.value
        if load.kv_cache_usage is not None:
            self.window.add("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage)
        self.window.add("rollout/vllm_running_requests", load.num_running)
        self.window.add("rollout/vllm_queued_requests", load.num_waiting)
        previous = getattr(self, "_preemptions", load.num_preemptions)
        self.window.add("rollout/vllm_preemption_count", max(load.num_preemptions - previous, 0))
        self._preemptions = load.num_preemptions
        if load.prefix_cache_queries is not None and load.prefix_cache_hits is not None:
            queries, hits = getattr(self, "_prefix_cache_counts", (0, 0))
            if load.prefix_cache_queries > queries:  # prompt tokens since the previous poll
                self.window.add(
                    "rollout/vllm_prefix_cache_hit_frac",
                    (load.prefix_cache_hits - hits) / (load.prefix_cache_queries - queries),
                )
            self._prefix_cache_counts = (load.prefix_cache_queries, load.prefix_cache_hits)

    def _flush_metrics(self) -> None:
        now = time.monotonic()
        self.window.add_rate("rollout/generated_tokens_per_s", self.generated_tokens, now - self._last_flush)
        self.generated_tokens, self._last_flush = 0, now
        self.window.add_many(self.client.pop_metrics())
        if self.docker_engines:
            self.window.add_many(self._engine_metrics())
        self.window.add_many(self.renderer.stats.summary())
        self.renderer.stats.reset()
        if self.tool_stats:
            weights = self.tool_stats.weights()
            for name, value in self.tool_stats.summary(hung_threads=self.executor.hung_threads).items():
                self.window.add(name, value, weight=weights.get(name, 1.0))
            self.tool_stats.reset()
        if self.window:
            self.metrics_queue.put(self.window.state())
            self.window.reset()

    def _engine_metrics(self) -> dict[str, float]:
        """sandbox/engines_live (Docker engines answering), sandbox/containers (this run's sandboxes on
        them) and sandbox/engine_lost_count (engines lost since the previous flush)."""
        engines = placement.snapshot(self.docker_engines).values()
        losses = sum(engine["num_lost"] for engine in engines)
        metrics = {
            "sandbox/engines_live": float(sum(not engine["lost"] for engine in engines)),
            "sandbox/containers": float(sum(engine["sandboxes"] for engine in engines)),
            "sandbox/engine_lost_count": float(losses - self._engine_losses_reported),
        }
        self._engine_losses_reported = losses
        return metrics

    def _stop_requested(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()


def _prompt_of(row: Mapping[str, Any], reset_text: str | None) -> list[dict[str, Any]]:
    """The prompt messages of a row, with the text reset returned appended to the last user message (or
    as the user message when the row has no prompt)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        raise ValueError("prompts must be conversational (a list of messages), not a plain string")
    messages = copy.deepcopy(list(prompt or []))
    if reset_text:
        if messages and messages[-1].get("role") == "user":
            messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{reset_text}"}
        else:
            messages.append({"role": "user", "content": reset_text})
    return messages


def _tool_message(result: ToolResult) -> dict[str, Any]:
    message = {"role": "tool", "name": result.name, "content": result.content}
    if result.call.id is not None:
        message["tool_call_id"] = result.call.id
    return message


def _failed(error_type: str, message: str, *, logged: bool = False) -> Rollout:
    """A rollout the infrastructure failed; the failure is logged (once) as well as counted."""
    if not logged:
        log.warning("rollout failed (%s): %s", error_type, message[:500])
    return Rollout(
        completion=[],
        completion_ids=[],
        turns=[],
        status="failed",
        error_type=error_type,
        error=message[:2000],
        stop_reason="failed",
    )


def _as_dict(value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    import json

    return json.loads(value)

"""The rollout loop at unit level: the shared generation double (harness.testing.FakeGenerationServer,
scripted per test) with the tiny tokenizer, real environments, tools, scoring and reconciliation."""

from __future__ import annotations

import json
import queue
import threading
import types

import anyio
import numpy as np
import pytest

from harness.config import AsyncGRPOConfig
from harness.packing import packed_token_count
from harness.rollout.loop import AsyncRolloutLoop
from harness.rollout.pacing import TokenGate
from harness.testing import FakeGenerationServer, build_tiny_tokenizer
from harness.types import GroupResult
from sandboxes.errors import SandboxDied

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def make_loop(
    script,
    *,
    loop_cls=AsyncRolloutLoop,
    dataset=None,
    reward_funcs=(),
    env=None,
    tools=None,
    tmp_path=None,
    **config,
):
    tokenizer = build_tiny_tokenizer()
    settings = dict(output_dir=str(tmp_path), num_generations=4, max_steps=1, max_completion_length=64)
    settings.update(config)
    loop = loop_cls(
        AsyncGRPOConfig(**settings),
        "tiny",
        dataset,
        list(reward_funcs),
        tokenizer,
        [tokenizer.convert_tokens_to_ids("<|im_end|>")],
        rollout_buffer=queue.Queue(),
        model_version_value=types.SimpleNamespace(value=3),
        token_allowance=types.SimpleNamespace(value=1 << 40),
        heartbeat_value=types.SimpleNamespace(value=0.0),
        failed_event=None,
        exception_info_queue=None,
        metrics_queue=queue.Queue(),
        tools=tools,
        environment_factory=env,
        client=FakeGenerationServer(script, tokenizer=tokenizer),
    )
    return loop


async def run_groups(loop: AsyncRolloutLoop, num_groups: int) -> list[GroupResult]:
    """Run the loop until `num_groups` results arrive, then stop it."""
    results: list[GroupResult] = []
    stop = anyio.Event()
    loop.stop_event = types.SimpleNamespace(is_set=stop.is_set)

    async def collect() -> None:
        while len(results) < num_groups:
            try:
                results.append(loop.rollout_buffer.get_nowait())
            except queue.Empty:
                await anyio.sleep(0.01)
        stop.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(collect)
            await loop.run()
    return results[:num_groups]


def metrics(loop: AsyncRolloutLoop) -> dict[str, float]:
    from harness.metrics import MetricsWindow

    window = MetricsWindow()
    while not loop.metrics_queue.empty():
        window.merge(loop.metrics_queue.get())
    return window.summary()


def prompt_rows(*texts: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": text}], "answer": text[::-1]} for text in texts]


def exact_reverse(completions, answer, **kwargs):
    return [1.0 if c[-1]["content"] == a else 0.0 for c, a in zip(completions, answer, strict=True)]


async def test_single_turn_groups_are_scored_and_standardised(tmp_path):
    def script(prompt: str, call: int) -> str:  # half the rollouts answer right
        word = prompt.split("user\n")[-1].split("<|im_end|>")[0]
        return word[::-1] if call % 2 else "no idea"

    loop = make_loop(
        script, dataset=prompt_rows("abc", "hello"), reward_funcs=[exact_reverse], tmp_path=tmp_path
    )
    (first, second) = await run_groups(loop, 2)
    for result in (first, second):
        assert len(result.samples) == 4
        advantages = sorted(sample.advantage for sample in result.samples)
        assert advantages[0] < 0 < advantages[-1] and abs(sum(advantages)) < 1e-9
        assert all(sample.model_version == 3 for sample in result.samples)
        for sample in result.samples:
            sequence = sample.sequence
            assert sequence.num_trained > 0 and sequence.input_ids[-1] == loop.client.eos
        raw = sum(len(s.sequence.input_ids) for s in result.samples)
        assert result.num_tokens == packed_token_count(result.samples) < raw  # the prompt counted once
    summary = metrics(loop)
    assert summary["reward"] == 0.5 and summary["frac_reward_zero_std"] == 0.0
    assert summary["rewards/exact_reverse/mean"] == 0.5


async def test_equal_rewards_drop_the_group_but_count_it(tmp_path):
    loop = make_loop(
        lambda prompt, call: "same",
        dataset=prompt_rows("abc"),
        reward_funcs=[exact_reverse],
        tmp_path=tmp_path,
    )
    (result,) = await run_groups(loop, 1)
    assert result.samples == [] and result.position == 0
    summary = metrics(loop)
    assert summary["frac_reward_zero_std"] == 1.0 and summary["reward_dropped"] == 0.0
    assert summary["completions/duplicate_frac"] == 0.75  # 3 of 4 repeat the first


async def test_environment_multi_turn_tool_loop_and_environment_reward(tmp_path):
    def script(prompt: str, call: int) -> str:
        target = int(prompt.split("Increment the counter by ")[1][0])
        steps = prompt.count("<tool_response>")
        if steps < target:
            return tool_call("increment", {"step": 1})
        return "done"

    loop = make_loop(script, env="counter", reward_funcs=[], tmp_path=tmp_path, num_generations=2, seed=0)
    # Counter's targets come from the row seed; rows here are empty (environment-only), so each rollout
    # samples its own target and the group can disagree only through the policy, which is perfect here.
    (_result,) = await run_groups(loop, 1)
    summary = metrics(loop)
    assert summary["tools/increment/call_count"] >= 2
    assert summary["tools/failure_frequency"] == 0.0
    assert summary["rewards/reached_target/mean"] == 1.0
    assert summary["rollout/turns_max"] >= 2


async def test_multi_environment_routing_renders_only_the_rows_environment(tmp_path):
    seen_tools: list[tuple[bool, bool]] = []

    def script(prompt: str, call: int) -> str:
        seen_tools.append(('"increment"' in prompt, '"calculator"' in prompt))
        return "ok"

    rows = [{"environment": "count", "target": 2}, {"environment": "math", "seed": 5}]
    loop = make_loop(
        script,
        dataset=rows,
        env={"count": "counter", "math": "arithmetic"},
        tmp_path=tmp_path,
        num_generations=2,
    )
    await run_groups(loop, 2)
    assert set(seen_tools) == {(True, False), (False, True)}  # each prompt shows one environment's tools


class FlakySandboxEnv:
    """An environment whose tool hits a dead sandbox on odd instances."""

    instances = 0

    def __init__(self) -> None:
        FlakySandboxEnv.instances += 1
        self.broken = FlakySandboxEnv.instances % 2 == 1

    def reset(self, **row) -> str:
        return "Call probe."

    def probe(self) -> str:
        """Probe the sandbox."""
        if self.broken:
            raise SandboxDied("sandbox sb-1 died: its container no longer exists")
        return "fine"

    def get_reward(self) -> float:
        return 1.0


async def test_infrastructure_failures_are_typed_and_kept_out_of_the_group(tmp_path):
    FlakySandboxEnv.instances = 0

    def script(prompt: str, call: int) -> str:
        return tool_call("probe", {}) if "<tool_response>" not in prompt else "done"

    loop = make_loop(script, env=FlakySandboxEnv, tmp_path=tmp_path, num_generations=4)
    (result,) = await run_groups(loop, 1)
    summary = metrics(loop)
    assert summary["rollout/failed_count"] >= 1
    assert summary["rollout/failed/SandboxDied_count"] == summary["rollout/failed_count"]
    assert result.samples == []  # the healthy ones all scored 1.0: a zero-std group, failures not counted


async def test_server_failure_after_retries_fails_the_rollout_not_the_worker(tmp_path):
    loop = make_loop(
        lambda prompt, call: None if call <= 2 else "x",
        dataset=prompt_rows("ab"),
        reward_funcs=[exact_reverse],
        tmp_path=tmp_path,
    )
    (result,) = await run_groups(loop, 1)
    summary = metrics(loop)
    assert summary["rollout/failed/GenerationError_count"] == 2
    assert result.samples == []


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """The reference's curriculum example: skip prompts the policy already solves."""

    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < 0.9

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


async def test_curriculum_subclass_filters_solved_prompts(tmp_path):
    def script(prompt: str, call: int) -> str:
        word = prompt.split("user\n")[-1].split("<|im_end|>")[0]
        return word[::-1] if word == "solved" or call % 2 else "nope"

    loop = make_loop(
        script,
        loop_cls=CurriculumRolloutLoop,
        dataset=prompt_rows("solved", "open"),
        reward_funcs=[exact_reverse],
        tmp_path=tmp_path,
        max_steps=-1,
        num_train_epochs=3,
    )
    results = await run_groups(loop, 6)
    by_epoch = [(r.position // 2, r.row_index, bool(r.samples) or r.position < 2) for r in results]
    solved_row = 0
    later = [row for epoch, row, _ in by_epoch if epoch > 0]
    assert later.count(solved_row) == 2  # still counted per epoch, as a filtered (empty) result
    assert all(not r.samples for r in results if r.position >= 2 and r.row_index == solved_row)


def test_token_gate_one_group_until_the_first_finishes_then_the_allowance():
    gate = TokenGate()
    assert gate.may_start(0, 100)
    gate.group_started()
    assert not gate.may_start(0, 100)  # no estimate yet
    gate.group_finished(40)
    gate.group_started()
    assert gate.may_start(40, 100)  # 40 queued + 40 in flight < 100
    gate.group_started()
    assert not gate.may_start(40, 100)  # 40 + 80 >= 100


def test_failure_breaker_trips_once_past_the_rate_and_names_the_types():
    from harness.rollout.pacing import FailureBreaker, RolloutFailureRate

    breaker = FailureBreaker(window=4, max_frac=0.5)
    for failed, kind in [(False, ""), (True, "SandboxDied"), (True, "SandboxDied")]:
        breaker.record(failed, kind)  # window not full yet
    breaker.record(False)  # 2 of 4: not more than half
    with pytest.raises(
        RolloutFailureRate, match=r"3 of the last 4 rollouts failed \(GenerationError x1, Sandbox"
    ):
        breaker.record(True, "GenerationError")
    breaker.record(True, "GenerationError")  # rollouts still finishing while the run unwinds: no second raise


async def test_generation_stays_within_the_token_allowance_until_the_trainer_raises_it(tmp_path):
    """The worker is never more than its allowance (max_staleness steps of tokens) ahead of the trainer:
    with the allowance held still, dispatch stops within one group of it; raised, dispatch resumes."""

    def script(prompt: str, call: int) -> str:  # half right: every group has a spread and is kept
        word = prompt.split("user\n")[-1].split("<|im_end|>")[0]
        return word[::-1] if call % 2 else "no idea"

    loop = make_loop(
        script,
        dataset=prompt_rows(*(f"word{i}" for i in range(40))),
        reward_funcs=[exact_reverse],
        tmp_path=tmp_path,
        max_steps=-1,
        num_train_epochs=1,
    )
    allowance = 300
    loop.token_allowance = types.SimpleNamespace(value=allowance)
    loop.held_event = threading.Event()
    results: list[GroupResult] = []
    stop = anyio.Event()
    loop.stop_event = types.SimpleNamespace(is_set=stop.is_set)

    async def settle() -> int:
        """Collect until nothing new arrives for half a second; the tokens produced so far."""
        quiet_since = anyio.current_time()
        while anyio.current_time() - quiet_since < 0.5:
            try:
                results.append(loop.rollout_buffer.get_nowait())
                quiet_since = anyio.current_time()
            except queue.Empty:
                await anyio.sleep(0.01)
        return sum(result.num_tokens for result in results)

    async def drive() -> None:
        produced = await settle()
        largest = max(result.num_tokens for result in results)
        assert allowance <= produced <= allowance + largest  # stopped within one group of it
        assert loop.held_event.is_set()  # the trainer can tell that nothing more is coming
        held = len(results)
        assert 0 < held < 40
        loop.token_allowance.value = 2 * allowance
        with anyio.fail_after(5):
            while loop.held_event.is_set():
                await anyio.sleep(0.005)
        produced = await settle()
        assert len(results) > held and produced <= 2 * allowance + largest
        assert len(results) < 40 and loop.held_event.is_set(), len(results)
        stop.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(drive)
            await loop.run()
    # a group's tokens are counted as packed: its prompt once, not once per rollout
    first = results[0]
    raw = sum(len(sample.sequence.input_ids) for sample in first.samples)
    assert first.num_tokens == packed_token_count(first.samples) < raw

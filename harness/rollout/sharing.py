"""Several rollout worker processes: what they share, so that together they behave as one worker.

One worker process runs every rollout by default; it costs about 1 ms of CPU per turn, so a
run with many short turns can be bound by that one core. With `num_rollout_workers` = N the trainer spawns
N worker processes (harness/rollout/worker.py), each with its own environments, sandboxes, tool executor
and connections to the generation servers, and all writing to the one queue the trainer reads. They share:

- the prompts: a cursor over prompt positions, from which each process claims the next position as it is
  ready for another group, so every position goes to exactly one process and a faster process takes more
  (a streaming dataset, which cannot be repositioned, is dealt round-robin instead: process k takes rows
  k, k + N, ...). Resume positions are the trainer's as before: the cursor starts at the first position
  not trained, and the positions done past it are skipped by whichever process claims them;
- the token allowance: one TokenGate whose counts (groups in flight, tokens queued, the per-group estimate)
  live in shared memory, checked and updated under one lock, so N processes stay within the allowance
  exactly as one would, and staleness is unchanged (the policy version is one shared value);
- the stop and failure channels and the policy version, as one worker has them;
- which generation servers are live: one record for the run that the trainer's router holds too
  (harness/generation/server_states.py), so a server dropped by any process is dropped for all.

Metrics: each process sends its own windows, and the trainer's handle combines those drained together
(`combine_windows`): events (turns, tool calls, failures, latencies) merge as one process's would; the
levels each process samples of itself (rollouts in flight, its concurrency cap, its sandboxes) are summed
over the processes, each process's mean first; what every process observes of the same servers and engines
(the /metrics polls, servers and engines live or lost) is taken once, as the mean of the processes' values
(a count as the largest), not added up N times. Server drops and re-admissions are counted in the shared
record and each reported by one process only, so they add up as events do.

max_concurrent_rollouts, sandbox_min_idle and sandbox_engine_max_sandboxes are totals: each process gets
its share (rounded up). Group ids are kept distinct by striding (process k numbers its groups k, k + N, ...).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, overload

from harness.metrics import MetricsWindow, reduction
from harness.rollout.pacing import TokenGate

# Sampled by each process of itself: the run's level is the sum of the processes'.
PROCESS_LEVELS = frozenset({"rollout/concurrency", "rollout/concurrency_cap", "sandbox/containers"})
# Observed by every process of the same servers and engines: the run's value is one process's.
SHARED_OBSERVATIONS = frozenset(
    {
        "rollout/vllm_kv_cache_usage_frac",
        "rollout/vllm_running_requests",
        "rollout/vllm_queued_requests",
        "rollout/vllm_preemption_count",
        "rollout/vllm_prefix_cache_hit_frac",
        "rollout/vllm_servers_live",
        "sandbox/engines_live",
        "sandbox/engine_lost_count",
    }
)
_COMBINED = PROCESS_LEVELS | SHARED_OBSERVATIONS


@dataclass(frozen=True)
class WorkerShare:
    """What one worker process holds of the state shared by all (made by the trainer's handle)."""

    index: int  # this process's number, 0 .. count - 1
    count: int
    cursor: Any  # multiprocessing.Value("q"): the next prompt position to claim
    gate_counts: Any  # multiprocessing.Array("q", TokenGate.SHARED_SLOTS)

    @classmethod
    def create(cls, context: Any, count: int, start_position: int) -> WorkerShare:
        return cls(
            index=0,
            count=count,
            cursor=context.Value("q", start_position),
            gate_counts=context.Array("q", TokenGate.SHARED_SLOTS),
        )

    def for_process(self, index: int) -> WorkerShare:
        return replace(self, index=index)

    def claim_positions(self) -> Iterator[int]:
        """Prompt positions for this process, each claimed from the shared cursor as it is asked for."""
        while True:
            with self.cursor.get_lock():
                position = int(self.cursor.value)
                self.cursor.value = position + 1
            yield position

    def owns_streamed_row(self, index: int) -> bool:
        return index % self.count == self.index

    def group_ids(self) -> Iterator[int]:
        return itertools.count(self.index, self.count)

    def gate(self) -> TokenGate:
        return TokenGate(shared=self.gate_counts)


@overload
def share_of(total: int, count: int) -> int: ...
@overload
def share_of(total: None, count: int) -> None: ...
def share_of(total: int | None, count: int) -> int | None:
    """One process's share of a total limit (rounded up, at least 1); None stays None."""
    if total is None:
        return None
    return max(1, -(-int(total) // count))


def combine_windows(per_process: list[list[dict[str, list[float]]]]) -> dict[str, list[float]]:
    """One metrics window (a MetricsWindow state) from the windows each worker process sent: see the module
    docstring for what is summed, what is taken once, and what merges as usual."""
    combined = MetricsWindow()
    across: dict[str, list[float]] = {}  # name -> each process's own reduced value
    for states in per_process:
        own = MetricsWindow()
        for state in states:
            own.merge({k: v for k, v in state.items() if k in _COMBINED})
            combined.merge({k: v for k, v in state.items() if k not in _COMBINED})
        for name, value in own.summary().items():
            if value == value:  # NaN: nothing recorded
                across.setdefault(name, []).append(value)
    for name, values in across.items():
        if name in PROCESS_LEVELS:
            combined.add(name, sum(values))
        elif reduction(name) == "sum":
            combined.add(name, max(values))
        else:
            combined.add(name, sum(values) / len(values))
    return combined.state()
